"""URL checks and secrets for the remote stores: what is checked before the object store client sees it.

- ``check_endpoint(value, name)``: an S3 endpoint (``AWS_ENDPOINT_URL``, ``AWS_ENDPOINT_URL_S3``,
  ``AWS_ENDPOINT``, a profile's ``endpoint_url``, the ``endpoint`` option) must be an ``http://`` or
  ``https://`` URL with a host. The client (obstore) panics on a malformed one when the first
  request is made; here it is an ``InvalidEndpointError`` naming the variable and its value.
- ``split_userinfo(url)``: a URL's ``user:password@`` part, taken off; the HTTP store sends it as
  HTTP Basic auth (``basic_auth_header``), and the password joins ``SECRETS``.
- ``mask(text)``: every known secret (AWS secret keys and session tokens from the environment or a
  profile file, URL passwords) replaced by ``***``; ``mask_url(url)`` masks a URL's password. Every
  message the remote stores raise, and every ``sluice: error:`` line, goes through ``mask``.
"""

from __future__ import annotations

import base64
import os
import re
from urllib.parse import unquote, urlsplit

SECRETS: set[str] = set()  # secrets Sluice was given: masked in every message (``mask``)
ENDPOINT_VARS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT")
_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*://)([^/?#@]*)@")


class InvalidEndpointError(OSError):
    """An S3 endpoint that is not an http(s) URL with a host."""


def check_endpoint(value: str, name: str) -> str:
    """``value`` if it is an ``http(s)://host[:port][/path]`` URL, else ``InvalidEndpointError`` naming
    ``name`` (the variable or option it came from)."""
    why = None
    if not value.strip():
        why = "is empty (unset it, or give an endpoint such as http://127.0.0.1:9000)"
    else:
        try:
            parts = urlsplit(value.strip())
            host, _ = parts.hostname, parts.port  # .port raises ValueError for a bad one
        except ValueError as e:
            why = f"is not a URL ({e})"
        else:
            if parts.scheme.lower() not in ("http", "https"):
                why = ("is not an http:// or https:// URL" if parts.scheme else "is not a URL (no http:// or https://)")
            elif not host:
                why = "names no host"
            elif any(c.isspace() for c in value.strip()):
                why = "is not a URL (it holds white space)"
    if why:
        raise InvalidEndpointError(f"{name}={value!r} {why}; an S3 endpoint is an http:// or https:// URL "
                                   "such as http://127.0.0.1:9000")
    return value.strip()


def environment_endpoints() -> dict[str, str]:
    """The endpoint variables set in the environment (the client reads them too), each checked."""
    return {v: check_endpoint(os.environ[v], v) for v in ENDPOINT_VARS if v in os.environ}


def split_userinfo(url: str) -> tuple[str, tuple[str, str] | None]:
    """``(url without its user:password@, (user, password) or None)``; the password joins ``SECRETS``."""
    m = _USERINFO.match(url)
    if not m:
        return url, None
    user, _, password = m.group(2).partition(":")
    user, password = unquote(user), unquote(password)
    if password:
        SECRETS.add(password)
        SECRETS.add(m.group(2).partition(":")[2])  # as written (percent-encoded) too
    return m.group(1) + url[m.end():], (user, password)


def basic_auth_header(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode("ascii")


def mask_url(url: str) -> str:
    """``url`` with the password of its ``user:password@`` part as ``***`` (the password joins ``SECRETS``)."""
    m = _USERINFO.match(url)
    if not m or ":" not in m.group(2):
        return url
    split_userinfo(url)
    user = m.group(2).partition(":")[0]
    return f"{m.group(1)}{user}:***@{url[m.end():]}"


def mask(text: str) -> str:
    """``text`` with every secret Sluice knows of (``SECRETS``, the AWS secret key and session token in
    the environment) and any URL password replaced by ``***``."""
    text = re.sub(r"([A-Za-z][A-Za-z0-9+.\-]*://[^/?#@\s:]*):[^/?#@\s]+@", r"\1:***@", text)
    env = {os.environ.get("AWS_SECRET_ACCESS_KEY"), os.environ.get("AWS_SESSION_TOKEN")}
    for secret in sorted((s for s in SECRETS | env if s and len(s) >= 6), key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


__all__ = ["ENDPOINT_VARS", "InvalidEndpointError", "SECRETS", "basic_auth_header", "check_endpoint",
           "environment_endpoints", "mask", "mask_url", "split_userinfo"]
