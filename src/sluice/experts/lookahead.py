"""Turning the router lookahead's guesses into an ordered list of reads.

The engine's lookahead applies a later layer's router to the current residual stream
(``CausalLM.predict_weights``): per row, the ``K`` experts it would pick and the router's
probability of each. One forward may carry several rows (sequences batched together, a
verified draft); the layer will read the *union* of its rows' experts, so the guesses are
the union, ordered by their summed probability (the predicted weight mass): the likeliest
reads go first, and what is read last is what is most likely wasted.
"""

from __future__ import annotations

import torch


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
