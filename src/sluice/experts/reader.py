"""Reader threads with priorities: demand reads go before speculative (prefetch) reads.

A FIFO pool would queue the current layer's demand misses behind the next layer's
prefetches (issued earlier, after attention), stalling the layer that is waiting now.
``os.preadv`` releases the GIL, so a few threads keep several O_DIRECT reads in flight.
"""

from __future__ import annotations

import itertools
import queue
import threading
from concurrent.futures import Future

DEMAND, PREFETCH = 0, 1


class ReaderPool:
    def __init__(self, threads: int, name: str = "sluice-read"):
        self._q: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = itertools.count()
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
                         for i in range(max(1, threads))]
        self._closed = False
        for t in self._threads:
            t.start()

    def submit(self, fn, *args, priority: int = DEMAND) -> Future:
        if self._closed:
            raise RuntimeError("reader pool is closed")
        fut: Future = Future()
        self._q.put((priority, next(self._seq), fut, fn, args))
        return fut

    def _work(self) -> None:
        while True:
            _, _, fut, fn, args = self._q.get()
            if fut is None:
                return
            if not fut.set_running_or_notify_cancel():
                continue  # cancelled while queued
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # delivered to whoever waits on the future
                fut.set_exception(e)

    def shutdown(self) -> None:
        """Cancel what has not started, let running reads finish, stop the threads."""
        self._closed = True
        while True:
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                break
            if item[2] is not None:
                item[2].cancel()
        for _ in self._threads:
            self._q.put((-1, next(self._seq), None, None, ()))
        for t in self._threads:
            t.join()
