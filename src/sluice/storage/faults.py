"""Fault injection for storage: fail the Nth read with an I/O error, or return it short.

Used by the tests (and handy to rehearse a failing disk): wrap every open file of a tensor
store so that reads through it can fail on command.
"""

from __future__ import annotations

import errno
import threading

from .file import LocalFile


class FaultPlan:
    """Shared countdown: read number ``fail_at`` raises EIO, read number ``short_at`` is short."""

    def __init__(self, fail_at: int | None = None, short_at: int | None = None, path_filter: str = ""):
        self.fail_at, self.short_at, self.path_filter = fail_at, short_at, path_filter
        self.reads = 0
        self.injected = 0
        self._lock = threading.Lock()

    def next(self, path: str) -> str | None:
        if self.path_filter not in path:
            return None
        with self._lock:
            self.reads += 1
            if self.reads == self.fail_at:
                self.injected += 1
                return "fail"
            if self.reads == self.short_at:
                self.injected += 1
                return "short"
        return None


class FaultyFile:
    """A ``LocalFile`` stand-in that consults a ``FaultPlan`` before each aligned read."""

    def __init__(self, inner: LocalFile, plan: FaultPlan):
        self._inner, self._plan = inner, plan

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def read_aligned(self, buf, offset: int) -> int:
        what = self._plan.next(self._inner.path)
        if what == "fail":
            raise OSError(errno.EIO, f"injected I/O error reading at offset {offset}", self._inner.path)
        got = self._inner.read_aligned(buf, offset)
        return got // 2 if what == "short" else got


def inject_faults(store, plan: FaultPlan) -> FaultPlan:
    """Wrap every file ``store`` (a Checkpoint or Container) has open, and any it opens later."""
    files = store._files
    for path, f in list(files.items()):
        files[path] = FaultyFile(f, plan)
    opener = store.file

    def file(path: str):
        f = opener(path)
        if not isinstance(f, FaultyFile):
            f = files[path] = FaultyFile(f, plan)
        return f

    store.file = file
    return plan
