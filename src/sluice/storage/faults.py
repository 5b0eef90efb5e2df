"""Fault injection for storage: fail the Nth read with an I/O error, or return it short.

Used by the tests (and handy to rehearse a failing disk). ``FaultySource`` is a wrapping
byte source that consults a shared ``FaultPlan`` before each aligned read; ``inject_faults``
installs it on every source a tensor store (a ``Checkpoint`` or ``Container``) has open or
opens later, through the store's own ``sources.wrap`` hook.
"""

from __future__ import annotations

import errno
import threading

from .source import ByteSource, WrappedSource


class FaultPlan:
    """Shared countdown: read number ``fail_at`` raises EIO, read number ``short_at`` is short.

    Only reads of sources whose name contains ``path_filter`` count."""

    def __init__(self, fail_at: int | None = None, short_at: int | None = None, path_filter: str = ""):
        self.fail_at, self.short_at, self.path_filter = fail_at, short_at, path_filter
        self.reads = 0
        self.injected = 0
        self._lock = threading.Lock()

    def next(self, name: str) -> str | None:
        if self.path_filter not in name:
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


class FaultySource(WrappedSource):
    """A source whose aligned reads (and so ``read_into``, built on them) fail or come back short
    when its ``FaultPlan`` says so; everything else is the inner source's."""

    def __init__(self, inner: ByteSource, plan: FaultPlan):
        super().__init__(inner)
        self.plan = plan

    def read_aligned(self, buf, offset: int) -> int:
        what = self.plan.next(self.name)
        if what == "fail":
            raise OSError(errno.EIO, f"injected I/O error reading at offset {offset}", self.name)
        got = self.inner.read_aligned(buf, offset)
        return got // 2 if what == "short" else got


def inject_faults(store, plan: FaultPlan) -> FaultPlan:
    """Wrap every source ``store`` (a Checkpoint or Container) has open, and any it opens later."""
    store.sources.wrap(lambda s: FaultySource(s, plan))
    return plan
