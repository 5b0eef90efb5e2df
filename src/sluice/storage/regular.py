"""Open only regular files: a FIFO, directory or device where a model file belongs is refused.

``os.open`` of a FIFO blocks until a writer appears (forever, for a hostile or stale one), and a
directory or a character device (``/dev/zero``) opens and then reads nonsense or without end. So
every model file (checkpoint shard, container file, manifest, tokenizer file) and every disk-tier
entry is opened here: with ``O_NONBLOCK`` (a FIFO opens at once), then ``fstat`` must say it is a
regular file, and ``O_NONBLOCK`` is cleared again.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat


class NotRegularFileError(OSError):
    """A path that should be a regular file is a FIFO, a directory, a device or a socket."""


def kind(mode: int) -> str:
    """What a file of this ``st_mode`` is, in words."""
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def open_regular(path, flags: int = os.O_RDONLY) -> int:
    """A descriptor of the regular file ``path`` (``flags`` as for ``os.open``, plus ``O_CLOEXEC``);
    ``NotRegularFileError`` (``errno`` EINVAL, the file named) for anything else, without blocking."""
    path = os.fspath(path)
    fd = os.open(path, flags | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFileError(errno.EINVAL, f"is {kind(mode)}, not a regular file", path)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path, limit: int | None = None) -> bytes:
    """The whole regular file ``path``; past ``limit`` bytes a ``FileTooLargeError`` (nothing read)."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if limit is not None and size > limit:
            raise FileTooLargeError(errno.EFBIG, f"is {size} bytes, more than the {limit} bytes allowed",
                                    os.fspath(path))
        chunks, total = [], 0
        while True:
            b = os.read(fd, max(1 << 16, size - total + 1))
            if not b:
                break
            total += len(b)
            if limit is not None and total > limit:  # grew while being read
                raise FileTooLargeError(errno.EFBIG, f"is more than the {limit} bytes allowed", os.fspath(path))
            chunks.append(b)
        return b"".join(chunks)
    finally:
        os.close(fd)


class FileTooLargeError(OSError):
    """A file read whole is larger than its cap (``errno`` EFBIG)."""
