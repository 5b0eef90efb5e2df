"""mxfp4: OCP Microscaling FP4 — E2M1 elements, one E8M0 (power of two) scale per 32.

Parts of an [N, K] matrix (K padded with zero weights to a multiple of 32, G = Kp / 32):
  ``blocks`` uint8 [N, G, 16]   E2M1 codes, element 2i in the low nibble of byte i, 2i+1 in
                                the high nibble
  ``scales`` uint8 [N, G]       E8M0 exponents biased by 127
  W = E2M1(code) * 2^(scale - 127), E2M1 = {0, .5, 1, 1.5, 2, 3, 4, 6} with bit 3 the sign
4.25 bits per weight.

This is exactly how GPT-OSS checkpoints store experts (``*_blocks`` [E, out, in/32, 16] and
``*_scales`` [E, out, in/32]): one expert's slices are used as they are, without
requantizing, and ``dequantize`` is bit-identical to transformers' ``convert_moe_packed_tensors``
for every code and exponent: the exact value rounded to the output type, -0.0 for code 8,
subnormal results for small exponents, and the E8M0 NaN code 255 read as 2^128 (0 stays 0,
0.5 gives 2^127, larger magnitudes overflow to inf), as its ``ldexp`` does.

``quantize`` (from float weights): per block the OCP shared exponent floor(log2(amax)) - 2,
or one more when that has a strictly smaller squared error (summed over the block as the fixed
pairwise tree of q4's ``_tree_sum``, so the bytes do not depend on the host's SIMD width), then
round to the nearest E2M1 value (ties to even), saturating at 6. Non-finite weights are defined,
not refused: an inf block gets exponent 124 (torch's ``frexp`` gives inf the exponent 0) and
saturated codes; a block holding a NaN gets exponent 0 and a NaN element code 0. The C
quantizer (kernels/quantize.c) gives the same bytes; this torch form is its fallback.
"""

from __future__ import annotations

import torch

from .formats import Format, PartSpec, register
from .q4 import _tree_sum, pack_nibbles, unpack_nibbles

GROUP = 32
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_LUT = torch.tensor(FP4_VALUES, dtype=torch.float32)
_LUT2 = _LUT * 2  # 2 * E2M1: integers, so that 2v * 2^(e - 128) is exact even for e = 255
# magnitude thresholds between E2M1 values, and whether a tie rounds up (to the even code)
_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> 2^(e - 128) as fp32, exactly (half the block scale; subnormal for e < 2)."""
    e = e.to(torch.int32)
    bits = torch.where(e >= 2, (e - 1) << 23, torch.full_like(e, 0x00200000) << e.clamp(0, 1))
    return bits.view(torch.float32)


def e2m1_codes(a: torch.Tensor) -> torch.Tensor:
    """fp32 values (already divided by the block scale) -> E2M1 codes 0..15, nearest, ties to even."""
    mag = a.abs()
    idx = torch.zeros(a.shape, dtype=torch.uint8)
    for t, up in _THRESHOLDS:
        idx += (mag >= t) if up else (mag > t)
    return idx | ((a < 0) & (idx > 0)).to(torch.uint8) << 3


def _quantize_rows_torch(w: torch.Tensor, search: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The mxfp4 quantizer in torch (the fallback without C kernels; same bytes as the C one)."""
    r, kp = w.shape
    wg = w.reshape(r, kp // GROUP, GROUP)
    amax = wg.abs().amax(-1, keepdim=True)
    _, ex = torch.frexp(amax)  # amax = m * 2^ex, m in [0.5, 1): floor(log2(amax)) = ex - 1
    biased = torch.where(amax > 0, ex - 1 - 2 + 127, torch.zeros_like(ex)).clamp(0, 254)
    best_e = best_c = best_s = None
    for extra in (0, 1) if search else (0,):
        s = (biased + extra).clamp(0, 254)
        scale = e8m0_half(s) * 2  # 2^(s - 127), s <= 254
        codes = e2m1_codes(wg / scale)
        err = _tree_sum((_LUT[codes.long()] * scale - wg) ** 2)
        if best_e is None:
            best_e, best_c, best_s = err, codes, s
        else:
            better = err < best_e
            best_e = torch.where(better, err, best_e)
            best_c = torch.where(better, codes, best_c)
            best_s = torch.where(better, s, best_s)
    return pack_nibbles(best_c), best_s.squeeze(-1).to(torch.uint8)


class MXFP4(Format):
    name = "mxfp4"
    lossy = True
    bits_per_weight = 4.25
    block = GROUP
    code = 5
    small_batch = (6, 64)  # f32 / q8 activations: measured crossovers with dequantize + sgemm

    def parts(self, n: int, k: int) -> PartSpec:
        g = self.padded_k(k) // GROUP
        return {"blocks": (torch.uint8, (n, g, 16)), "scales": (torch.uint8, (n, g))}

    def quantize(self, w: torch.Tensor, seed: int = 0, search: bool = True) -> dict[str, torch.Tensor]:
        if search:  # the C quantizer: the whole matrix at once (bf16/f16 widened and padded in C), rows over threads
            from .cquant import mxfp4_quantize

            out = mxfp4_quantize(w)
            if out is not None:
                return {"blocks": out[0], "scales": out[1]}
        w = w.float()
        n, k = w.shape
        kp = self.padded_k(k)
        if kp != k:
            w = torch.nn.functional.pad(w, (0, kp - k))
        blocks = torch.empty(n, kp // GROUP, 16, dtype=torch.uint8)
        scales = torch.empty(n, kp // GROUP, dtype=torch.uint8)
        step = max(1, (1 << 22) // kp)
        for r0 in range(0, n, step):
            b, s = self._quantize_rows(w[r0 : r0 + step], search)
            blocks[r0 : r0 + step] = b
            scales[r0 : r0 + step] = s
        return {"blocks": blocks, "scales": scales}

    @staticmethod
    def _quantize_rows(w: torch.Tensor, search: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return _quantize_rows_torch(w, search)

    def dequantize_rows(self, parts, n, k, r0, r1):
        codes = unpack_nibbles(parts["blocks"][r0:r1])  # [r, G, 32]
        w = _LUT2[codes] * e8m0_half(parts["scales"][r0:r1])[..., None]
        return w.reshape(r1 - r0, -1)

    def _kernel_parts(self, parts):
        return parts["blocks"], parts["scales"]


MXFP4_FORMAT = register(MXFP4())
