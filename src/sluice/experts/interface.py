"""The one expert interface the engine, the runner and the families use.

Two implementations: ``experts.provider.ExpertProvider`` (this process: cache, reader pool,
compute) and ``cluster.provider.RayExperts`` (experts sharded over Ray actors, the driver
holding no expert cache). A family sees only ``moe`` (and ``resident_mask`` for the lossy
``prefer_cached``); the runner (``begin``, counters) and the lookahead (``prefetch``,
``after_reads``, ``lookahead_more``, ``holds_all``) use the rest; the runner hands it the
experts the token ids decide (``read_certain``). Both fold the expert outputs in ascending
expert order, so logits are bit-identical whichever runs them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ..layers.context import ForwardContext


class ExpertInterface(ABC):
    """What the runner, the lookahead and the families reach for. Every implementation keeps
    ``counters``, an ``experts.provider.ExpertCounters`` (lookups, hits, reads, waits, ...).
    What a forward is (its rows' sequences, decoding or prefill, what to record) reaches it as
    the ``layers.context.ForwardContext`` given to ``begin`` and to each ``moe`` call."""

    @abstractmethod
    def moe(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, ctx: ForwardContext,
            logits: torch.Tensor | None = None) -> torch.Tensor:
        """Weighted sum of the routed experts: x [T, H] fp32, ids/weights [T, K] -> [T, H], summed
        in ascending expert order. ``ctx``: the forward's context (lookups of decoding rows count
        toward the hit rate; ``ctx.record`` receives the routing). ``logits``: the router logits
        [T, E] of the rows (the cache policy's view of the experts just below the top-k, and the
        routing trace's probabilities); results never depend on them."""

    @abstractmethod
    def prefetch(self, layer: int, experts: list[int], read: bool = True, distance: int = 1,
                 probs: list[float] | None = None) -> None:
        """The lookahead's prediction for ``layer`` (made ``distance`` layers ahead), most likely
        first, with each guess's probability of being used (``probs``, or None): tell the cache
        policy, and start reads unless ``read`` is False. Results never depend on it."""

    def lookahead_more(self, distance: int, latency: bool = False) -> bool:
        """After the lookahead has predicted ``distance`` layers ahead: should it predict one
        layer further (beyond its fixed ``PrefetchOptions.depth``)? ``latency``: also while a
        read outlasts the layers left before its layer. By default no."""
        return False

    def holds_all(self) -> bool:
        """Every expert of the model is in memory and READY: a lookahead could read nothing. By
        default False (an implementation that cannot tell)."""
        return False

    def _count_union(self, ids: torch.Tensor, experts: list[int], ctx: ForwardContext) -> set[int]:
        """Count a MoE layer's ``union`` (``experts``, the distinct experts of all rows) and the
        sequences' own unions (``seq_union``); return the experts some decoding row routed to (the
        decode lookups; the rest are prefill lookups). Shared so both implementations count the
        same from the same routing."""
        c = self.counters
        c.union += len(experts)
        segs = ctx.segments
        if len(segs) <= 1:
            c.seq_union += len(experts)
            return set(experts) if ctx.decoding else set()
        decode: set[int] = set()
        for s in segs:
            own = set(ids[s.first : s.end].reshape(-1).tolist())
            c.seq_union += len(own)
            if s.decoding:
                decode |= own
        return decode

    def _count_predictions(self, used: set[int], predicted: list[int] | None, far: list[int] | None = None,
                           decoding: bool = True) -> None:
        """Count the lookahead's predictions for a MoE layer (``predicted``: made one layer ahead,
        ``far``: two; None where none was made) against ``used``, the experts the layer's rows
        really routed to: per prediction, ``len(used)`` checked and how many of them it named.
        Counted only while ``decoding``. Shared so both implementations count the same."""
        if not decoding:
            return
        c = self.counters
        if predicted is not None:
            c.predicted += len(used)
            c.predicted_hits += len(used.intersection(predicted))
        if far is not None:
            c.predicted_far += len(used)
            c.predicted_far_hits += len(used.intersection(far))

    def read_certain(self, certain: dict[int, torch.Tensor], rows: int, ahead: bool = False) -> None:  # noqa: B027
        """Experts the step's token ids decide (layer -> experts [T, K], hash-routed layers; ``rows``:
        the forward's rows), known before the model runs: read them for this forward (after
        ``begin``, before the embedding) at demand priority, or, ``ahead``, for the step's next
        forward (the next prefill chunk) as this forward leaves each of those layers. The layer's
        ``moe`` then finds them in memory or joins their reads; results never depend on it. By
        default nothing (an implementation that reads only when asked by ``moe``)."""

    def after_reads(self, layer: int, fn) -> None:
        """Run the lookahead ``fn()`` for ``layer`` once that layer's demand reads are issued; by
        default at once (an implementation that sends the prediction with the layer's request)."""
        fn()

    @abstractmethod
    def resident_mask(self, layer: int) -> torch.Tensor:
        """[E] float: 1 for experts of ``layer`` in memory (the lossy ``prefer_cached`` bias)."""

    @abstractmethod
    def begin(self, ctx: ForwardContext) -> None:
        """The forward ``ctx`` begins (the cache policy's clock)."""

    @property
    @abstractmethod
    def evictions(self) -> int:
        """Experts evicted from the cache(s) since load."""

    @property
    def bytes_read_elsewhere(self) -> int:
        """Expert bytes read outside this process's checkpoint (by remote workers); 0 here."""
        return 0

    def drain(self) -> None:  # noqa: B027 (optional: a source that reads synchronously has nothing to wait for)
        """Wait for reads in flight (benchmarks, before measuring a cold start)."""

    @abstractmethod
    def close(self) -> None:
        """Stop readers (and workers); the interface is unusable afterwards."""
