"""Routers: hidden states -> (expert ids [T, K], mixing weights [T, K]).

Every MoE layer routes through a ``Router``: it owns its weight tensors (a spine tensor,
possibly a view into a stream buffer that is refilled per forward, so nothing is derived
from it at build time) and does its own linear projection. One call signature for all::

    ids, weights = router(x, bias=None)

``bias`` [E] (optional, the lossy ``prefer_cached`` switch) is added to the scores used to
*select* experts only, never to the mixing weights. ``ids`` come out sorted by descending
selection score, ties by ascending expert id, so the first j columns are always the best j
experts (what ``moe_top_k`` keeps). The weights are computed in the order the reference
implementation computes them (the sum of a renormalisation in that order), then put in
the same order as the ids; the expert fold sums in ascending expert id (see
``experts/provider.py``), so this reordering never changes a result.

Kinds: ``SoftmaxRouter`` (Mixtral, Qwen3-MoE, OLMoE, Qwen3-Next; ERNIE-4.5 with a correction
bias and a clamped renormalisation), ``GroupedRouter``
(DeepSeek-V3, Kimi K2, Kimi Linear: sigmoid scores, ``e_score_correction_bias``, expert
groups, ``routed_scaling_factor``; DeepSeek-V4: ``sqrtsoftplus`` scores), ``TopKSoftmaxRouter``
(GPT-OSS: a biased linear, top-k of the logits, softmax over those k), ``HashRouter``
(DeepSeek-V4's first layers: the token id chooses the experts through a fixed table, the
scores only weigh them).

Shape legend: T tokens, H hidden, E experts, K experts per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import CheckpointError
from ..quant import linear
from .pointwise import pointwise


def descending(ids: torch.Tensor, selection: torch.Tensor, weights: torch.Tensor,
               presorted: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Reorder each row of (ids, weights) by descending ``selection`` score [T, K], ties by
    ascending expert id. ``presorted``: the scores already descend (a sorted top-k), so only
    rows with tied scores need work (the common case costs one comparison)."""
    if ids.shape[-1] < 2:
        return ids, weights
    if presorted and not _adjacent_ties(selection):
        return ids, weights
    by_id = ids.argsort(dim=-1)
    ids, selection, weights = ids.gather(-1, by_id), selection.gather(-1, by_id), weights.gather(-1, by_id)
    order = selection.argsort(dim=-1, descending=True, stable=True)
    return ids.gather(-1, order), weights.gather(-1, order)


def _adjacent_ties(sel: torch.Tensor) -> bool:
    """Whether some row of ``sel`` [T, K] has two equal neighbours (a decode step's few rows
    are compared in Python: a quarter of the cost of the tensor ops)."""
    if sel.shape[0] <= 16:
        return any(r[i] == r[i + 1] for r in sel.tolist() for i in range(len(r) - 1))
    return bool((sel[..., 1:] == sel[..., :-1]).any())


def softmax_topk(logits: torch.Tensor, k: int, normalize: bool, bias: torch.Tensor | None = None,
                 norm_min: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over E in fp32, top-k, optional renormalisation (Mixtral/Qwen3-MoE/OLMoE).

    ``bias`` [E] is added to the probabilities for choosing experts only; the mixing
    weights stay the model's own probabilities. ``norm_min``: the renormalisation divides by
    the chosen weights' sum clamped below at ``norm_min`` (ERNIE-4.5's ``moe_norm_min``).
    """
    probs = torch.softmax(logits.float(), dim=-1)  # [T, E]
    if bias is None:
        weights, ids = torch.topk(probs, k, dim=-1)  # [T, K], descending
        selection = weights
    else:
        selection, ids = torch.topk(probs + bias, k, dim=-1)
        weights = probs.gather(-1, ids)
    if normalize:
        total = weights.sum(dim=-1, keepdim=True)  # in top-k's order, as transformers sums
        weights = weights / (total if norm_min is None else total.clamp(min=norm_min))
    return descending(ids, selection, weights, presorted=True)


def topk_softmax(logits: torch.Tensor, k: int, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-OSS routing: top-k of the raw logits, softmax over those k only (fp32).

    ``bias`` [E] is added to the logits for choosing experts only; the weights are the
    softmax of the chosen experts' own logits.
    """
    logits = logits.float()
    if bias is None:
        values, ids = torch.topk(logits, k, dim=-1)
        selection = values
    else:
        selection, ids = torch.topk(logits + bias, k, dim=-1)
        values = logits.gather(-1, ids)
    return descending(ids, selection, torch.softmax(values, dim=-1), presorted=True)


SCORINGS = ("sigmoid", "softmax", "sqrtsoftplus")


def scores_of(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    """Router scores [T, E] (fp32) from logits: ``sigmoid``, ``softmax`` over E, or ``sqrtsoftplus``
    (``sqrt(softplus(x))``, DeepSeek-V4)."""
    logits = logits.float()
    if scoring == "sigmoid":
        return pointwise(torch.sigmoid, logits)
    if scoring == "softmax":
        return torch.softmax(logits, dim=-1)
    if scoring == "sqrtsoftplus":
        return pointwise(torch.sqrt, pointwise(F.softplus, logits))
    raise ValueError(f"unknown scoring function {scoring!r}")


def margin(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Gap between the k-th and (k+1)-th router score per token (tie detection in tests)."""
    top = torch.topk(logits.float(), min(k + 1, logits.shape[-1]), dim=-1).values
    return top[:, k - 1] - top[:, k]


def grouped_topk(
    logits: torch.Tensor,
    k: int,
    *,
    scoring: str = "sigmoid",
    bias: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    group_score: str = "top2_sum",
    normalize: bool = True,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-limited top-k routing (DeepSeek-V3 style), all in fp32.

    ``scores = sigmoid(logits)`` (or softmax, or sqrtsoftplus); the selection uses ``scores + bias`` (the
    ``e_score_correction_bias``, plus any cache bias; never part of the weights): experts
    are split into ``n_group`` equal groups, each group is scored (``"top2_sum"``: sum of its
    two best experts; ``"max"``: its best expert), only the ``topk_group`` best groups stay
    eligible, and the top ``k`` eligible experts are chosen. The weights are their unbiased
    scores, optionally renormalised to sum to one (+1e-20), times ``scale``
    (routed_scaling_factor). The result is sorted by descending selection score and the
    weights are summed in that order (transformers sums in its unsorted top-k's order, which
    changes with the number of rows: the same weights up to rounding).
    """
    scores = scores_of(logits, scoring)
    choice = scores if bias is None else scores + bias.float()
    t, e = choice.shape
    if n_group > 1 and topk_group < n_group:
        grouped = choice.view(t, n_group, e // n_group)
        if group_score == "top2_sum":
            gs = grouped.topk(2, dim=-1).values.sum(dim=-1)
        elif group_score == "max":
            gs = grouped.amax(dim=-1)
        else:
            raise ValueError(f"unknown group score {group_score!r}")
        keep = torch.zeros_like(gs, dtype=torch.bool)
        keep.scatter_(1, torch.topk(gs, topk_group, dim=-1, sorted=False).indices, True)
        mask = keep[:, :, None].expand(t, n_group, e // n_group).reshape(t, e)
        choice = choice.masked_fill(~mask, float("-inf"))
    selection, ids = torch.topk(choice, k, dim=-1, sorted=False)
    # sorted first, then summed: the unsorted top-k's order changes with the number of rows
    # (measured), and the sum's order with it; transformers sums in that order (rounding apart)
    ids, weights = descending(ids, selection, scores.gather(1, ids))
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * scale


class Router:
    """A routing rule over a linear projection ``logits = x @ weight.T (+ linear_bias)``.

    ``weight`` [E, H] (f32/bf16/f16) is the checkpoint's tensor as loaded (the spine streamer
    refills a streamed weight in place, so it is used as is, never copied or converted);
    1-D tensors (``linear_bias`` [E], a correction bias) are always resident and may be
    converted to fp32 here. ``top_k`` is the model's experts per token. Subclasses
    implement ``select(logits, bias)``.
    """

    kind = "router"

    def __init__(self, weight: torch.Tensor, top_k: int, linear_bias: torch.Tensor | None = None):
        if len(weight.shape) != 2:
            raise ValueError(f"router weight must be 2-D [experts, hidden], got shape {list(weight.shape)}")
        if not 1 <= top_k <= weight.shape[0]:
            raise ValueError(f"top_k={top_k} with {weight.shape[0]} experts")
        self.weight, self.top_k = weight, int(top_k)
        self.linear_bias = linear_bias.float() if linear_bias is not None else None

    @property
    def n_experts(self) -> int:
        return self.weight.shape[0]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Router logits [T, E] (fp32) for hidden states x [T, H]."""
        return linear(x, self.weight, self.linear_bias)

    def select(self, logits: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [T, K], weights [T, K]), ids by descending selection score; ``bias`` [E] selects only."""
        return self.select(self.logits(x), bias)


class SoftmaxRouter(Router):
    """Softmax over all experts, top-k, optional renormalisation over the chosen ones.

    ERNIE-4.5: ``correction`` (its ``moe_statics.e_score_correction_bias``, [1, E] as stored,
    possibly a stream buffer's view, so it is converted per call, never at build time) is
    added to the probabilities to select (a cache bias is added to it), and ``norm_min``
    clamps the renormalisation's sum from below (see ``softmax_topk``)."""

    kind = "softmax"

    def __init__(self, weight: torch.Tensor, top_k: int, normalize: bool, *, correction: torch.Tensor | None = None,
                 norm_min: float | None = None):
        super().__init__(weight, top_k)
        if correction is not None and correction.numel() != weight.shape[0]:
            raise ValueError(f"correction bias of shape {list(correction.shape)} for {weight.shape[0]} experts")
        self.normalize, self.correction, self.norm_min = bool(normalize), correction, norm_min

    def select(self, logits, bias=None):
        sel = bias.float() if bias is not None else None
        if self.correction is not None:
            c = self.correction.reshape(-1).float()
            sel = c if sel is None else c + sel
        return softmax_topk(logits, self.top_k, self.normalize, sel, self.norm_min)


class GroupedRouter(Router):
    """Group-limited top-k (DeepSeek-V3): see ``grouped_topk``. ``correction`` [E] is the
    ``e_score_correction_bias`` (selection only); a cache bias is added to it."""

    kind = "grouped"

    def __init__(self, weight: torch.Tensor, top_k: int, *, correction: torch.Tensor | None = None,
                 scoring: str = "sigmoid", n_group: int = 1, topk_group: int = 1, group_score: str = "top2_sum",
                 normalize: bool = True, scale: float = 1.0):
        super().__init__(weight, top_k)
        if scoring not in SCORINGS:
            raise ValueError(f"unknown scoring function {scoring!r}")
        if group_score not in ("top2_sum", "max"):
            raise ValueError(f"unknown group score {group_score!r}")
        if n_group < 1 or weight.shape[0] % n_group or not 1 <= topk_group <= n_group:
            raise ValueError(f"{weight.shape[0]} experts cannot be routed in {n_group} groups keeping {topk_group}")
        self.correction = correction.float() if correction is not None else None
        self.scoring, self.n_group, self.topk_group, self.group_score = scoring, n_group, topk_group, group_score
        self.normalize, self.scale = bool(normalize), float(scale)

    def select(self, logits, bias=None):
        sel = self.correction
        if bias is not None:
            sel = bias.float() if sel is None else sel + bias.float()
        return grouped_topk(logits, self.top_k, scoring=self.scoring, bias=sel, n_group=self.n_group,
                            topk_group=self.topk_group, group_score=self.group_score, normalize=self.normalize,
                            scale=self.scale)


class TopKSoftmaxRouter(Router):
    """GPT-OSS: ``logits = x @ W.T + b``, top-k of the logits, softmax over those k."""

    kind = "topk_softmax"

    def __init__(self, weight: torch.Tensor, top_k: int, linear_bias: torch.Tensor | None = None):
        super().__init__(weight, top_k, linear_bias)

    def select(self, logits, bias=None):
        return topk_softmax(logits, self.top_k, bias)


class HashRouter(Router):
    """Hash routing (DeepSeek-V4's ``hash_moe`` layers): token ``t`` goes to the experts
    ``tid2eid[t]`` [K], a fixed table; the router's scores (``scoring`` of ``x @ weight.T``) only
    weigh them: gathered at those experts, renormalised (+1e-20) and times ``scale``.

    ``tid2eid`` [V, K] (integers) is kept resident (``ModelDescription.tables``), so ``experts_for``
    can answer before the layer runs: it is a pure function of the token ids, the hook for reads
    that are certain before the model computes anything. ``select`` needs the step's token ids;
    the ids come back by descending weight (ties: ascending id), as every router's. A row that
    names an expert out of range, or one expert twice, is refused when a token reads it
    (``CheckpointError`` naming the table ``name`` and the token).
    """

    kind = "hash"
    keyed = True  # the token ids choose: ``MoEBlock`` passes them (``select(..., token_ids=)``)

    def __init__(self, weight: torch.Tensor, top_k: int, tid2eid: torch.Tensor, *, scoring: str = "sqrtsoftplus",
                 normalize: bool = True, scale: float = 1.0, name: str = "tid2eid"):
        super().__init__(weight, top_k)
        if scoring not in SCORINGS:
            raise ValueError(f"unknown scoring function {scoring!r}")
        if len(tid2eid.shape) != 2 or tid2eid.shape[1] != top_k:
            raise ValueError(f"hash table of shape {list(tid2eid.shape)} for {top_k} experts per token")
        self.tid2eid, self.scoring, self.normalize, self.scale = tid2eid, scoring, bool(normalize), float(scale)
        self.name = name

    @property
    def vocab(self) -> int:
        return self.tid2eid.shape[0]

    def experts_for(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The experts [T, K] (long) of tokens ``token_ids`` [T]: the table's rows, nothing else."""
        tokens = token_ids.reshape(-1).long()
        ids = self.tid2eid[tokens].long()
        if ids.numel():
            bad = (ids < 0) | (ids >= self.n_experts)
            if ids.shape[1] > 1:
                s = ids.sort(dim=1).values
                bad[:, 1:] |= s[:, 1:] == s[:, :-1]
            if bool(bad.any()):
                row = int(bad.any(dim=1).nonzero()[0, 0])
                raise CheckpointError(f"{self.name}: token {int(tokens[row])} is routed to experts "
                                      f"{ids[row].tolist()}: expected {ids.shape[1]} distinct ids below "
                                      f"{self.n_experts}")
        return ids

    def select(self, logits, bias=None, token_ids: torch.Tensor | None = None):
        if token_ids is None:
            raise ValueError("hash routing needs the step's token ids")
        scores = scores_of(logits, self.scoring)
        ids = self.experts_for(token_ids)
        weights = scores.gather(1, ids)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)  # in the table's order
        ids, weights = descending(ids, weights, weights)
        return ids, weights * self.scale

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None,
                 token_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.select(self.logits(x), bias, token_ids=token_ids)
