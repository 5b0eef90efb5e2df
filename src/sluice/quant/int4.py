"""int4: compressed-tensors "pack-quantized" INT4 weights, one bf16 scale per group of 32, symmetric.

How Kimi K2-Thinking and K2.5/K2.6 checkpoints store their routed experts (quantization_config
``quant_method: compressed-tensors``, ``format: pack-quantized``, 4-bit ``int`` weights,
``strategy: group``, ``group_size: 32``, ``symmetric: true``; read by ``compressed_tensors.parse``,
for any family's experts: ``models/weight_format.py``). Parts of an [N, K] matrix
(K a multiple of 32, as the checkpoints have it; G = K / 32):
  ``packed`` int32 [N, K / 8]   (``<module>.weight_packed``) eight 4-bit codes per int32, code
                                8j + i of a row in bits 4i..4i+3 of its int32 j (lowest first),
                                each code the signed level plus 8 (an unsigned nibble 0..15)
  ``scale``  bf16  [N, G]       (``<module>.weight_scale``) W = (code - 8) * scale
4.5 bits per weight. ``W`` is the exact product (a 4-bit level times an 8-bit significand fits
fp32), the model the checkpoint encodes; ``dequantize`` gives it in fp32.

Read as stored, on disk and in the expert cache. Seen as bytes on a little-endian host, the
int32 words are q4's ``blocks`` (element 2i of a group in the low nibble of byte i), so
``bind`` multiplies with q4's kernels over the same memory, its scales converted to f16 once
per assembled expert, where every scale of the matrix converts to f16 exactly (a bf16 value
is an f16 one when its magnitude is 0 or in [2^-17, 65504]: all scales of the released
checkpoints); otherwise the matrix is multiplied from this module's own fp32 dequantization.
"""

from __future__ import annotations

import sys

import torch

from .formats import Format, PartSpec, QuantMatrix, register
from .q4 import Q4_FORMAT

GROUP = 32
PER_WORD = 8  # 4-bit codes per int32
OFFSET = 8  # stored code = level + 8


def pack_int32(levels: torch.Tensor) -> torch.Tensor:
    """Signed levels [N, K] in -8..7 (K a multiple of 8) -> int32 [N, K / 8], code 8j + i in bits 4i.."""
    n, k = levels.shape
    codes = (levels.to(torch.int64) + OFFSET).reshape(n, k // PER_WORD, PER_WORD)
    shifts = torch.arange(PER_WORD, dtype=torch.int64) * 4
    word = (codes << shifts).sum(-1)  # 0 .. 2^32 - 1
    return torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)


def unpack_int32(packed: torch.Tensor) -> torch.Tensor:
    """int32 [N, K / 8] -> signed levels [N, K] (int64) in -8..7: the inverse of ``pack_int32``."""
    shifts = torch.arange(PER_WORD, dtype=torch.int64) * 4
    codes = (packed.to(torch.int64)[..., None] >> shifts) & 0xF
    return codes.flatten(-2) - OFFSET


def dequantize_reference(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The checkpoint's weight [N, K] in fp32 from ``weight_packed`` and ``weight_scale`` (exact)."""
    q = unpack_int32(packed).float()
    n, k = q.shape
    return (q.reshape(n, k // GROUP, GROUP) * scale.float()[..., None]).reshape(n, k)


def f16_exact(scale: torch.Tensor) -> bool:
    """Whether every value of ``scale`` converts to f16 and back unchanged (NaN never does)."""
    return bool(torch.equal(scale.to(torch.float16).to(scale.dtype), scale))


class Int4(Format):
    name = "int4"
    lossy = True
    bits_per_weight = 4.5
    block = GROUP
    code = None  # multiplied through q4's kernels after ``bind`` (see the module docstring)

    def parts(self, n: int, k: int) -> PartSpec:
        g = self.padded_k(k) // GROUP
        return {"packed": (torch.int32, (n, g * GROUP // PER_WORD)), "scale": (torch.bfloat16, (n, g))}

    def quantize(self, w: torch.Tensor, seed: int = 0) -> dict[str, torch.Tensor]:
        """Round to nearest with a bf16 scale amax / 7.5 per group (levels clamped to -8..7)."""
        w = w.float()
        n, k = w.shape
        kp = self.padded_k(k)
        if kp != k:
            w = torch.nn.functional.pad(w, (0, kp - k))
        wg = w.reshape(n, kp // GROUP, GROUP)
        scale = (wg.abs().amax(-1) / 7.5).to(torch.bfloat16)
        d = scale.float()[..., None]
        q = torch.where(d > 0, wg / torch.where(d > 0, d, 1.0), 0.0).round().clamp(-8, 7)
        return {"packed": pack_int32(q.reshape(n, kp)), "scale": scale}

    def dequantize_rows(self, parts, n, k, r0, r1):
        return dequantize_reference(parts["packed"][r0:r1], parts["scale"][r0:r1])

    def bind(self, parts, n, k, exact=False, block=None, name=""):
        packed, scale = parts["packed"], parts["scale"]
        if sys.byteorder == "little" and packed.is_contiguous() and f16_exact(scale):
            g = self.padded_k(k) // GROUP
            q4 = {"blocks": packed.view(torch.uint8).view(n, g, 16), "scales": scale.to(torch.float16)}
            return Int4Matrix(self, parts, n, k, exact, QuantMatrix(Q4_FORMAT, q4, n, k, exact))
        return QuantMatrix(self, parts, n, k, exact)


class Int4Matrix(QuantMatrix):
    """An int4 matrix (its ``format`` and ``parts`` the stored ones, which ``sluice convert`` copies)
    multiplied as ``q4``, the same words with f16 scales (``q4``)."""

    __slots__ = ("q4",)

    def __init__(self, fmt: Format, parts, n: int, k: int, exact: bool, q4: QuantMatrix):
        super().__init__(fmt, parts, n, k, exact)
        self.q4 = q4
        self._fast = q4._fast

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.q4.matmul(x, bias)

    linear = matmul


INT4_FORMAT = register(Int4())
