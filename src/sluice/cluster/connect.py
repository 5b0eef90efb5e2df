"""Connecting to a Ray cluster: ``--ray auto`` or ``--ray ADDRESS``, in bounded time.

``auto`` joins only a cluster this user may mean: ``RAY_ADDRESS``, else a cluster this user
started on this machine (its ``gcs_server`` process is this user's), else a new local one;
never another user's cluster that a process listing shows (Ray's own ``address="auto"`` would
join it). A ``HOST:PORT`` is first checked to be listening, retried until ``timeout`` seconds
with a line on stderr every few seconds, then refused naming the cause.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time

from .errors import INSTALL_HINT, ClusterError, RayUnavailableError

DEFAULT_TIMEOUT_S = 60.0  # --ray-timeout: reaching the cluster, and placing and starting the workers
PROGRESS_EVERY_S = 5.0  # a "still waiting" line on stderr this often


def require_ray():
    """The ``ray`` module, or ``RayUnavailableError`` saying what to install."""
    try:
        import ray
    except ImportError:
        raise RayUnavailableError(INSTALL_HINT) from None
    return ray


def _host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of ``HOST:PORT`` or ``ray://HOST:PORT`` (``[v6]:PORT`` too); None if not that shape."""
    rest = address.split("://", 1)[1] if "://" in address else address
    host, sep, port = rest.rstrip("/").rpartition(":")
    if not sep or not port.isdigit() or not host:
        return None
    return host.strip("[]"), int(port)


def wait_listening(address: str, timeout: float, label: str | None = None, say=None) -> None:
    """Return once something accepts a TCP connection at ``address``; else ``ClusterError`` after
    ``timeout`` seconds naming what was seen (refused, unresolvable, no answer)."""
    label = label or f"--ray {address}"
    hp = _host_port(address)
    if hp is None:
        raise ClusterError(f"{label}: not an address; give HOST:PORT (e.g. 10.0.0.5:6379) or auto")
    host, port = hp
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    start = time.monotonic()
    next_say = start + PROGRESS_EVERY_S
    while True:
        left = timeout - (time.monotonic() - start)
        try:
            with socket.create_connection((host, port), timeout=max(0.2, min(2.0, left))):
                return
        except socket.gaierror as e:
            raise ClusterError(f"{label}: the host {host!r} does not resolve ({e.strerror})") from None
        except OSError as e:
            why = ("nothing is listening there (connection refused)" if isinstance(e, ConnectionRefusedError)
                   else f"no answer ({e.strerror or type(e).__name__})")
        now = time.monotonic()
        if now - start >= timeout:
            raise ClusterError(f"{label}: {why} for {timeout:.0f} s (--ray-timeout): no Ray cluster is "
                               f"running at {host}:{port} (start one there with: ray start --head --port {port})")
        if now >= next_say:
            say(f"sluice: waiting for a Ray cluster at {host}:{port}: {why}, {now - start:.0f} s of "
                f"{timeout:.0f} s (--ray-timeout)")
            next_say = now + PROGRESS_EVERY_S
        time.sleep(min(0.5, max(0.0, timeout - (now - start))))


def own_clusters() -> list[str]:
    """Addresses (``IP:PORT``) of the Ray clusters this user runs on this machine: the
    ``--gcs-address`` of the ``raylet`` processes whose owner is this user (as Ray's own
    ``address="auto"`` finds them, but never another user's; Linux ``/proc``, elsewhere none are
    found and ``auto`` starts a new cluster)."""
    import re

    uid = os.getuid() if hasattr(os, "getuid") else None
    found: list[str] = []
    try:
        pids = sorted((p for p in os.listdir("/proc") if p.isdigit()), key=int)
    except OSError:
        return found
    for pid in pids:
        try:
            if uid is not None and os.stat(f"/proc/{pid}").st_uid != uid:
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:
            continue
        if not argv or os.path.basename(argv[0]) != "raylet":
            continue
        for a in argv[1:]:
            m = re.match(r"--gcs[-_]address=(\S+:\d+)$", a)
            if m and m.group(1) not in found:
                found.append(m.group(1))
    return found


def connect(address: str, timeout: float = DEFAULT_TIMEOUT_S) -> str:
    """Connect this process to a Ray cluster; returns a line saying which (or that one was started).

    ``auto``: ``RAY_ADDRESS`` if set, else a cluster this user started on this machine (``ray
    start``), else a new local cluster (this process's, gone when it exits). Anything else is an
    address (``HOST:PORT`` or ``ray://HOST:PORT``). A process already connected stays on its
    cluster. ``timeout``: seconds to wait for the address to listen (``--ray-timeout``).
    """
    ray = require_ray()
    if ray.is_initialized():
        return "experts on the Ray cluster this process is connected to"
    quiet = dict(logging_level=logging.WARNING, log_to_driver=False, configure_logging=True)

    def join(addr: str, label: str) -> None:
        wait_listening(addr, timeout, label)
        try:
            ray.init(address=addr, **quiet)
        except (ConnectionError, ValueError, RuntimeError) as e:
            raise ClusterError(f"{label}: cannot connect to a Ray cluster there: {e}") from None

    if address != "auto":
        join(address, f"--ray {address}")
        return f"experts on the Ray cluster at {address}"
    env = os.environ.get("RAY_ADDRESS")
    if env:
        join(env, f"--ray auto: RAY_ADDRESS={env}")
        return f"experts on the Ray cluster at RAY_ADDRESS={env}"
    mine = own_clusters()
    if mine:
        join(mine[0], f"--ray auto: this user's cluster at {mine[0]}")
        more = f" (of {len(mine)} this user runs here: set RAY_ADDRESS to choose)" if len(mine) > 1 else ""
        return f"experts on the Ray cluster this user started on this machine, at {mine[0]}{more}"
    # a cluster of this process only: on loopback, dashboard off (Ray 2.60 itself turns its token
    # authentication on for a new local cluster, with a warning, unless RAY_AUTH_MODE is set)
    ray.init(include_dashboard=False, _node_ip_address="127.0.0.1", **quiet)
    return ("no Ray cluster of this user found (RAY_ADDRESS unset, none started here by this user; other "
            "users' clusters are never joined): started a local one for this process (ray start --head to "
            "run one that outlives it)")
