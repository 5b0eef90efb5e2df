"""The listening socket of ``sluice serve``, bound before anything is announced.

uvicorn binds its socket only once it runs, after the model has loaded and "serving on ..." was
printed, and a port in use then ends in its own log line and exit status 3. Binding here first
turns that into one ``sluice: error:`` line naming the address, before the model is loaded, and
the announcement names the port really bound (``--port 0``: the one the system chose).
"""

from __future__ import annotations

import errno
import socket

from ..errors import InvalidArgumentError, SluiceError


class BindError(SluiceError):
    """The server's address cannot be listened on (in use, not this machine's, not permitted)."""


def check_api_key(key: str | None) -> str | None:
    """``key`` as given, or ``None`` for no key; an empty or blank key (``--api-key ""``, an empty
    ``SLUICE_API_KEY``) is refused rather than read as "no key", and so is one with surrounding
    spaces (the ``Authorization`` header's token is stripped, so it could never match)."""
    if key is None:
        return None
    if not isinstance(key, str):
        raise InvalidArgumentError(f"api_key must be a string, got {type(key).__name__}")
    if not key.strip():
        raise InvalidArgumentError("--api-key (or SLUICE_API_KEY) is empty: give a key, or unset it to serve "
                                   "without one")
    if key != key.strip():
        raise InvalidArgumentError("--api-key (or SLUICE_API_KEY) begins or ends with whitespace, which no "
                                   "Authorization header can match: remove it")
    return key


def bind(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port`` (IPv4 or IPv6, as ``host`` resolves), or ``BindError``."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise BindError(f"cannot serve on {where}: the host does not resolve ({e.strerror})") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT does not block
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            why = "the port is in use by another process (choose another with --port)"
        elif e.errno == errno.EADDRNOTAVAIL:
            why = "the address is not one of this machine's (--host)"
        elif e.errno == errno.EACCES:
            why = "permission denied (ports below 1024 need privileges)"
        else:
            why = e.strerror or str(e)
        raise BindError(f"cannot serve on {where}: {why}") from None
    sock.set_inheritable(True)
    return sock
