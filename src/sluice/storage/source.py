"""The byte-source seam: what every kind of storage offers the readers above it.

A ``ByteSource`` is a read-only run of bytes with a name (a path or a URL). Everything
above storage (checkpoint and container tables, the expert readers, spine streaming) reads
through this interface and never asks which kind of source it has. A source tells its
callers the rules of its fast path: ``alignment`` (offset, length and buffer address of
``read_aligned`` are multiples of it) and ``read_size`` (how long sequential reads are best
split). ``read_into`` (any offset, any destination) and ``pread`` (small metadata reads) are
built here on ``read_aligned``, so a new kind of source implements ``read_aligned`` and
declares its attributes; the local file (``file.LocalFile``) is the first.

``WrappedSource`` forwards everything to an inner source and is the base of sources that
change reads on the way (fault injection, ``faults.FaultySource``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from .buffers import AlignedBuffer, align_down, align_up


@dataclass
class ReadStats:
    """Bytes and reads issued to storage (thread-safe counters).

    ``bytes_read`` counts every byte storage delivered: from local files, remote stores and the
    disk tier. Of those, ``remote_bytes`` came from a remote store and ``tier_bytes`` from the
    disk tier (``tier_hits`` reads); ``tier_misses`` counts reads the tier did not have."""

    bytes_read: int = 0
    reads: int = 0
    remote_bytes: int = 0
    tier_hits: int = 0
    tier_misses: int = 0
    tier_bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, nbytes: int, remote: bool = False) -> None:
        with self._lock:
            self.bytes_read += nbytes
            self.reads += 1
            if remote:
                self.remote_bytes += nbytes

    def tier_hit(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_read += nbytes
            self.reads += 1
            self.tier_hits += 1
            self.tier_bytes += nbytes

    def tier_miss(self) -> None:
        with self._lock:
            self.tier_misses += 1


class ByteSource:
    """A read-only run of bytes. Every source has these attributes:

    - ``name`` (str): where the bytes are, a path or a URL; errors name it.
    - ``size`` (int): its length in bytes.
    - ``direct_io`` (bool): reads bypass the page cache by O_DIRECT.
    - ``alignment`` (int): ``read_aligned``'s offset, length and buffer address must be
      multiples of it (a power of two, at most the page size of ``AlignedBuffer``).
    - ``read_size`` (int): long sequential reads are best issued in pieces of this size.
    - ``transfer_bytes`` (int): memory a read in flight holds besides the caller's buffer, at most
      (0 for a local file; a remote source's response body before it is copied). The planner
      counts it once per reader thread.
    - ``version`` (str): an identity of these bytes for cache keys; it changes when the
      bytes may have changed (a local file's inode, size and mtime; an object's ETag).
    - ``stats`` (``ReadStats``): bytes and reads issued, shared by a model's sources.
    """

    name: str
    size: int
    direct_io: bool = False
    alignment: int = 1
    read_size: int = 8 << 20
    transfer_bytes: int = 0
    version: str = ""
    stats: ReadStats

    def read_aligned(self, buf: memoryview, offset: int) -> int:
        """Fill ``buf`` from ``offset``; offset, ``len(buf)`` and the buffer's address are multiples of
        ``alignment``. Returns the bytes read, fewer than ``len(buf)`` only at the end of the source.
        Raises ``OSError`` naming the source on I/O errors."""
        raise NotImplementedError

    def read_into(self, dest: memoryview, offset: int) -> None:
        """Read exactly ``len(dest)`` bytes at any ``offset`` into ``dest`` (any alignment).

        Goes through an aligned, per-thread staging buffer of ``read_size`` bytes; used for
        spine tensors, which share pages with other tensors in a Hugging Face shard. Raises
        ``OSError`` naming the source for a range outside it or a short read.
        """
        n = len(dest)
        if offset < 0 or offset + n > self.size:
            raise OSError(f"read of {n} bytes at offset {offset} is outside the file ({self.size} bytes): {self.name}")
        a = self.alignment
        staging = self._staging()
        pos = 0
        while pos < n:
            start = offset + pos
            a0 = align_down(start, a)
            a1 = min(align_up(offset + n, a), a0 + align_down(staging.nbytes, a))
            got = self.read_aligned(staging.view(0, a1 - a0), a0)
            take = min(n - pos, a0 + got - start)
            if take <= 0:
                raise OSError(f"short read: wanted {n - pos} more bytes at offset {start}: {self.name}")
            dest[pos : pos + take] = staging.view(start - a0, take)
            pos += take

    def pread(self, nbytes: int, offset: int) -> bytes:
        """A small read (headers, manifests): up to ``nbytes`` at ``offset``, fewer only at the end."""
        n = max(0, min(nbytes, self.size - offset))
        out = bytearray(n)
        if n:
            self.read_into(memoryview(out), offset)
        return bytes(out)

    def close(self) -> None:
        """Release what the source holds (file descriptors, connections); idempotent."""

    def _staging(self) -> AlignedBuffer:
        local = self.__dict__.get("_staging_local")
        if local is None:
            local = self.__dict__.setdefault("_staging_local", threading.local())
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = AlignedBuffer(max(self.read_size, self.alignment))
        return buf

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} ({self.size} bytes)>"


class WrappedSource(ByteSource):
    """A source that forwards everything to ``inner``; subclasses change reads on the way.

    ``read_into`` is the generic one, built on this wrapper's ``read_aligned``, so a wrapper
    that changes ``read_aligned`` sees every read of tensor bytes; ``pread`` (metadata)
    goes straight to the inner source.
    """

    def __init__(self, inner: ByteSource):
        self.inner = inner

    name = property(lambda self: self.inner.name)
    size = property(lambda self: self.inner.size)
    direct_io = property(lambda self: self.inner.direct_io)
    alignment = property(lambda self: self.inner.alignment)
    read_size = property(lambda self: self.inner.read_size)
    transfer_bytes = property(lambda self: self.inner.transfer_bytes)
    version = property(lambda self: self.inner.version)
    stats = property(lambda self: self.inner.stats)

    def read_aligned(self, buf: memoryview, offset: int) -> int:
        return self.inner.read_aligned(buf, offset)

    def pread(self, nbytes: int, offset: int) -> bytes:
        return self.inner.pread(nbytes, offset)

    def close(self) -> None:
        self.inner.close()
