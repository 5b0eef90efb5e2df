"""``ulfru``: the layer-aware LFRU plus a per-layer utility learned online from ghost entries.

In one global cache all layers compete for slots, and some layers reuse their experts token to
token far more than others: an offline optimum gives those layers more slots. Decayed per-key
hotness does not see it. This policy keeps, per layer, the keys it evicted most recently (its
*ghosts*, about one pass's worth, as utility-based cache partitioning's shadow tags or ARC's
ghost lists do). A demand miss on a ghost is a miss that one pass's more slots for that layer
would have turned into a hit: the layer's ghost-hit rate (decayed ghost hits over its decayed
passes) is what its next slot earns. At each eviction the policy looks at the ``window``
lowest-scored candidates of the tier ``lfru`` would take its victim from and evicts the one
whose hotness, weighted by ``1 + weight x`` its layer's ghost-hit rate, is lowest: a layer
whose evictions keep coming back gives its slots up last. Everything else (fresh and stale
keys, router guesses, predictions, the prefetch gate) is ``lfru``'s. With ``weight=0`` it is
exactly ``lfru``. Deterministic: ties go to the least recently used key.

Measured by trace replay against Belady and LRU, on tuning and held-out traces:
docs/cache-policy.md (``sluice trace-replay --policy ulfru``).
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Hashable

from .policy import LFRU


class LayerUtilityLFRU(LFRU):
    """``lfru`` whose victims are steered to the layers whose next slot earns least (ghost hits).

    ``weight``: how strongly a layer's ghost-hit rate protects its keys (0: plain ``lfru``);
    ``ghost``: ghost entries kept per layer, as a multiple of the most keys the layer used at
    one pass; ``window``: candidates compared per eviction (the lowest-scored ones of the
    tier); ``share_life``: half-life, in ticks, of the ghost-hit and pass counts. Other
    parameters are ``lfru``'s.
    """

    name = "ulfru"

    def __init__(self, weight: float = 4.0, ghost: float = 1.0, window: float = 16, share_life: float = 64.0,
                 **lfru):
        super().__init__(**lfru)
        if not weight >= 0:
            raise ValueError(f"ulfru: weight must be >= 0, got {weight}")
        if not ghost > 0:
            raise ValueError(f"ulfru: ghost must be positive, got {ghost}")
        if not window >= 1 or window != int(window):
            raise ValueError(f"ulfru: window must be a whole number >= 1, got {window}")
        if not share_life > 0:
            raise ValueError(f"ulfru: share_life must be positive, got {share_life}")
        self.weight, self.ghost, self.window = float(weight), float(ghost), int(window)
        self.share_rate = math.log(2.0) / float(share_life)
        self._ghosts: dict[Hashable, OrderedDict[Hashable, None]] = {}  # layer -> recently evicted keys
        self._width: dict[Hashable, int] = {}  # layer -> most keys used at one pass
        self._used: dict[Hashable, tuple[int, int]] = {}  # layer -> (tick, keys used at that pass so far)
        self._ghost_hits: dict[Hashable, float] = {}  # layer -> log decayed ghost hits
        self._layer_passes: dict[Hashable, tuple[int, float]] = {}  # layer -> (tick, log decayed passes)
        self.ghost_hits = 0  # total, for tests and reports

    # -- learning -------------------------------------------------------------------------

    def _share_add(self, old: float | None) -> float:
        t = self.share_rate * self.now
        return t if old is None else max(old, t) + math.log1p(math.exp(-abs(old - t)))

    def _count_layer(self, layer) -> None:
        got = self._layer_passes.get(layer)
        if got is None or got[0] != self.now:
            self._layer_passes[layer] = (self.now, self._share_add(None if got is None else got[1]))

    def begin_layer(self, layer):
        super().begin_layer(layer)
        self._count_layer(layer)

    def _bump(self, key):
        layer = self._layer(key)
        self._count_layer(layer)
        tick, n = self._used.get(layer, (-1, 0))
        n = n + 1 if tick == self.now else 1
        self._used[layer] = (self.now, n)
        if n > self._width.get(layer, 0):
            self._width[layer] = n
        super()._bump(key)

    def insert(self, key, speculative=False):
        if not speculative:
            ghosts = self._ghosts.get(self._layer(key))
            if ghosts is not None and key in ghosts:
                del ghosts[key]
                layer = self._layer(key)
                self._ghost_hits[layer] = self._share_add(self._ghost_hits.get(layer))
                self.ghost_hits += 1
        super().insert(key, speculative)

    def remove(self, key):
        if key in self._resident:  # an eviction (or a drop): the key becomes a ghost of its layer
            layer = self._layer(key)
            ghosts = self._ghosts.setdefault(layer, OrderedDict())
            ghosts[key] = None
            ghosts.move_to_end(key)
            room = max(1, math.ceil(self.ghost * self._width.get(layer, 1)))
            while len(ghosts) > room:
                ghosts.popitem(last=False)
        super().remove(key)

    def earning(self, layer) -> float:
        """``layer``'s decayed ghost hits per decayed pass: what one pass's more slots would
        have earned it lately (0 if its evictions never came back)."""
        hits = self._ghost_hits.get(layer)
        passes = self._layer_passes.get(layer)
        if hits is None or passes is None:
            return 0.0
        return min(1.0, math.exp(hits - passes[1]))

    # -- choosing -------------------------------------------------------------------------

    def _lowest(self, heap, fresh, evictable):
        if self.weight <= 0 or self.window <= 1:
            return super()._lowest(heap, fresh, evictable)
        skipped, found = [], []
        while heap and len(found) < self.window:
            entry = heapq.heappop(heap)
            if not self._live(entry, fresh):
                continue
            skipped.append(entry)
            if evictable(entry[2]):
                found.append(entry)
        for entry in skipped:
            heapq.heappush(heap, entry)
        if not found:
            return None
        earn: dict[Hashable, float] = {}

        def cost(entry):
            score, seq, key = entry
            layer = self._layer(key)
            if layer not in earn:
                earn[layer] = math.log1p(self.weight * self.earning(layer))
            return (score + earn[layer], self._stamp.get(key, seq))

        return min(found, key=cost)[2]

    def _lean(self, stale_layer, fresh_layer):
        return (1.0 + self.weight * self.earning(stale_layer)) / (1.0 + self.weight * self.earning(fresh_layer))

    def ghosts(self, layer) -> list[Hashable]:
        """``layer``'s ghost keys, oldest first."""
        return list(self._ghosts.get(layer, ()))


__all__ = ["LayerUtilityLFRU"]
