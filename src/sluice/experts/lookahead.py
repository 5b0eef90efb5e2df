"""The router lookahead: guess the experts of the next layers and start their reads.

``Lookahead`` is the expert side's: the model calls ``after_attention`` after each layer's
attention (``CausalLM.forward``, through the step's ``ForwardContext``); it applies later
layers' routers to the residual stream and hands the guesses to the expert interface
(``prefetch``), with its settings in ``PrefetchOptions`` (``Options.prefetch``). Results
never depend on it.

The lookahead applies a later layer's router to the current residual stream
(``CausalLM.predict_weights``): per row, the ``K`` experts it would pick and the router's
probability of each. One forward may carry several rows (sequences batched together, a
verified draft); the layer will read the *union* of its rows' experts, so the guesses are
the union, ordered by their summed probability (the predicted weight mass): the likeliest
reads go first, and what is read last is what is most likely wasted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..layers.context import ForwardContext


def rank_guesses(ids: torch.Tensor, probs: torch.Tensor, min_prob: float = 0.0) -> list[int]:
    """Experts to prefetch for one layer, most likely first.

    ``ids`` / ``probs`` [T, K]: each row's predicted experts and their router probabilities.
    An expert is kept if some row gives it at least ``min_prob``; experts are ordered by
    their summed probability over the rows (ties: lower id first, so the order is the same
    on every run).
    """
    mass: dict[int, float] = {}
    best: dict[int, float] = {}
    for e, p in zip(ids.reshape(-1).tolist(), probs.reshape(-1).tolist()):
        mass[e] = mass.get(e, 0.0) + p
        best[e] = max(best.get(e, 0.0), p)
    return sorted((e for e in mass if best[e] >= min_prob), key=lambda e: (-mass[e], e))


def weigh_guesses(ids: torch.Tensor, probs: torch.Tensor, min_prob: float = 0.0) -> tuple[list[int], list[float]]:
    """``rank_guesses`` with each guess's chance of being used by the layer: the probability
    that at least one row routes to it, ``1 - prod(1 - p_row)`` over the rows that predict it
    (the rows taken as independent). This is what the cache's prefetch gate weighs against
    the victim's chance of reuse."""
    order = rank_guesses(ids, probs, min_prob)
    miss: dict[int, float] = {}
    for e, p in zip(ids.reshape(-1).tolist(), probs.reshape(-1).tolist()):
        miss[e] = miss.get(e, 1.0) * (1.0 - min(1.0, max(0.0, p)))
    return order, [1.0 - miss[e] for e in order]


@dataclass
class PrefetchOptions:
    """The lookahead prefetch's settings (``Options.prefetch``; measured in docs/io.md)."""

    enabled: bool = True
    depth: int = 1  # predict at least this many layers ahead ...
    # ... and up to this many while the expert side asks for more (``lookahead_more``: its readers
    # would idle; 2 is the opt-in cross-layer lookahead)
    max_depth: int = 1
    # guesses carry their probability: the cache policy's admission gate weighs it against the
    # victim's reuse, the provider against the read's time (``worth_reading``). Off by default:
    # on the cold benchmarks it raised hit rates but not speed (docs/io.md)
    gate: bool = False
    min_prob: float = 0.0  # read a guess only if some row gives it at least this router probability
    # predict for forwards of at most this many rows (decode, a batch of sequences' decode rows,
    # speculative verification); a prefill chunk reads each expert once anyway
    max_rows: int = 64
    # also look further while a read outlasts the layers left before its layer (off: on the
    # disk-bound benchmark every bf16 read outlasts a layer, and two-ahead guesses, half of
    # them wrong, cost bandwidth the demand reads need; docs/io.md)
    latency: bool = False

    @classmethod
    def of(cls, value: "bool | PrefetchOptions") -> "PrefetchOptions":
        """``Options.prefetch`` as given: a bool (on/off with the defaults) or the settings."""
        return value if isinstance(value, PrefetchOptions) else cls(enabled=bool(value))


class Predictor(Protocol):
    """What the lookahead needs of the model (``models.base.CausalLM``)."""

    spine: object  # a SpineStreamer (``ready(layer)``) or None

    def is_moe(self, layer: int) -> bool: ...

    def predict_weights(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None: ...


class Lookahead:
    """After layer ``i``'s attention, start reads for the experts the next layers are predicted to
    use (and, when the step records routing, record the next layer's prediction for every row).
    With several rows (sequences batched in one forward, a verified draft), the union of the
    rows' guesses, by predicted weight mass (``weigh_guesses``). With ``certain`` (the
    ``certain_reads`` option), a hash-routed layer is predicted from the step's token ids
    (``ForwardContext.certain``) with probability 1; without, it has no guess."""

    def __init__(self, experts, model: Predictor, options: PrefetchOptions, certain: bool = False):
        self.experts, self.model, self.options, self.certain = experts, model, options, certain

    def after_attention(self, layer: int, h: torch.Tensor, ctx: ForwardContext) -> None:
        o = self.options
        record = ctx.record
        prefetch = o.enabled and h.shape[0] <= o.max_rows
        if record is None and (not prefetch or self._holds_all()):
            return
        if self.model.is_moe(layer):
            # guess once this layer's own demand reads are issued (inside its MoE call)
            self.experts.after_reads(layer, lambda: self._ahead(layer, h, prefetch, record, ctx))
        else:
            self._ahead(layer, h, prefetch, record, ctx)

    def _holds_all(self) -> bool:
        """Every expert READY (``ExpertInterface.holds_all``): a guess could read nothing and, with
        no eviction ever needed, inform no choice (the ``predicted`` counters then count nothing)."""
        return self.experts.holds_all()

    def _ahead(self, layer: int, h: torch.Tensor, prefetch: bool, record, ctx: ForwardContext) -> None:
        o, experts, model = self.options, self.experts, self.model
        certain = ctx.certain if self.certain else None
        depth = max(o.depth, o.max_depth) if prefetch else 1
        for distance in range(1, depth + 1):
            if distance > o.depth and not experts.lookahead_more(distance - 1, latency=o.latency):
                return
            target = layer + distance
            if certain and target in certain:  # decided by the token ids: no guess, no router needed
                ids = certain[target]
                got = ids, torch.ones(ids.shape)
            elif model.spine is not None and not model.spine.ready(target):
                return  # its router is still being read
            else:
                got = model.predict_weights(target, h)
            if got is None:
                continue  # a dense layer (or past the last one)
            ids, probs = got
            if distance == 1 and record is not None:
                record.predicted[target] = ids
            if prefetch:
                guesses, p = weigh_guesses(ids, probs, o.min_prob)
                experts.prefetch(target, guesses, distance=distance, probs=p if o.gate else None)
