"""fp32 activations x {f32, bf16, f16} weights, fp32 results."""

from __future__ import annotations

import torch
import torch.nn.functional as F

_CHUNK_ELEMS = 4 << 20  # bound on the fp32 temporary when upcasting a weight (16 MiB)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` in fp32. x: [T, K] fp32, weight: [N, K] any float dtype.

    Half-precision weights are upcast in bounded row chunks, so the temporary never
    exceeds 16 MiB however large the matrix (an lm_head of 150k rows included).
    """
    if weight.dtype == torch.float32:
        return F.linear(x, weight, bias)
    n, k = weight.shape
    rows = max(1, _CHUNK_ELEMS // max(k, 1))
    if rows >= n:
        return F.linear(x, weight.float(), None if bias is None else bias.float())
    out = torch.empty(x.shape[:-1] + (n,), dtype=torch.float32)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        torch.matmul(x, weight[r0:r1].float().t(), out=out[..., r0:r1])
    if bias is not None:
        out += bias.float()
    return out
