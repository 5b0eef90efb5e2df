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
