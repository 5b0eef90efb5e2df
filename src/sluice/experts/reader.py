"""Reader threads with two lanes: demand reads go before speculative (prefetch) reads.

A FIFO pool would queue the current layer's demand misses behind the next layer's
prefetches (issued earlier, after attention), stalling the layer that is waiting now.
Every free thread takes the oldest demand read first and a prefetch only when no demand
waits. A prefetch that turns into a demand while still queued (the layer it was guessed for
now runs and needs it) is ``promote``d to the demand lane, so it does not wait behind other
prefetches either; one already running is simply waited for (never read twice).

This matters most for remote sources, where a read is a round trip of tens of milliseconds:
``os.preadv`` and the remote client both release the GIL, so a few threads keep several
reads in flight.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future

DEMAND, PREFETCH = 0, 1


class _Item:
    __slots__ = ("fut", "fn", "args", "live")

    def __init__(self, fut: Future, fn, args: tuple):
        self.fut, self.fn, self.args, self.live = fut, fn, args, True


class ReaderPool:
    def __init__(self, threads: int, name: str = "sluice-read"):
        self._lanes: tuple[deque[_Item], deque[_Item]] = (deque(), deque())  # DEMAND, PREFETCH
        self._queued: dict[Future, _Item] = {}  # queued prefetches, for promote
        self._cv = threading.Condition()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
                         for i in range(max(1, threads))]
        for t in self._threads:
            t.start()

    def submit(self, fn, *args, priority: int = DEMAND) -> Future:
        fut: Future = Future()
        item = _Item(fut, fn, args)
        with self._cv:
            if self._closed:
                raise RuntimeError("reader pool is closed")
            self._lanes[DEMAND if priority == DEMAND else PREFETCH].append(item)
            if priority != DEMAND:
                self._queued[fut] = item
            self._cv.notify()
        return fut

    def promote(self, fut: Future) -> bool:
        """Move a queued prefetch to the end of the demand lane. True when it was still queued
        (False: already running, done, cancelled, or a demand read)."""
        with self._cv:
            item = self._queued.pop(fut, None)
            if item is None or fut.done():
                return False
            item.live = False  # its place in the prefetch lane is skipped
            self._lanes[DEMAND].append(_Item(fut, item.fn, item.args))
            self._cv.notify()
            return True

    def queued(self) -> tuple[int, int]:
        """(demand, prefetch) reads waiting for a thread (cancelled ones included until taken)."""
        with self._cv:
            return tuple(sum(1 for i in lane if i.live) for lane in self._lanes)

    def _take(self) -> _Item | None:
        with self._cv:
            while True:
                for lane in self._lanes:
                    while lane:
                        item = lane.popleft()
                        if item.live:
                            self._queued.pop(item.fut, None)
                            return item
                if self._closed:
                    return None
                self._cv.wait()

    def _work(self) -> None:
        while True:
            item = self._take()
            if item is None:
                return
            if not item.fut.set_running_or_notify_cancel():
                continue  # cancelled while queued
            try:
                item.fut.set_result(item.fn(*item.args))
            except BaseException as e:  # delivered to whoever waits on the future
                item.fut.set_exception(e)

    def shutdown(self) -> None:
        """Cancel what has not started, let running reads finish, stop the threads."""
        with self._cv:
            self._closed = True
            for lane in self._lanes:
                while lane:
                    item = lane.popleft()
                    if item.live:
                        item.fut.cancel()
            self._queued.clear()
            self._cv.notify_all()
        for t in self._threads:
            t.join()
