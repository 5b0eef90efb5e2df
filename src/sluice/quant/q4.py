"""q4: 4-bit integers, one f16 scale per group of 32 along the input dimension, symmetric.

Parts of an [N, K] matrix (K padded with zero weights to a multiple of 32, G = Kp / 32):
  ``blocks`` uint8 [N, G, 16]   element 2i of a group in the low nibble of byte i, 2i+1 in
                                the high nibble (the same order as MXFP4 / GPT-OSS)
  ``scales`` f16 [N, G]         W = (nibble - 8) * scale, nibble - 8 in [-8, 7]
4.5 bits per weight.

Quantization: per group, scale candidates signed_amax / c for 17 values of c in [-9, -6.5]
(signed_amax is the element of largest magnitude, so c = -8 maps it exactly to level -8),
each refined once by least squares for its rounded levels, rounded to f16; the candidate
with the smallest squared error wins. Chosen over groups of 64/128 and an asymmetric
(scale + min) variant by error at equal bits; see docs/quantization.md.
"""

from __future__ import annotations

import torch

from .formats import Format, PartSpec, register

GROUP = 32


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., 32] in 0..15 -> bytes [..., 16], element 2i low nibble, 2i+1 high nibble."""
    q = q.to(torch.uint8)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous()


def unpack_nibbles(b: torch.Tensor) -> torch.Tensor:
    """bytes [..., 16] -> codes [..., 32] (int64) in natural order."""
    lo = (b & 0x0F).long()
    hi = (b >> 4).long()
    return torch.stack((lo, hi), dim=-1).flatten(-2)


_CANDIDATES = torch.linspace(-9.0, -6.5, 17)  # scale = signed_amax / c


def _tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dimension (32) as the fixed pairwise tree the C quantizer uses."""
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x


def _levels(wg: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """round(wg / d) to nearest even, clamped to [-8, 7], per group of ``wg`` [r, G, 32] for scales
    ``d`` [r, G, 1]; 0 where d is 0 or the quotient is NaN."""
    zero = d == 0
    q = wg.div(torch.where(zero, 1.0, d)).round_().clamp_(-8, 7).nan_to_num_(nan=0.0)
    if zero.any():
        q.masked_fill_(zero.expand_as(q), 0.0)
    return q


def _quantize_rows_torch(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The q4 scale search in torch (the fallback without C kernels; same bytes as the C one)."""
    r, kp = w.shape
    wg = w.reshape(r, kp // GROUP, GROUP)
    m = wg.gather(-1, wg.abs().argmax(-1, keepdim=True))  # signed value of largest magnitude
    best_e = best_d = None
    for c in _CANDIDATES.tolist():
        q = _levels(wg, m / c)
        qq = _tree_sum(q * q)
        wq = _tree_sum(q.mul_(wg))
        d = torch.where(qq > 0, wq / qq.clamp_min(1e-30), 0.0)
        d = d.clamp(-65504, 65504).half().float()
        q = _levels(wg, d)
        e = _tree_sum(q.mul_(d).sub_(wg).square_())
        if best_e is None:
            best_e, best_d = e, d
        else:
            better = e < best_e
            best_e = torch.where(better, e, best_e)
            best_d = torch.where(better, d, best_d)
    return pack_nibbles(_levels(wg, best_d).add_(8)), best_d.squeeze(-1).half()


class Q4(Format):
    name = "q4"
    lossy = True
    bits_per_weight = 4.5
    block = GROUP
    code = 4
    small_batch = (6, 64)  # f32 / q8 activations: measured crossovers with dequantize + sgemm

    def parts(self, n: int, k: int) -> PartSpec:
        g = self.padded_k(k) // GROUP
        return {"blocks": (torch.uint8, (n, g, 16)), "scales": (torch.float16, (n, g))}

    def quantize(self, w: torch.Tensor, seed: int = 0) -> dict[str, torch.Tensor]:
        from .cquant import q4_quantize

        # the C quantizer: the whole matrix at once (bf16/f16 widened and padded in C), rows over threads
        out = q4_quantize(w, _CANDIDATES)
        if out is not None:
            return {"blocks": out[0], "scales": out[1]}
        w = w.float()
        n, k = w.shape
        kp = self.padded_k(k)
        if kp != k:
            w = torch.nn.functional.pad(w, (0, kp - k))
        blocks = torch.empty(n, kp // GROUP, 16, dtype=torch.uint8)
        scales = torch.empty(n, kp // GROUP, dtype=torch.float16)
        step = max(1, (1 << 22) // kp)
        for r0 in range(0, n, step):
            b, s = self._quantize_rows(w[r0 : r0 + step])
            blocks[r0 : r0 + step] = b
            scales[r0 : r0 + step] = s
        return {"blocks": blocks, "scales": scales}

    @staticmethod
    def _quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _quantize_rows_torch(w)

    def dequantize_rows(self, parts, n, k, r0, r1):
        q = unpack_nibbles(parts["blocks"][r0:r1]).float() - 8.0  # [r, G, 32]
        w = q * parts["scales"][r0:r1].float()[..., None]
        return w.reshape(r1 - r0, -1)

    def _kernel_parts(self, parts):
        return parts["blocks"], parts["scales"]


Q4_FORMAT = register(Q4())
