"""Eviction policies for the expert cache (also used by the trace replayer).

Keys are hashable, e.g. ``(layer, expert)``. The cache calls ``insert``/``access``/``remove``
and asks ``victim(evictable)`` for the key to evict among those it may evict (not in use
by the current layer, not being read). ``tick()`` advances time by one forward step.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Hashable


class Policy:
    name = "base"

    def tick(self) -> None:
        pass

    def insert(self, key: Hashable) -> None:
        raise NotImplementedError

    def access(self, key: Hashable) -> None:
        raise NotImplementedError

    def remove(self, key: Hashable) -> None:
        raise NotImplementedError

    def victim(self, evictable: Callable[[Hashable], bool]) -> Hashable | None:
        raise NotImplementedError


class LRU(Policy):
    """Evict the least recently used key."""

    name = "lru"

    def __init__(self):
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def insert(self, key):
        self._order[key] = None
        self._order.move_to_end(key)

    def access(self, key):
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key):
        self._order.pop(key, None)

    def victim(self, evictable):
        for key in self._order:
            if evictable(key):
                return key
        return None


class LFRU(Policy):
    """Decayed hotness: each access adds 1 to a score that halves every ``half_life`` ticks.

    Frequent *and* recent experts stay. Scores are kept in log space relative to a moving
    origin, so one lazy heap orders all keys in O(log n) per operation.
    """

    name = "lfru"

    def __init__(self, half_life: float = 64.0):
        self.rate = math.log(2.0) / half_life
        self.now = 0
        self._score: dict[Hashable, float] = {}
        self._heap: list[tuple[float, int, Hashable]] = []
        self._seq = 0

    def tick(self):
        self.now += 1

    def _push(self, key, score):
        self._score[key] = score
        self._seq += 1
        heapq.heappush(self._heap, (score, self._seq, key))
        if len(self._heap) > 4 * len(self._score) + 64:
            self._heap = [(s, i, k) for s, i, k in self._heap if self._score.get(k) == s]
            heapq.heapify(self._heap)

    def _bump(self, key):
        t = self.rate * self.now
        old = self._score.get(key)
        new = t if old is None else max(old, t) + math.log1p(math.exp(-abs(old - t)))
        self._push(key, new)

    def insert(self, key):
        self._bump(key)

    def access(self, key):
        if key in self._score:
            self._bump(key)

    def remove(self, key):
        self._score.pop(key, None)

    def victim(self, evictable):
        skipped = []
        found = None
        while self._heap:
            score, seq, key = heapq.heappop(self._heap)
            if self._score.get(key) != score:
                continue  # stale entry
            if evictable(key):
                found = key
                heapq.heappush(self._heap, (score, seq, key))  # stays until removed
                break
            skipped.append((score, seq, key))
        for item in skipped:
            heapq.heappush(self._heap, item)
        return found


POLICIES: dict[str, Callable[[], Policy]] = {"lru": LRU, "lfru": LFRU}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown cache policy {name!r} (choose from: {', '.join(POLICIES)})") from None
