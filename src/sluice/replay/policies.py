"""Policies that exist for the trace replay only: Belady's offline optimum (fed with next-use
positions) and the designs docs/cache-policy.md measured against the engine's and rejected."""

from __future__ import annotations

import heapq
import math
import random
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable

from ..experts.policy import LFRU, Policy
from ..experts.policy_spec import POLICIES
from ..trace import Trace

NEVER = math.inf


# -- Belady ----------------------------------------------------------------------------------


def access_order(trace: Trace) -> list[tuple[int, int]]:
    """Every ``(layer, expert)`` access in trace order: engine step (a token, or the rows one step
    of several sequences computed together, ``Trace.groups``), then layer, then ascending id of
    the union of the step's rows."""
    if trace.step is None:
        return [(layer, e) for step in trace.steps for layer, ids in enumerate(step) for e in ids]
    out = []
    for group in trace.groups():
        for layer in range(trace.layers):
            out.extend((layer, e) for e in sorted({e for t in group for e in trace.steps[t][layer]}))
    return out


def next_uses(trace: Trace) -> dict[Hashable, deque]:
    """For each key, the positions (in ``access_order``) at which it is used, ascending."""
    uses: dict[Hashable, deque] = {}
    for pos, key in enumerate(access_order(trace)):
        q = uses.get(key)
        if q is None:
            uses[key] = q = deque()
        q.append(pos)
    return uses


class Belady(Policy):
    """Evict the key whose next use is furthest in the future (Belady's MIN, offline).

    Built from ``next_uses(trace)``: every ``insert``/``access`` of a key consumes its current
    use, so the replay must report each access exactly once, in trace order per key (both
    replay semantics do). Keys with no further use are evicted first.
    """

    name = "belady"

    def __init__(self, uses: dict[Hashable, deque]):
        self._uses = uses
        self._next: dict[Hashable, float] = {}
        self._heap: list[tuple[float, int, Hashable]] = []
        self._seq = 0

    def _use(self, key):
        q = self._uses[key]
        q.popleft()
        nxt = q[0] if q else NEVER
        self._next[key] = nxt
        self._seq += 1
        heapq.heappush(self._heap, (-nxt, self._seq, key))
        if len(self._heap) > 4 * len(self._next) + 64:
            self._heap = [(n, i, k) for n, i, k in self._heap if self._next.get(k) == -n]
            heapq.heapify(self._heap)

    def insert(self, key, speculative=False):
        if not speculative:
            self._use(key)
            return
        q = self._uses[key]  # a prediction read ahead: not a use, its next use is still ahead
        self._next[key] = nxt = q[0] if q else NEVER
        self._seq += 1
        heapq.heappush(self._heap, (-nxt, self._seq, key))

    def access(self, key):
        self._use(key)

    def remove(self, key):
        self._next.pop(key, None)

    def victim(self, evictable):
        skipped = []
        found = None
        while self._heap:
            item = heapq.heappop(self._heap)
            neg, _, key = item
            if self._next.get(key) != -neg:
                continue
            skipped.append(item)
            if evictable(key):
                found = key
                break
        for item in skipped:
            heapq.heappush(self._heap, item)
        return found


def access_steps(trace: Trace) -> list[int]:
    """For each position of ``access_order``, the engine step (a decode token, or one step's group
    of rows) it belongs to."""
    if trace.step is None:
        return [t for t, step in enumerate(trace.steps) for ids in step for _ in ids]
    out = []
    for g, group in enumerate(trace.groups()):
        for layer in range(trace.layers):
            out.extend([g] * len({e for t in group for e in trace.steps[t][layer]}))
    return out


class HorizonBelady(Policy):
    """A bound, not a policy an engine can run: Belady's rule inside a horizon of ``horizon``
    engine steps past the current one, ``inner``'s order (an online policy) outside it.

    Keys whose next use lies beyond the horizon go first, in ``inner``'s order; only when every
    evictable key is used within the horizon does the one used furthest ahead go. Horizon 0
    knows the rest of the current token exactly, 1 also the next token, and so on; a horizon
    past the trace's end is Belady. ``recall`` < 1 makes the knowledge partial: each future use
    is seen with that chance (a coin per use, drawn once from ``seed``); an unseen use counts
    as lying beyond the horizon. docs/cache-policy.md uses it to measure how much knowledge of
    the future Belady's lead is made of.
    """

    name = "horizon-belady"

    def __init__(self, trace: Trace, horizon: int, inner: Policy, recall: float = 1.0, seed: int = 0):
        if horizon < 0:
            raise ValueError(f"horizon must be >= 0, got {horizon}")
        if not 0.0 <= recall <= 1.0:
            raise ValueError(f"recall must be within [0, 1], got {recall}")
        self._uses = next_uses(trace)
        self._step = access_steps(trace)
        rng = random.Random(seed)
        self._seen = None if recall >= 1.0 else [rng.random() < recall for _ in self._step]
        self.horizon, self.inner = int(horizon), inner
        self.name = f"{inner.name} + next {horizon} steps" + ("" if recall >= 1.0 else f" (recall {recall:g})")
        self._next: dict[Hashable, float] = {}
        self._now = 0  # the engine step of the latest use

    def tick(self):
        self.inner.tick()

    def begin_layer(self, layer):
        self.inner.begin_layer(layer)

    def _use(self, key):
        q = self._uses[key]
        self._now = self._step[q.popleft()]
        self._next[key] = q[0] if q else NEVER

    def insert(self, key, speculative=False):
        if not speculative:
            self._use(key)
        self.inner.insert(key, speculative)

    def access(self, key):
        self._use(key)
        self.inner.access(key)

    def remove(self, key):
        self._next.pop(key, None)
        self.inner.remove(key)

    def _beyond(self, key) -> bool:
        n = self._next[key]
        if n == NEVER or self._step[n] > self._now + self.horizon:
            return True
        return self._seen is not None and not self._seen[n]

    def victim(self, evictable):
        v = self.inner.victim(lambda k: evictable(k) and self._beyond(k))
        if v is not None:
            return v
        best, furthest = None, -1.0
        for key, n in self._next.items():
            if n > furthest and evictable(key):
                best, furthest = key, n
        return best


# -- study-only policies ---------------------------------------------------------------------
# Designs measured against the engine's policies in docs/cache-policy.md and rejected there.
# They follow the same interface; the cache size they need is taken as the number of
# resident keys when a victim is asked for (the cache only evicts when full).


def _first(order, evictable):
    for key in order:
        if evictable(key):
            return key
    return None


class TwoQ(Policy):
    """2Q: new keys enter a FIFO (``a1in``, a ``kin`` share of the cache); keys seen again
    after leaving it (remembered in a ghost list of ``kout`` x cache keys) go to an LRU (``am``)."""

    name = "2q"

    def __init__(self, kin: float = 0.25, kout: float = 0.5):
        self.kin, self.kout = kin, kout
        self.a1in: OrderedDict = OrderedDict()
        self.am: OrderedDict = OrderedDict()
        self.a1out: OrderedDict = OrderedDict()

    def insert(self, key, speculative=False):
        if key in self.a1out:
            del self.a1out[key]
            self.am[key] = None
        else:
            self.a1in[key] = None

    def access(self, key):
        if key in self.am:
            self.am.move_to_end(key)

    def remove(self, key):
        if key in self.a1in:
            del self.a1in[key]
            self.a1out[key] = None
            limit = max(1, int(self.kout * (len(self.a1in) + len(self.am) + 1)))
            while len(self.a1out) > limit:
                self.a1out.popitem(last=False)
        else:
            self.am.pop(key, None)

    def victim(self, evictable):
        n = len(self.a1in) + len(self.am)
        first, second = (self.a1in, self.am) if len(self.a1in) > self.kin * n else (self.am, self.a1in)
        v = _first(first, evictable)
        return v if v is not None else _first(second, evictable)


class ARC(Policy):
    """Adaptive Replacement Cache (Megiddo and Modha), with a victim chosen before the
    incoming key is known (the cache asks for a victim, then inserts)."""

    name = "arc"

    def __init__(self):
        self.t1: OrderedDict = OrderedDict()
        self.t2: OrderedDict = OrderedDict()
        self.b1: OrderedDict = OrderedDict()
        self.b2: OrderedDict = OrderedDict()
        self.p = 0.0
        self.c = 1

    def insert(self, key, speculative=False):
        self.c = max(self.c, len(self.t1) + len(self.t2) + 1)
        if key in self.b1:
            self.p = min(self.c, self.p + max(len(self.b2) / max(len(self.b1), 1), 1))
            del self.b1[key]
            self.t2[key] = None
        elif key in self.b2:
            self.p = max(0.0, self.p - max(len(self.b1) / max(len(self.b2), 1), 1))
            del self.b2[key]
            self.t2[key] = None
        else:
            self.t1[key] = None

    def access(self, key):
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        elif key in self.t2:
            self.t2.move_to_end(key)

    def remove(self, key):
        if key in self.t1:
            del self.t1[key]
            self.b1[key] = None
        elif key in self.t2:
            del self.t2[key]
            self.b2[key] = None
        while len(self.b1) + len(self.t1) > self.c and self.b1:
            self.b1.popitem(last=False)
        while len(self.b1) + len(self.b2) + len(self.t1) + len(self.t2) > 2 * self.c and self.b2:
            self.b2.popitem(last=False)

    def victim(self, evictable):
        first, second = (self.t1, self.t2) if self.t1 and len(self.t1) > self.p else (self.t2, self.t1)
        v = _first(first, evictable)
        return v if v is not None else _first(second, evictable)


class ProbationLFRU(Policy):
    """LFRU behind a small LRU probation segment: new keys wait in probation (a ``probation``
    share of the cache) and are evicted from there first; a hit promotes a key to the LFRU."""

    name = "plfru"

    def __init__(self, half_life: float = 64.0, probation: float = 0.25, history: bool = False):
        self.main = LFRU(half_life, history)
        self.share = probation
        self.prob: OrderedDict = OrderedDict()

    def tick(self):
        self.main.tick()

    def insert(self, key, speculative=False):
        self.prob[key] = None

    def access(self, key):
        if key in self.prob:
            del self.prob[key]
            self.main.insert(key)
            self.main.access(key)  # the miss that brought it in and this hit
        else:
            self.main.access(key)

    def remove(self, key):
        if key in self.prob:
            del self.prob[key]
        else:
            self.main.remove(key)

    def victim(self, evictable):
        n = len(self.prob) + len(self.main._resident)
        if len(self.prob) > self.share * n:
            v = _first(self.prob, evictable)
            if v is not None:
                return v
        v = self.main.victim(evictable)
        return v if v is not None else _first(self.prob, evictable)


class LFU(Policy):
    """Plain LFU over resident keys (ties: least recently used), not layer-aware; ``history``
    keeps counts of evicted keys. LFRU with a half-life too long to matter."""

    name = "lfu"

    def __init__(self, history: bool = False):
        self.inner = LFRU(half_life=1e12, history=history, protect=False)

    def tick(self):
        self.inner.tick()

    def insert(self, key, speculative=False):
        self.inner.insert(key)

    def access(self, key):
        self.inner.access(key)

    def remove(self, key):
        self.inner.remove(key)

    def victim(self, evictable):
        return self.inner.victim(evictable)


STUDY_POLICIES: dict[str, Callable[..., Policy]] = {**POLICIES, "2q": TwoQ, "arc": ARC, "plfru": ProbationLFRU,
                                                     "lfu": LFU}
