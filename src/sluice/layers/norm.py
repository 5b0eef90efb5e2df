"""RMSNorm in fp32: Hugging Face's formula, with one summation order on every path.

``weight * (x * rsqrt(mean(x^2) + eps))``: with the C kernels (``cpu.rmsnorm``) the sum of
squares of a row has one fixed order whatever the number of rows and the host's instruction
set (torch's reduction blocks differently on AVX2 and AVX-512 hosts); the two products are
rounded as torch rounds them. Without the C kernels, the torch expression.
"""

from __future__ import annotations

import torch

from ..kernels.backend import cpu


class RMSNorm:
    """``weight * x / sqrt(mean(x^2) + eps)``; ``offset=1.0`` gives the (1 + weight) variant."""

    def __init__(self, weight: torch.Tensor, eps: float, offset: float = 0.0):
        self.weight = (weight.float() + offset if offset else weight.float()).contiguous()
        self.eps = eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., D] fp32
        if x.dtype == torch.float32 and cpu.norm_available():
            return cpu.rmsnorm(x, self.weight, self.eps)
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.eps))

    def add(self, x: torch.Tensor, res: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add and the norm of its result in one call: ``(x + res, self(x + res))``."""
        if x.dtype == res.dtype == torch.float32 and x.shape == res.shape and cpu.norm_available():
            return cpu.rmsnorm(x, self.weight, self.eps, res)
        h = x + res
        return h, self(h)
