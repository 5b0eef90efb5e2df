"""Manifold-constrained hyper-connections (mHC): a residual of ``n`` parallel streams.

The residual is [T, n, H] instead of [T, H]. Before each block (attention, MLP) a
``HyperConnection`` reads all streams and computes three mixings from them with one small
linear map over the flattened, RMS-normalised streams:

- ``pre`` [T, n]: collapses the streams into the block's input, ``sum_j pre_j h_j``;
- ``post`` [T, n]: spreads the block's output back over the streams;
- ``comb`` [T, n, n]: mixes the input streams into the output streams, projected (Sinkhorn-Knopp)
  towards a doubly-stochastic matrix so the residual cannot grow from layer to layer.

After the block, ``mix`` gives the new streams ``post_k * y + sum_j comb[j, k] h_j``. A
``HyperHead`` collapses the streams once more before the final norm. DeepSeek-V4 uses it with
n = ``hc_mult`` = 4 (transformers' ``DeepseekV4HyperConnection`` / ``DeepseekV4HyperHead``);
GLM-5.3-Flash the same connections and a ``MeanHead`` (the streams' mean).

Batch invariance: every step is per row. The one matrix product goes through ``quant.linear``
(the C kernel's fixed order), sigmoids and exponentials through ``pointwise``, and every sum
over the n streams is written out in ascending stream order (elementwise adds), so a row's
bits do not depend on how many rows share the call.

The projection ``fn`` is a matrix and may be a stream buffer's view (refilled before its
layer): it is used as given inside each call; the 1-D ``base`` and ``scale`` are converted
once.

Shape legend: T rows, n streams, H hidden.
"""

from __future__ import annotations

import torch

from ..quant import linear
from .norm import RMSNorm
from .pointwise import pointwise


def sum_ascending(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The sum over ``dim`` in ascending index order (elementwise adds: batch-invariant)."""
    parts = x.unbind(dim)
    out = parts[0]
    for p in parts[1:]:
        out = out + p
    return out


def _softmax_last(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last (small) dim: max, exp, sum in ascending order, divide."""
    m = x.amax(dim=-1, keepdim=True)
    e = pointwise(torch.exp, x - m)
    return e / sum_ascending(e, -1).unsqueeze(-1)


def collapse(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """``sum_j pre[:, j] * h[:, j]``: h [T, n, H], pre [T, n] -> [T, H]."""
    return sum_ascending(pre.unsqueeze(-1) * h, 1)


def _flat_norm(norm: RMSNorm, h: torch.Tensor) -> torch.Tensor:
    """The streams flattened to [T, n*H] and RMS-normalised (``norm`` has a weight of ones)."""
    return norm(h.reshape(h.shape[0], -1).contiguous())


class HyperConnection:
    """One block's mHC mapping: ``fn`` [(2 + n) * n, n * H], ``base`` [(2 + n) * n], ``scale`` [3]
    (pre, post, comb), ``iters`` Sinkhorn-Knopp iterations, ``eps`` its floor, ``norm_eps`` the
    RMS norm's."""

    def __init__(self, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int, eps: float,
                 norm_eps: float):
        if len(fn.shape) != 2 or fn.shape[0] != (2 + n) * n:
            raise ValueError(f"hyper-connection projection of shape {list(fn.shape)} for {n} streams")
        self.fn, self.n, self.iters, self.eps = fn, n, int(iters), float(eps)
        self.norm = RMSNorm(torch.ones(fn.shape[1]), norm_eps)  # unweighted
        self.base = base.float().reshape(-1)
        self.scale = scale.float().reshape(-1)

    def _mixes(self, h: torch.Tensor) -> torch.Tensor:
        return linear(_flat_norm(self.norm, h), self.fn)  # [T, (2 + n) * n]

    def pre(self, h: torch.Tensor, mixes: torch.Tensor | None = None) -> torch.Tensor:
        """The collapse weights [T, n]."""
        n = self.n
        m = self._mixes(h) if mixes is None else mixes
        return pointwise(torch.sigmoid, m[:, :n] * self.scale[0] + self.base[:n]) + self.eps

    def collapse(self, h: torch.Tensor) -> torch.Tensor:
        """The block input this mapping gives for streams ``h`` [T, n, H] -> [T, H] (the router
        lookahead's view of a later layer: only ``pre`` is computed)."""
        return collapse(h, self.pre(h))

    def __call__(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(post [T, n], comb [T, n, n], collapsed block input [T, H]) for streams h [T, n, H]."""
        n, eps, t = self.n, self.eps, h.shape[0]
        m = self._mixes(h)
        pre = self.pre(h, m)
        post = 2 * pointwise(torch.sigmoid, m[:, n:2 * n] * self.scale[1] + self.base[n:2 * n])
        logits = m[:, 2 * n:].reshape(t, n, n) * self.scale[2] + self.base[2 * n:].reshape(n, n)
        comb = _softmax_last(logits) + eps
        comb = comb / (sum_ascending(comb, 1).unsqueeze(1) + eps)  # columns
        for _ in range(self.iters - 1):
            comb = comb / (sum_ascending(comb, 2).unsqueeze(2) + eps)  # rows
            comb = comb / (sum_ascending(comb, 1).unsqueeze(1) + eps)  # columns
        return post, comb, collapse(h, pre)


def mix(h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The streams after a block: ``out_k = post_k * y + sum_j comb[j, k] * h_j`` (h [T, n, H],
    post [T, n], comb [T, n, n], y [T, H] -> [T, n, H])."""
    carried = sum_ascending(comb.unsqueeze(-1) * h.unsqueeze(2), 1)  # [T, n(k), H], j ascending
    return post.unsqueeze(-1) * y.unsqueeze(1) + carried


class HyperHead:
    """The final collapse: ``fn`` [n, n * H], ``base`` [n], ``scale`` [1];
    ``sum_j (sigmoid(scale * (norm(h) @ fn.T)_j + base_j) + eps) h_j``."""

    def __init__(self, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, eps: float,
                 norm_eps: float):
        if len(fn.shape) != 2 or fn.shape[0] != n:
            raise ValueError(f"hyper-head projection of shape {list(fn.shape)} for {n} streams")
        self.fn, self.n, self.eps = fn, n, float(eps)
        self.norm = RMSNorm(torch.ones(fn.shape[1]), norm_eps)  # unweighted
        self.base = base.float().reshape(-1)
        self.scale = scale.float().reshape(-1)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        m = linear(_flat_norm(self.norm, h), self.fn)  # [T, n]
        pre = pointwise(torch.sigmoid, m * self.scale[0] + self.base) + self.eps
        return collapse(h, pre)


class MeanHead:
    """The final collapse of GLM-5.3-Flash: the streams' plain mean, ``sum_j h_j / n`` (no weights)."""

    def __init__(self, n: int):
        self.n = n

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return sum_ascending(h, 1) / self.n


def expand(x: torch.Tensor, n: int) -> torch.Tensor:
    """The first streams: the embedding copied n times, [T, H] -> [T, n, H]."""
    return x.unsqueeze(1).expand(x.shape[0], n, x.shape[1]).contiguous()


__all__ = ["HyperConnection", "HyperHead", "MeanHead", "collapse", "expand", "mix"]
