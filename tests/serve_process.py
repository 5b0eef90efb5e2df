"""Helpers for tests that run ``sluice serve`` as a real process on a free loopback port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time


def wait_for(pred, timeout: float = 20.0, what: str = "condition", interval: float = 0.005):
    """Poll ``pred`` until it is true (a bounded wait on an observable state, not a sleep)."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn_serve(model, *args: str, env: dict | None = None, stdout=subprocess.PIPE, timeout: float = 90.0,
                ready_path: str = "/health") -> tuple[subprocess.Popen, str]:
    """Start ``sluice serve MODEL --port P ARGS...`` and wait until ``ready_path`` answers 200.

    ``env`` defaults to this process's environment without ``SLUICE_API_KEY``. Returns the
    process and its base URL; the caller stops it (and reads its output) as its test needs.
    """
    import httpx

    port = free_port()
    if env is None:
        env = {k: v for k, v in os.environ.items() if k != "SLUICE_API_KEY"}
    proc = subprocess.Popen([sys.executable, "-m", "sluice.cli", "serve", str(model), "--port", str(port), *args],
                            stdout=stdout, stderr=subprocess.PIPE, text=True, env=env)
    url = f"http://127.0.0.1:{port}"

    def up():
        assert proc.poll() is None, proc.communicate()[1]
        try:
            return httpx.get(url + ready_path, timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_for(up, timeout=timeout, what="sluice serve to answer", interval=0.05)
    except BaseException:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        raise
    return proc, url
