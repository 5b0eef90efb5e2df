"""fp4: DeepSeek-V4's FP4 routed experts, e2m1 two per byte with one ue8m0 scale per 32 inputs.

Parts of an [N, K] matrix (K padded with zero weights to a multiple of 32, G = Kp / 32), as the
published checkpoints store ``layers.L.ffn.experts.E.w{1,2,3}.weight`` / ``.scale``:
  ``weight`` int8 [N, Kp / 2]             e2m1 codes, element 2i in the low nibble of byte i,
                                          2i+1 in the high nibble (bit 3 of a code the sign)
  ``scale``  float8_e8m0fnu [N, G]        one power of two 2^(e - 127) per 32 consecutive inputs
  W[n, k] = E2M1(code[n, k]) * scale[n, k // 32], E2M1 = {0, .5, 1, 1.5, 2, 3, 4, 6}
4.25 bits per weight.

This is transformers' reading of them (``Fp8Dequantize._unpack_fp4`` / ``_dequantize_one`` in
``integrations/finegrained_fp8.py``: ``u8 & 0xF`` first, ``u8 >> 4`` second, scales
``.to(float32)``), and byte for byte OCP MXFP4 (``mxfp4.py``, GPT-OSS's ``*_blocks`` / ``*_scales``
with the 16 bytes of a block flattened into the row): the same nibble order, the same E2M1 table,
the same E8M0 exponent. So the stored parts are multiplied by the mxfp4 C kernels through views
(``_kernel_parts``: no copy, no requantization), and ``dequantize_rows`` (the reference, plain
torch, written from the format) equals mxfp4's on the same bytes. One difference: the E8M0 code
255 is NaN to torch (and so to transformers: the whole block NaN) while the mxfp4 kernels read it
as 2^128; no released checkpoint stores it (``quantize`` never writes it).

``quantize`` (from float weights, for ``sluice convert --experts fp4`` and tests) is mxfp4's,
its bytes reinterpreted.
"""

from __future__ import annotations

import torch

from .formats import Format, PartSpec, register
from .mxfp4 import GROUP, MXFP4_FORMAT

E8M0 = torch.float8_e8m0fnu
FORMAT = "fp4"
E2M1 = torch.tensor((0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0))


class FP4(Format):
    name = FORMAT
    lossy = True
    bits_per_weight = 4.25
    block = GROUP
    code = MXFP4_FORMAT.code  # the mxfp4 kernels: the same bytes (see the module docstring)
    small_batch = MXFP4_FORMAT.small_batch

    def parts(self, n: int, k: int) -> PartSpec:
        kp = self.padded_k(k)
        return {"weight": (torch.int8, (n, kp // 2)), "scale": (E8M0, (n, kp // GROUP))}

    def quantize(self, w: torch.Tensor, seed: int = 0) -> dict[str, torch.Tensor]:
        out = MXFP4_FORMAT.quantize(w, seed)
        n = w.shape[0]
        return {"weight": out["blocks"].view(n, -1).view(torch.int8), "scale": out["scales"].view(E8M0)}

    def dequantize_rows(self, parts, n, k, r0, r1):
        u8 = parts["weight"][r0:r1].view(torch.uint8)
        codes = torch.stack(((u8 & 0xF).long(), (u8 >> 4).long()), dim=-1).reshape(r1 - r0, -1)  # [r, Kp]
        scale = parts["scale"][r0:r1].float()  # 2^(e - 127) exactly; NaN for e = 255
        return (E2M1[codes].view(r1 - r0, -1, GROUP) * scale[..., None]).reshape(r1 - r0, -1)

    def _kernel_parts(self, parts):
        w, s = parts["weight"], parts["scale"]
        n, g = s.shape
        return w.view(torch.uint8).view(n, g, 16), s.view(torch.uint8)


FP4_FORMAT = register(FP4())

__all__ = ["E2M1", "E8M0", "FORMAT", "FP4", "FP4_FORMAT"]
