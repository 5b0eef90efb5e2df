"""The processes that have a disk tier open, and the one size bound they share (``disk_tier.py``).

Each process that opens a tier with a size writes that size into a record of its own,
``openers/<pid>.<8 hex>``, and holds an exclusive ``flock`` on it for as long as the tier is open.
The tier's bound is the smallest size among the records whose lock is held: a record whose lock
is free belongs to a process that closed the tier without removing it or was killed, bounds
nothing, and is removed. Anything else in ``openers/`` (a link, a directory, another name) is
not a record and is left alone. Callers hold the tier lock (``DiskTier._locked``), so a record
is never read between its creation and its lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import stat
from pathlib import Path

OPENERS = "openers"
OPENER_RE = re.compile(r"^(\d+)\.[0-9a-f]{8}$")


def register(tier_dir: Path, capacity: int) -> tuple[int, Path]:
    """Record ``capacity`` as this opener's size; ``(fd, path)`` of the record, locked until ``unregister``."""
    path = tier_dir / OPENERS / f"{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, f"{capacity}\n".encode())
    except OSError:
        os.close(fd)
        with contextlib.suppress(OSError):
            path.unlink()
        raise
    return fd, path


def unregister(fd: int, path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()
    os.close(fd)


def scan(tier_dir: Path, own: Path | None, capacity: int | None) -> tuple[int | None, int]:
    """(the smallest size of the live openers and ``capacity``, or None; how many live openers, the
    record ``own`` counted as one). Removes the records of openers that are gone."""
    bound, count = capacity, int(own is not None)
    for f in (tier_dir / OPENERS).iterdir():
        if not OPENER_RE.match(f.name) or f == own:
            continue
        try:
            fd = os.open(f, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:  # gone, or a link: not a record a tier wrote
            continue
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue  # a directory or device under a record's name: not ours, left alone
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:  # its opener holds it: alive
                text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
                if text.isdigit() and int(text) > 0:
                    bound = int(text) if bound is None else min(bound, int(text))
                    count += 1
                continue
            with contextlib.suppress(FileNotFoundError):
                f.unlink()  # its opener is gone (closed without removing it, or killed)
        finally:
            os.close(fd)
    return bound, count


__all__ = ["OPENERS", "OPENER_RE", "register", "scan", "unregister"]
