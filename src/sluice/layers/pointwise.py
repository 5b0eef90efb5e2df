"""Element-wise math whose result for an element does not depend on the tensor around it.

torch's CPU kernels for transcendental functions (exp, sigmoid, silu, cos, ...) compute most
elements with a vectorized formula and the last few of each loop with a scalar one, and the
two differ in the last bit (measured: ``torch.sigmoid`` of the last row of a [300, 8] tensor
differs from the same row computed alone). Which elements fall in the tail depends on the
tensor's size, so a token's result would depend on how many tokens share the call.

``pointwise(fn, x)`` runs ``fn`` on x flattened and zero-padded to a multiple of 64 elements,
in blocks of at most ``BLOCK`` elements (below torch's parallel grain of 32768: one thread,
one loop per call), so every element goes through the vectorized formula. Only with
batch-invariant kernels (``cpu.batch_invariant()``); otherwise ``fn(x)``.
"""

from __future__ import annotations

import torch

from ..kernels.backend import cpu

ALIGN = 64  # a multiple of every vector step torch's element-wise loops take (16 or 32 floats)
BLOCK = 16384  # elements per call: a multiple of ALIGN, below torch's parallel grain size


def pointwise(fn, x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for an element-wise ``fn``, each element computed the same way whatever x's shape."""
    if not cpu.batch_invariant():
        return fn(x)
    n = x.numel()
    pad = (-n) % ALIGN
    flat = x.reshape(-1)
    flat = torch.cat([flat, flat.new_zeros(pad)]) if pad else flat.contiguous()
    if flat.numel() <= BLOCK:
        out = fn(flat)
    else:
        out = torch.empty_like(flat)
        for i in range(0, flat.numel(), BLOCK):
            out[i : i + BLOCK] = fn(flat[i : i + BLOCK])
    return out[:n].view(x.shape)
