"""Eviction policies for the expert cache (also used by the trace replayer).

Keys are hashable, e.g. ``(layer, expert)``. The cache calls ``insert``/``access``/``remove``
and asks ``victim(evictable)`` for the key to evict among those it may evict (not in use
by the current layer, not being read). ``tick()`` advances time by one forward step. The
expert provider adds two events about the future: ``begin_layer(layer)`` when a layer's
routing is known, before its lookups (the layer's pass starts),
``predict(layer, experts)`` when the lookahead predicts the experts of a layer still to come,
and, for a policy with ``ranks > 0``, ``ranked(layer, ranked, routed)``: the layer's experts in
descending router probability at this pass.

``experts/policy_spec.make_policy("lfru:half_life=16,history=true")`` builds one from a spec
string;
``Pinned(policy, pins)`` keeps a fixed set of keys from ever being evicted once resident.
How the default was chosen, with hit rates against Belady's optimum: docs/cache-policy.md
(``sluice trace-replay``).
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Hashable

from ..decay import log_add


class Policy:
    name = "base"

    def tick(self) -> None:
        pass

    def begin_layer(self, layer: int) -> None:
        """``layer`` runs now (its routing is known, its lookups follow). Called once per layer
        per forward step, after ``tick``; a repeat within the same step must change nothing."""

    def predict(self, layer: int, experts) -> None:
        """The lookahead predicts that ``layer`` (still to come this step) uses ``experts``."""

    # how many experts (a multiple of the layer's routed ones) the policy wants ranked by router
    # probability at each pass (``ranked``); 0: none (the provider then skips the ranking)
    ranks = 0.0

    def ranked(self, layer: int, ranked: list[int], routed: set[int]) -> None:
        """``layer``'s experts in descending router probability (the best over the step's rows),
        the first ``ceil(ranks x len(routed))`` of them, at this pass: after ``begin_layer``, before
        its lookups; ``routed`` the experts its rows route to. The experts ranked just below the
        routed ones are likelier than others at the layer's next pass. Called only when
        ``ranks > 0``, for forwards of decode size (not prefill chunks)."""

    def insert(self, key: Hashable, speculative: bool = False) -> None:
        """A key became resident. ``speculative``: read on a prediction, not yet used; it must
        not count as a use (its first real use calls ``access``)."""
        raise NotImplementedError

    def access(self, key: Hashable) -> None:
        raise NotImplementedError

    def remove(self, key: Hashable) -> None:
        raise NotImplementedError

    def victim(self, evictable: Callable[[Hashable], bool]) -> Hashable | None:
        raise NotImplementedError

    def speculative_victim(self, evictable: Callable[[Hashable], bool], prob: float | None = None) -> Hashable | None:
        """A victim to make room for a *predicted* expert, or None to skip the prefetch. ``prob``:
        the guess's chance of being used (the router's probability; None: unknown). By default
        any victim; policies that know which keys are about to be used protect them."""
        return self.victim(evictable)


class LRU(Policy):
    """Evict the least recently used key."""

    name = "lru"

    def __init__(self):
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def insert(self, key, speculative=False):
        self._order[key] = None
        self._order.move_to_end(key, last=not speculative)  # a prediction is the first victim until used

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
    origin, so lazy heaps order all keys in O(log n) per operation.

    ``protect`` (layer-aware, for ``(layer, expert)`` keys): a key used at its layer's most
    recent pass is *fresh*; one its layer has passed by since is *stale*. Victims are the
    lowest-scored stale keys; fresh ones go only when no stale key can. In a global cache
    this keeps the experts that layers still to come this token used last token (their next
    chance is moments away) over a hot expert its own layer just skipped (next chance: the
    next token), which per-token scores alone cannot tell apart. With one cache per layer
    every evictable key is stale, so ``protect`` changes nothing there. Keys that are not
    tuples all count as one layer.

    ``history``: keep the (still decaying) scores of evicted keys, so an expert that was hot,
    got evicted and comes back resumes its score instead of restarting at 1. Costs one float
    per key ever seen (at most layers x experts).

    ``router`` (needs ``protect``): at each pass the ``router`` x top-k experts the router ranks
    just below the routed ones are *guessed* for the layer's next pass (an expert ranked there
    is used by the next token about half as often as a routed one, three times as often as the
    rest): from the layer's next event until that pass, a guessed stale key goes after every
    other stale key (never after a fresh or predicted one). 0 turns it off.

    ``cross`` (needs ``protect``; the 1x point of a global cache, issue 30): when the victim would
    be a stale key, the lowest-scored fresh key of *another* layer (not predicted, not guessed)
    goes instead if its ``reuse`` is below ``cross`` x the stale key's: a fresh key whose layer
    rarely uses it again is worth less than a stale one its layer uses at most passes. A global
    Belady keeps some of another layer's experts even at one token's working set; this is the
    part of that an online policy can take (+1.8 points of Belady at 1x, +0.8 at 1.5x, mean of
    nine traces, 4 of 45 cells 1 to 4 hits lower; docs/cache-policy.md). 0 turns it off (the
    default before issue 30).

    ``gate`` (the prefetch admission gate, used when a guess comes with its probability):
    a guess with probability ``p`` may evict the candidate victim ``v`` only if
    ``p * gate > reuse(v)``, where ``reuse(v)`` is ``v``'s decayed use count over its layer's
    decayed pass count (the share of its layer's recent passes that used it: its chance of
    being used at the layer's next pass). Candidates: the lowest-scored stale key, and the
    keys a layer still to come used last pass that its pending prediction leaves out. A guess
    without a probability falls back to the fixed rule (``speculative_max_hotness``);
    ``gate=0`` always uses the fixed rule.

    The defaults were chosen by trace replay (docs/cache-policy.md);
    ``LFRU(64, history=False, protect=False)`` is the original policy.
    """

    name = "lfru"

    # A prediction may evict only a stale key this cold: decayed score below 0.25, i.e. no
    # use within the last two half-lives. Measured on the 2 GB demo container (random
    # weights, 32 decode tokens): at 140 slots 34.2 tok/s and 18.5 MB read per token vs
    # 25.9 tok/s and 32.8 MB with any stale victim allowed (no prefetch: 34.0, 13.9 MB).
    speculative_max_hotness = 0.25

    def __init__(self, half_life: float = 16.0, history: bool = True, protect: bool = True,
                 lookahead: bool = True, demote: bool = False, router: float = 2.0,
                 gate: float = 1.0, cross: float = 0.25):
        if not half_life > 0:
            raise ValueError(f"lfru: half_life must be positive, got {half_life}")
        if not router >= 0:
            raise ValueError(f"lfru: router must be >= 0, got {router}")
        if not gate >= 0:
            raise ValueError(f"lfru: gate must be >= 0, got {gate}")
        if not cross >= 0:
            raise ValueError(f"{self.name}: cross must be >= 0, got {cross}")
        self.cross = float(cross)
        # router > 0: at each pass, the router x top-k experts ranked just below the routed ones
        # are guessed for the layer's next pass (``ranked``)
        self.router = float(router)
        self.gate = float(gate)
        self._passes: dict[Hashable, tuple[int, float]] = {}  # layer -> (tick of last pass counted, log pass score)
        self.half_life = float(half_life)
        self.history = bool(history)
        self.protect = bool(protect)
        self.lookahead, self.demote = bool(lookahead), bool(demote)
        self._predicted: dict[Hashable, set[Hashable]] = {}  # layer -> its predicted keys, until it runs
        self._protected: set[Hashable] = set()  # union of the predicted keys
        self._guesses: dict[Hashable, set[Hashable]] = {}  # layer -> keys the router ranked next (``ranked``)
        self._guessed: set[Hashable] = set()  # their union
        self._pending: tuple[Hashable, set[Hashable]] | None = None  # guesses waiting for their layer to end
        self.rate = math.log(2.0) / half_life
        self.now = 0
        self._score: dict[Hashable, float] = {}  # log score of every tracked key
        self._resident: set[Hashable] = set()
        self._fresh: set[Hashable] = set()  # resident keys used at their layer's latest pass
        self._fresh_by_layer: dict[Hashable, set[Hashable]] = {}
        self._pass: dict[Hashable, int] = {}  # layer -> tick of its latest pass
        # (log score, seq, key); an entry is live while the key is resident with that score and
        # its freshness matches the heap it is in
        self._stale_heap: list[tuple[float, int, Hashable]] = []
        self._fresh_heap: list[tuple[float, int, Hashable]] = []
        self._stamp: dict[Hashable, int] = {}  # seq of each resident key's latest use
        self._seq = 0

    def tick(self):
        self.now += 1
        if self._pending is not None:
            self._activate()

    @staticmethod
    def _layer(key):
        return key[0] if isinstance(key, tuple) and key else None

    def _live(self, entry, fresh: bool) -> bool:
        score, _, key = entry
        return key in self._resident and self._score.get(key) == score and (key in self._fresh) == fresh

    def _push(self, heap, key, seq):
        heapq.heappush(heap, (self._score[key], seq, key))
        if len(self._stale_heap) + len(self._fresh_heap) > 4 * len(self._resident) + 64:
            self._stale_heap = [e for e in self._stale_heap if self._live(e, False)]
            self._fresh_heap = [e for e in self._fresh_heap if self._live(e, True)]
            heapq.heapify(self._stale_heap)
            heapq.heapify(self._fresh_heap)

    def _add(self, old: float | None) -> float:
        """A log score plus one use now."""
        t = self.rate * self.now
        return t if old is None else log_add(old, t)  # the one decayed-frequency rule (``sluice.decay``)

    def _count_pass(self, layer) -> None:
        got = self._passes.get(layer)
        if got is None or got[0] != self.now:
            self._passes[layer] = (self.now, self._add(None if got is None else got[1]))

    def reuse(self, key) -> float:
        """The chance that ``key`` is used at its layer's next pass, estimated as its decayed use
        count over the layer's decayed pass count (1.0 at most; 0 if never used)."""
        s = self._score.get(key)
        passes = self._passes.get(self._layer(key))
        if s is None or passes is None:
            return 0.0
        return min(1.0, math.exp(s - passes[1]))

    def _bump(self, key):
        self._count_pass(self._layer(key))
        self._score[key] = self._add(self._score.get(key))
        self._seq += 1
        self._stamp[key] = self._seq  # ties go to the least recently used
        if not self.protect:
            self._push(self._stale_heap, key, self._seq)
            return
        layer = self._layer(key)
        if self._pass.get(layer) != self.now:  # no begin_layer: the layer's first use this tick passes it
            self._pass_layer(layer)
        self._fresh.add(key)
        self._fresh_by_layer.setdefault(layer, set()).add(key)
        self._push(self._fresh_heap, key, self._seq)

    def _pass_layer(self, layer):
        """``layer`` runs at this tick: the keys it used at its previous pass go stale, and its
        predictions are spent (the layer's own lookups follow)."""
        self._pass[layer] = self.now
        for k in self._fresh_by_layer.pop(layer, ()):
            self._fresh.discard(k)
            if k in self._resident:
                self._push(self._stale_heap, k, self._stamp[k])
        spent = self._predicted.pop(layer, None)
        if spent:
            self._protected.difference_update(spent)

    def begin_layer(self, layer):
        if self._pending is not None:
            self._activate()
        self._count_pass(layer)
        if self.protect and self._pass.get(layer) != self.now:
            self._pass_layer(layer)

    @property
    def ranks(self):
        return 1.0 + self.router if self.router > 0 and self.protect else 0.0

    def ranked(self, layer, ranked, routed):
        """The ``router`` x len(routed) experts ranked just below the routed ones are the likelier
        ones at the layer's next pass: once this layer's own misses are fetched (the next event),
        they go after other stale keys until that pass (a ``guess``; docs/cache-policy.md)."""
        n = math.ceil(self.router * len(routed))
        if n < 1 or not self.protect:
            return
        keys = {(layer, e) for e in ranked[: len(routed) + n] if e not in routed}
        self._activate()
        old = self._guesses.pop(layer, None)
        if old:
            self._guessed.difference_update(old)
        self._pending = (layer, keys)

    def _activate(self):
        if self._pending is not None:
            layer, keys = self._pending
            self._pending = None
            self._guesses[layer] = keys
            self._guessed.update(keys)

    def _protect(self, layer, keys):
        old = self._predicted.get(layer)
        if old:
            self._protected.difference_update(old)
        self._predicted[layer] = keys
        self._protected.update(keys)

    def predict(self, layer, experts):
        """Protect the predicted keys of ``layer`` until it has run; with ``demote``, the keys it
        used last pass that are *not* predicted go stale now (their next chance is a step away)."""
        if not self.lookahead or not self.protect:
            return
        keys = {(layer, int(e)) for e in experts}
        self._protect(layer, keys)
        if self.demote:
            fresh = self._fresh_by_layer.get(layer)
            if fresh:
                for k in [k for k in fresh if k not in keys]:
                    fresh.discard(k)
                    self._fresh.discard(k)
                    if k in self._resident:
                        self._push(self._stale_heap, k, self._stamp[k])

    def insert(self, key, speculative=False):
        self._resident.add(key)
        if not speculative:
            self._bump(key)
            return
        # A prediction is not a use: it keeps its decayed history score (or the lowest score)
        # and goes to the stale heap, without marking its layer as passed, so the experts that
        # layer used last token stay protected until the layer really runs.
        if key not in self._score:
            self._score[key] = self.rate * self.now - 64.0
        self._seq += 1
        self._stamp[key] = self._seq
        self._push(self._stale_heap, key, self._seq)

    def access(self, key):
        if key in self._resident:
            self._bump(key)

    def remove(self, key):
        self._resident.discard(key)
        self._stamp.pop(key, None)
        if key in self._fresh:
            self._fresh.discard(key)
            self._fresh_by_layer.get(self._layer(key), set()).discard(key)
        if not self.history:
            self._score.pop(key, None)

    def hotness(self, key) -> float:
        """The key's current decayed score (0 if untracked)."""
        s = self._score.get(key)
        return 0.0 if s is None else math.exp(s - self.rate * self.now)

    def _lowest(self, heap, fresh: bool, evictable):
        skipped = []
        found = None
        while heap:
            entry = heapq.heappop(heap)
            if not self._live(entry, fresh):
                continue  # stale entry
            skipped.append(entry)  # stays until removed
            if evictable(entry[2]):
                found = entry[2]
                break
        for entry in skipped:
            heapq.heappush(heap, entry)
        return found

    def victim(self, evictable):
        v = self._tier_victim(evictable)
        if self.cross <= 0 or v is None or v in self._fresh:
            return v
        return self._cross(v, evictable)

    def _lean(self, stale_layer, fresh_layer) -> float:
        """How much more a slot of ``stale_layer`` is worth than one of ``fresh_layer`` (1 here;
        ``ulfru`` weighs in what each layer's evictions earned back)."""
        return 1.0

    def _cross(self, v, evictable):
        """``cross``: the lowest-scored fresh key of another layer instead of the stale victim
        ``v`` when its reuse is below ``cross`` x ``v``'s."""
        prot, guess = self._protected, self._guessed
        lv = self._layer(v)
        f = LFRU._lowest(self, self._fresh_heap, True,
                         lambda k: self._layer(k) != lv and k not in prot and k not in guess and evictable(k))
        if f is not None and self.reuse(f) < self.cross * self._lean(lv, self._layer(f)) * self.reuse(v):
            return f
        return v

    def _tier_victim(self, evictable):
        if self._guessed:  # stale keys the router ranked next at their layer's pass go after other stale keys
            prot, guess = self._protected, self._guessed
            v = self._lowest(self._stale_heap, False, lambda k: k not in guess and k not in prot and evictable(k))
            if v is not None:
                return v
        if self._protected:  # predicted keys go last
            prot = self._protected
            v = self._victim(lambda k: k not in prot and evictable(k))
            if v is not None:
                return v
        return self._victim(evictable)

    def _victim(self, evictable):
        v = self._lowest(self._stale_heap, False, evictable)
        return v if v is not None else self._lowest(self._fresh_heap, True, evictable)

    def speculative_victim(self, evictable, prob=None):
        """Only stale keys make room for a prediction: a fresh key (one a layer still to come
        used last token, or one used this token) is worth more than a guess. With the cache at
        one token's working set every key is fresh, so prefetching stops by itself there
        (measured: 207 -> 50 MB read per token, 9.4 -> 21.2 tok/s, on the 2 GB demo
        container at 64 slots; docs/cache-policy.md).

        With ``prob`` (and ``gate`` > 0) the admission gate decides instead: the candidate with
        the lowest ``reuse`` among the lowest-scored stale key and the keys that a pending
        prediction leaves out of its layer, evicted only if ``prob * gate > reuse``."""
        if not self.protect:
            return self.victim(evictable)
        prot = self._protected
        ok = (lambda k: k not in prot and evictable(k)) if prot else evictable
        v = self._lowest(self._stale_heap, False, ok)
        if prob is None or self.gate <= 0:
            if v is not None and self.hotness(v) >= self.speculative_max_hotness:
                return None  # the coldest evictable key is still hot: keep it rather than guess
            return v
        best, best_reuse = v, (self.reuse(v) if v is not None else 2.0)
        for layer, keys in self._predicted.items():  # used last pass, left out of the layer's prediction
            for k in self._fresh_by_layer.get(layer, ()):
                if k not in keys and k in self._resident and ok(k):
                    r = self.reuse(k)
                    if r < best_reuse or (r == best_reuse and best is not None and self._stamp[k] < self._stamp[best]):
                        best, best_reuse = k, r
        if best is None or not prob * self.gate > best_reuse:
            return None
        return best


class Pinned(Policy):
    """Wrap a policy so that the keys in ``pins`` are never chosen as victims once resident.

    Pins still load on demand (nothing is preloaded). Pinned keys are kept out of the inner
    policy altogether, so they cost it nothing. Whoever builds the cache must leave room:
    at most ``capacity - one layer's top-k`` pins per cache, or a layer can find no victim.
    """

    def __init__(self, inner: Policy, pins):
        self.inner = inner
        self.pins = frozenset(pins)
        self.name = f"pinned({inner.name})"
        self._held: set[Hashable] = set()

    def tick(self):
        self.inner.tick()

    def begin_layer(self, layer):
        self.inner.begin_layer(layer)

    def predict(self, layer, experts):
        self.inner.predict(layer, experts)

    @property
    def ranks(self):
        return self.inner.ranks

    def ranked(self, layer, ranked, routed):
        self.inner.ranked(layer, ranked, routed)

    def insert(self, key, speculative=False):
        if key in self.pins:
            self._held.add(key)
        else:
            self.inner.insert(key, speculative)

    def access(self, key):
        if key not in self.pins:
            self.inner.access(key)

    def remove(self, key):
        if key in self.pins:
            self._held.discard(key)
        else:
            self.inner.remove(key)

    def victim(self, evictable):
        return self.inner.victim(evictable)

    def speculative_victim(self, evictable, prob=None):
        return self.inner.speculative_victim(evictable, prob)
