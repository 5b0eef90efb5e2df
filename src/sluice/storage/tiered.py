"""Byte sources and stores read through the local disk tier (``disk_tier.DiskTier``).

``TieredSource`` wraps a remote byte source: every range read is looked up in the tier by
(URL, version, offset, length), and a range fetched from the inner source is kept there. The
version is the object's ETag, else its size and Last-Modified, never its size alone: an object
whose server sends neither (read only with ``--allow-unversioned-remote``) is never kept.
``TieredStore`` wraps a remote store so that the sources it opens are ``TieredSource``s;
``location.open_store``/``open_source`` put them in place when a tier is given, so nothing above
storage knows the tier is there.
"""

from __future__ import annotations

from .buffers import ALIGN
from .disk_tier import DiskTier
from .tier_entry import STAGING_BYTES, Key
from .source import ByteSource, WrappedSource
from .store import Store


class TieredSource(WrappedSource):
    """A remote byte source read through a ``DiskTier``: every range read (aligned reads, ``read_into``,
    ``pread``) is looked up in the tier by (URL, version, offset, length), and a range fetched from
    ``inner`` is kept there. ``model``: the model (store) the entries are listed under.

    Stats (the model's shared ``ReadStats``): a tier hit counts its bytes in ``bytes_read``,
    ``tier_hits`` and ``tier_bytes``; a miss counts ``tier_misses`` and the inner source counts
    what it fetched (``remote_bytes``)."""

    def __init__(self, inner: ByteSource, tier: DiskTier, model: str):
        super().__init__(inner)
        self.tier, self.model = tier, model
        tier.forget_other_versions(inner.name, inner.version)  # the object changed: its old entries are dead

    # Aligned reads are asked in pages, as from a local O_DIRECT file, whatever the inner source's own
    # alignment (1 for a remote object): an expert record then lands at a page-aligned address in its
    # cache slot, and a hit is one preadv of the entry's header and payload straight into the slot,
    # with no staging copy (``tier_entry.read_entry``). A record at an unaligned offset costs a few KB
    # more fetched on a miss (the pages around it); ``read_into``/``pread`` keep their exact range.
    alignment = ALIGN

    # a hit read into a destination that is not page-aligned goes through the tier's staging buffer,
    # which a reading thread keeps besides what the remote client holds during a miss
    transfer_bytes = property(lambda self: self.inner.transfer_bytes + STAGING_BYTES)

    def read_aligned(self, buf: memoryview, offset: int) -> int:
        n = max(0, min(len(buf), self.size - offset))
        if n:
            self._read(buf[:n], offset, buf)  # a read clipped at the end: its last page may be read whole
        return n

    def read_into(self, dest: memoryview, offset: int) -> None:
        n = len(dest)
        if offset < 0 or offset + n > self.size:
            raise OSError(f"read of {n} bytes at offset {offset} is outside the object ({self.size} bytes): "
                          f"{self.name}")
        if n:
            self._read(dest, offset)

    def pread(self, nbytes: int, offset: int) -> bytes:
        # metadata (safetensors headers) is kept in the tier too: an entry is keyed by URL and ETag, as
        # the metadata cache the inner source keeps without a tier (``meta_cache.py``)
        n = max(0, min(nbytes, self.size - offset))
        out = bytearray(n)
        if n:
            self._read(memoryview(out), offset)
        return bytes(out)

    def _read(self, dest: memoryview, offset: int, room: memoryview | None = None) -> None:
        if not self.version:  # an unversioned object (--allow-unversioned-remote): never kept, always fetched
            self.inner.read_into(dest, offset)
            self.stats.tier_miss()
            return
        key = Key(self.name, self.version, offset, len(dest))
        if self.tier.get(key, dest, room):
            self.stats.tier_hit(len(dest))
            return
        self.inner.read_into(dest, offset)
        self.stats.tier_miss()
        self.tier.put(key, dest, self.model)


class TieredStore(Store):
    """A remote store whose data members are opened as ``TieredSource``s (metadata read whole, the
    config and the index, goes to the remote store as before)."""

    def __init__(self, inner: Store, tier: DiskTier):
        self.inner, self.tier = inner, tier
        self.location = inner.location

    def locate(self, name: str) -> str:
        return self.inner.locate(name)

    def exists(self, name: str) -> bool:
        return self.inner.exists(name)

    def is_directory(self) -> bool:
        return self.inner.is_directory()

    def names(self) -> list[str]:
        return self.inner.names()

    def read_bytes(self, name: str, limit: int | None = None) -> bytes:
        return self.inner.read_bytes(name, limit)

    def open(self, name: str, *, direct: bool | None = None, stats=None) -> ByteSource:
        return TieredSource(self.inner.open(name, direct=direct, stats=stats), self.tier, self.location)

    def __repr__(self) -> str:
        return f"<TieredStore {self.location} via {self.tier.dir}>"


__all__ = ["TieredSource", "TieredStore"]
