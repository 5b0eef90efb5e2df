"""Gated-residual hyper-connections (Qwen3.8-Flash-Next, ``qwen4_exp``): a residual of ``n`` streams.

The residual is [T, n * H] (the n streams side by side; the embedding copied n times). Before
each block (attention, MLP) a ``GatedResidual`` normalises every stream on its own (an RMSNorm
over each H-wide group, (1 + w) weights) and computes from the normalised streams, through a
low-rank pair of linears, a sigmoid gate per stream and channel:

    m = sigmoid(up(silu(down(norm(h)) / n)))          [T, n * H]
    block input x = mean_k (m_k * norm(h)_k)           [T, H]
    injection weights w = 2 * sigmoid(inject(norm(h)) / n)   [T, n]

and after the block ``h_k += w_k * y`` for every stream k (``inject``). The model's last mixer
has no ``inject`` and only collapses the streams (there is no final norm after it).
transformers 5.24: ``Qwen4ExpTextGatedResidual``.

This is a different kind from DeepSeek-V4's manifold-constrained hyper-connections (pre/post
weights and a Sinkhorn-projected stream-mixing matrix): the streams here are never mixed
into each other, only gated into the block input and each given the block output back. What
the two share is the layout (n streams side by side, the embedding copied n times) and the
batch-invariant sum over streams in ascending order (``sum_streams``).

Batch invariance: the matrix products go through ``quant.linear``, transcendental functions
through ``pointwise``, norms through ``RMSNorm`` (fixed order) and the mean over streams is
written out as ascending adds, so a row's bits do not depend on the rows beside it.

Shape legend: T rows, n streams, H hidden, r the low rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..quant import linear
from .norm import RMSNorm
from .pointwise import pointwise


def sum_streams(x: torch.Tensor) -> torch.Tensor:
    """[T, n, H] -> [T, H]: the sum over the streams in ascending order (elementwise adds)."""
    out = x[:, 0]
    for k in range(1, x.shape[1]):
        out = out + x[:, k]
    return out


def expand(x: torch.Tensor, n: int) -> torch.Tensor:
    """The first streams: [T, H] -> [T, n * H], the embedding copied n times."""
    return x.repeat(1, n)


class GroupedNorm:
    """An RMSNorm over each H-wide group of [T, n * H], with (1 + w) weights [n * H]:
    ``(x * rsqrt(mean(x^2) + eps)) * (1 + w)`` as transformers rounds it (two products)."""

    def __init__(self, weight: torch.Tensor, n: int, hidden: int, eps: float):
        self.n, self.hidden = n, hidden
        self.unit = RMSNorm(torch.ones(hidden), eps)  # weight 1: x * rsqrt(...) exactly
        self.scale = (1.0 + weight.float()).reshape(n, hidden).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        return (self.unit(x.reshape(t * self.n, self.hidden).contiguous()).view(t, self.n, self.hidden)
                * self.scale).view(t, self.n * self.hidden)


class GatedResidual:
    """One block's gated residual: ``norm`` [n * H], ``down`` [r, n * H], ``up`` [n * H, r],
    ``inject`` [n, n * H] (None for the final mixer)."""

    def __init__(self, norm: torch.Tensor, down, up, inject, n: int, hidden: int, eps: float):
        self.norm = GroupedNorm(norm, n, hidden, eps)
        self.down, self.up, self.inject = down, up, inject
        self.n, self.hidden = n, hidden

    def mix(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(block input [T, H], normalised streams [T, n * H]) of streams ``h``."""
        t, n = h.shape[0], self.n
        hn = self.norm(h)
        m = pointwise(F.silu, linear(hn, self.down) / n)
        m = pointwise(torch.sigmoid, linear(m, self.up))
        return sum_streams((m * hn).view(t, n, self.hidden)) / n, hn

    def __call__(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(block input [T, H], injection weights [T, n])."""
        x, hn = self.mix(h)
        return x, 2 * pointwise(torch.sigmoid, linear(hn, self.inject) / self.n)

    def collapse(self, h: torch.Tensor) -> torch.Tensor:
        """The block input alone (the final mixer; the router lookahead's view of a later layer)."""
        return self.mix(h)[0]


def inject(h: torch.Tensor, y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The streams after a block: ``h_k + w_k * y`` (h [T, n * H], y [T, H], weights [T, n])."""
    t, n = weights.shape
    return h + (y.unsqueeze(1) * weights.unsqueeze(-1)).view(t, n * y.shape[1])


__all__ = ["GatedResidual", "GroupedNorm", "expand", "inject", "sum_streams"]
