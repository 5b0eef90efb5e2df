"""Routers: router logits -> (expert ids [T, K], mixing weights [T, K]).

Shape legend: T tokens, E experts, K experts per token.
"""

from __future__ import annotations

import torch


def softmax_topk(logits: torch.Tensor, k: int, normalize: bool,
                 bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over E in fp32, top-k, optional renormalisation (Mixtral/Qwen3-MoE/OLMoE).

    ``bias`` [E] is added to the probabilities for choosing experts only; the mixing
    weights stay the model's own probabilities.
    """
    probs = torch.softmax(logits.float(), dim=-1)  # [T, E]
    if bias is None:
        weights, ids = torch.topk(probs, k, dim=-1)  # [T, K]
    else:
        ids = torch.topk(probs + bias, k, dim=-1).indices
        weights = probs.gather(-1, ids)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


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

    ``scores = sigmoid(logits)`` (or softmax); the selection uses ``scores + bias`` (the
    ``e_score_correction_bias``, never part of the weights): experts are split into
    ``n_group`` equal groups, each group is scored (``"top2_sum"``: sum of its two best
    experts; ``"max"``: its best expert), only the ``topk_group`` best groups stay eligible,
    and the top ``k`` eligible experts are chosen. The weights are their unbiased scores,
    optionally renormalised to sum to one (+1e-20), times ``scale`` (routed_scaling_factor).
    """
    logits = logits.float()
    if scoring == "sigmoid":
        scores = torch.sigmoid(logits)
    elif scoring == "softmax":
        scores = torch.softmax(logits, dim=-1)
    else:
        raise ValueError(f"unknown scoring function {scoring!r}")
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
    ids = torch.topk(choice, k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * scale
