"""RMSNorm, computed in fp32 exactly as Hugging Face does."""

from __future__ import annotations

import torch


class RMSNorm:
    """``weight * x / sqrt(mean(x^2) + eps)``; ``offset=1.0`` gives the (1 + weight) variant."""

    def __init__(self, weight: torch.Tensor, eps: float, offset: float = 0.0):
        self.weight = weight.float() + offset if offset else weight.float()
        self.eps = eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., D] fp32
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.eps))
