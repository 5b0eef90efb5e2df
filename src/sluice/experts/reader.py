"""Reader threads with priorities: demand reads go before speculative (prefetch) reads.

A FIFO pool would queue the current layer's demand misses behind the next layer's
prefetches (issued earlier, after attention), stalling the layer that is waiting now.
``os.preadv`` releases the GIL, so a few threads keep several O_DIRECT reads in flight.

Each read carries a ``Ticket`` (``storage/priority.py``): its priority holds for the pieces
a large read is split into, may be raised while the read is queued or running (a prefetch
the layer turned out to need), and a cancelled ticket stops the read between pieces.
"""

from __future__ import annotations

from concurrent.futures import Future

from ..storage.priority import DEMAND, PREFETCH, PriorityPool, Ticket

__all__ = ["DEMAND", "PREFETCH", "ReaderPool", "Ticket"]


class ReaderPool(PriorityPool):
    """``threads`` reader threads, at most half of them (at least one) on prefetches at once: a
    prefetch holds its thread until all its pieces are read, and the layer that waits now must
    find a thread for its demand reads."""

    def __init__(self, threads: int, name: str = "sluice-read", low_cap: int | None = None):
        threads = max(1, threads)
        super().__init__(threads, name, low_cap=low_cap if low_cap is not None else max(1, threads // 2))

    def submit(self, fn, *args, priority: int = DEMAND, ticket: Ticket | None = None) -> Future:
        """Run ``fn(*args)`` on a reader thread; ``ticket`` (default: a new one at ``priority``)
        orders it and its pieces, and can raise its priority or cancel it later."""
        return super().submit(fn, *args, ticket=ticket if ticket is not None else Ticket(priority))
