"""Read priorities that reach every piece of a read, and can change or be cancelled in flight.

A ``Ticket`` travels with one read: the expert provider creates it (demand or prefetch),
the reader pool runs the read with the ticket as the thread's current one, and a large
local read split into pieces (``file.py``) queues its pieces with the same ticket. So:

- a demand read's pieces go before a prefetch's pieces already queued (a FIFO piece pool
  would make the layer that waits now wait behind the next layer's guesses);
- a prefetch that turns out right is raised to demand priority (its remaining pieces jump
  the queue), one that turns out wrong is cancelled: its pieces not yet started are skipped
  and the read ends with ``ReadCancelled``, so a wrong guess costs at most the pieces in
  flight, not a whole record of bandwidth.

``PriorityPool`` runs queued tasks lowest ``(ticket.priority, submission order)`` first: a
heap of the queued tasks' priorities, rebuilt when a ticket is raised or cancelled (``poke``),
so a take costs a heap pop even with thousands queued (a prefill chunk's row reads; a scan of
the queue per take made a 32-token chunk's 3,000 row reads cost seconds). ``AHEAD``: reads for
a later forward (the next prefill chunk's table rows), taken only when no demand or prefetch
read of this one is queued.
``low_cap`` bounds how many of its threads may run speculative tasks at once, so that a
demand read arriving while guesses are in flight shares the disk with fewer of them.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import weakref
from concurrent.futures import Future
from contextlib import contextmanager

DEMAND, PREFETCH, AHEAD = 0, 1, 2


class ReadCancelled(Exception):
    """A speculative read was cancelled before all its bytes were read (never reaches a user)."""


class Ticket:
    __slots__ = ("priority", "cancelled")

    def __init__(self, priority: int = DEMAND):
        self.priority = priority
        self.cancelled = False

    def __repr__(self) -> str:
        return f"Ticket(priority={self.priority}, cancelled={self.cancelled})"

    def cancel(self) -> None:
        """Stop the read: its queued tasks and pieces are dropped, running pieces finish."""
        if not self.cancelled:
            self.cancelled = True
            for pool in list(_pools):
                pool.poke()

    def raise_to(self, priority: int) -> None:
        """Make the read (and its queued pieces) at least this urgent."""
        if priority < self.priority:
            self.priority = priority
            for pool in list(_pools):
                pool.poke()


_local = threading.local()
_pools: weakref.WeakSet = weakref.WeakSet()  # every PriorityPool: a raised ticket wakes them


def current() -> Ticket | None:
    """The ticket of the read this thread is running (None outside a ticketed read)."""
    return getattr(_local, "ticket", None)


@contextmanager
def carrying(ticket: Ticket | None):
    old = getattr(_local, "ticket", None)
    _local.ticket = ticket
    try:
        yield ticket
    finally:
        _local.ticket = old


class PriorityPool:
    """Worker threads that take the queued task with the lowest ticket priority (then the
    oldest); a task whose ticket is cancelled before it starts is dropped (its future
    cancelled). Each task runs with its ticket as the thread's ``current()``."""

    def __init__(self, threads: int, name: str, low_cap: int | None = None):
        self.low_cap = low_cap  # most threads running tasks above DEMAND priority at once (None: all)
        self._running_low = 0
        self._tasks: dict[int, tuple] = {}  # seq -> (ticket, future, fn, args)
        # (priority, seq) of the queued tasks: a heap, rebuilt after a poke (a ticket raised or
        # cancelled: the only ways a queued task's priority changes); entries of taken tasks skipped
        self._heap: list[tuple[int, int]] = []
        self._stale = False
        self._cv = threading.Condition()
        self._seq = itertools.count()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
                         for i in range(max(1, threads))]
        for t in self._threads:
            t.start()
        _pools.add(self)

    def poke(self) -> None:
        """Look at the queue again (a queued task's priority was raised)."""
        with self._cv:
            self._stale = True
            self._cv.notify_all()

    def submit(self, fn, *args, ticket: Ticket | None = None) -> Future:
        fut: Future = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("reader pool is closed")
            seq = next(self._seq)
            self._tasks[seq] = (ticket, fut, fn, args)
            heapq.heappush(self._heap, (ticket.priority if ticket is not None else DEMAND, seq))
            self._cv.notify()
        return fut

    @staticmethod
    def _priority(task) -> int:
        return task[0].priority if task[0] is not None else DEMAND

    def _take(self):
        with self._cv:
            while True:
                if not self._tasks:
                    if self._closed:
                        return None
                    self._cv.wait()
                    continue
                if self._stale:  # priorities changed: drop the cancelled (at once, cap or not), re-sort
                    self._stale = False
                    for dead in [q for q, t in self._tasks.items() if t[0] is not None and t[0].cancelled]:
                        self._tasks.pop(dead)[1].cancel()
                    self._heap = [(self._priority(t), q) for q, t in self._tasks.items()]
                    heapq.heapify(self._heap)
                    if not self._tasks:
                        continue
                heap = self._heap
                while heap[0][1] not in self._tasks:  # taken already
                    heapq.heappop(heap)
                seq = heap[0][1]
                low = self._priority(self._tasks[seq]) > DEMAND
                if low and self.low_cap is not None and self._running_low >= self.low_cap:
                    self._cv.wait()  # until a guess finishes, a task comes, or a ticket is raised
                    continue
                if low:
                    self._running_low += 1
                heapq.heappop(heap)
                return self._tasks.pop(seq), low

    def _work(self) -> None:
        while True:
            got = self._take()
            if got is None:
                return
            (ticket, fut, fn, args), low = got
            try:
                if ticket is not None and ticket.cancelled:
                    fut.cancel()
                if not fut.set_running_or_notify_cancel():
                    continue  # cancelled while queued
                try:
                    with carrying(ticket):
                        result = fn(*args)
                except BaseException as e:  # delivered to whoever waits on the future
                    fut.set_exception(e)
                else:
                    fut.set_result(result)
            finally:
                if low:
                    with self._cv:
                        self._running_low -= 1
                        self._cv.notify()

    def shutdown(self) -> None:
        """Cancel what has not started, let running tasks finish, stop the threads."""
        with self._cv:
            self._closed = True
            pending, self._tasks = list(self._tasks.values()), {}
            self._cv.notify_all()
        for _, fut, _, _ in pending:
            fut.cancel()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join()
