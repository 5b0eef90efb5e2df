"""The byte sources one model (a checkpoint or a container) has open."""

from __future__ import annotations

import threading
from collections.abc import Callable

from ..errors import CheckpointError
from .location import open_source
from .source import ByteSource, ReadStats
from .store import Store

Wrapper = Callable[[ByteSource], ByteSource]


class Sources:
    """The byte sources one model has open, by location, each opened once.

    ``direct`` and ``stats`` are passed to every source opened (``direct=None``: probe
    O_DIRECT); ``wrap(fn)`` passes every open source, and every one opened later, through
    ``fn`` (fault injection today). A failure to open is a ``CheckpointError`` naming it.
    ``store``: the model's store; a location that is one of its members (``store.locate(name)``)
    is opened through it (one client and its options for all of a remote model's files).
    """

    def __init__(self, *, direct: bool | None = None, stats: ReadStats | None = None, store: Store | None = None):
        self.store = store
        self.direct = direct
        self.stats = stats if stats is not None else ReadStats()
        self._open: dict[str, ByteSource] = {}
        self._wrappers: list[Wrapper] = []
        self._lock = threading.Lock()

    def get(self, location: str) -> ByteSource:
        s = self._open.get(location)
        if s is None:
            with self._lock:
                s = self._open.get(location)
                if s is None:
                    try:
                        s = self._open_one(location)
                    except OSError as e:
                        raise CheckpointError(f"{location}: cannot open ({e.strerror or e})") from None
                    for fn in self._wrappers:
                        s = fn(s)
                    self._open[location] = s
        return s

    def _open_one(self, location: str) -> ByteSource:
        store = self.store
        if store is not None:
            name = location.rpartition("/")[2]
            if name and store.locate(name) == location:
                return store.open(name, direct=self.direct, stats=self.stats)
        return open_source(location, direct=self.direct, stats=self.stats)

    def wrap(self, fn: Wrapper) -> None:
        """Pass every open source, and every source opened from now on, through ``fn``."""
        with self._lock:
            self._wrappers.append(fn)
            for loc, s in list(self._open.items()):
                self._open[loc] = fn(s)

    def __iter__(self):
        return iter(list(self._open.values()))

    @property
    def direct_io(self) -> bool:
        """True when at least one source is open and every open one reads with O_DIRECT."""
        opened = list(self._open.values())
        return bool(opened) and all(s.direct_io for s in opened)

    @property
    def transfer_bytes(self) -> int:
        """The most memory one read in flight holds besides its destination, over the open sources."""
        return max((s.transfer_bytes for s in list(self._open.values())), default=0)

    def close(self) -> None:
        with self._lock:
            for s in self._open.values():
                s.close()
            self._open.clear()
