"""int8: per-output-row symmetric 8-bit integers with one fp32 scale per row.

Parts of an [N, K] matrix (K padded with zero weights to a multiple of 32):
  ``weight`` int8 [N, Kp]   values in [-127, 127]
  ``scales`` f32 [N]        W[n, k] = weight[n, k] * scales[n]
8 + 32/K bits per weight. The scale of each row is chosen among clipping ratios of its
absolute maximum by squared error (round to nearest, ties to even): s = amax * ratio / 127
in fp32, levels round(w / s) clamped to [-127, 127] (w / 1 where s is 0), the first ratio with
the strictly smallest error wins. The error of a row is summed in a fixed order, so that the
bytes do not depend on the host's SIMD width: per column j of its [Kp / 32, 32] view the groups
in order, then the 32 column sums as q4's pairwise tree. The C quantizer (kernels/quantize.c,
used wherever the kernels are built) and this torch form give the same bytes (tested).
Non-finite input is kept, not refused: a row holding inf gets scale inf, one holding NaN scale
NaN (0x7fc00000); either dequantizes to NaN (as the source row would poison any product), and
a level that is NaN (inf / inf, NaN) is stored as 0.
"""

from __future__ import annotations

import torch

from .formats import Format, PartSpec, register
from .q4 import _tree_sum

GROUP = 32
RATIOS = (1.0, 0.98, 0.96, 0.94, 0.92, 0.9, 0.88, 0.85, 0.82, 0.8)  # clipping ratios, in search order
_RATIOS = torch.tensor(RATIOS, dtype=torch.float32)
_NAN = float("nan")


def _levels(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """round(w / s) to nearest even, clamped to [-127, 127] (s = 0 divides by 1)."""
    return w.div(torch.where(s > 0, s, 1.0)).round_().clamp_(-127, 127)


def _row_sum(e: torch.Tensor) -> torch.Tensor:
    """Sums [r, 1] of rows ``e`` [r, Kp] in the C quantizer's order: per column of the [Kp / 32, 32]
    view the groups in order, then the 32 column sums as a pairwise tree."""
    r, kp = e.shape
    e = e.reshape(r, kp // GROUP, GROUP)
    acc = torch.zeros(r, GROUP, dtype=e.dtype)
    for g in range(e.shape[1]):
        acc.add_(e[:, g])
    return _tree_sum(acc)


class Int8(Format):
    name = "int8"
    lossy = True
    bits_per_weight = 8.0
    block = 32
    code = 3
    small_batch = (6, 32)  # f32 / q8 activations: measured crossovers with dequantize + sgemm

    def parts(self, n: int, k: int) -> PartSpec:
        return {"weight": (torch.int8, (n, self.padded_k(k))), "scales": (torch.float32, (n,))}

    def quantize(self, w: torch.Tensor, seed: int = 0) -> dict[str, torch.Tensor]:
        from .cquant import int8_quantize

        # the C quantizer: the whole matrix at once (bf16/f16 widened and padded in C), rows over threads
        out = int8_quantize(w, _RATIOS)
        if out is not None:
            return {"weight": out[0], "scales": out[1]}
        n, k = w.shape
        kp = self.padded_k(k)
        weight = torch.empty(n, kp, dtype=torch.int8)
        scales = torch.empty(n, dtype=torch.float32)
        step = max(1, (1 << 22) // max(kp, 1))  # bounded fp32 temporaries
        for r0 in range(0, n, step):
            rows = torch.nn.functional.pad(w[r0 : r0 + step].float(), (0, kp - k))
            q, s = self._quantize_rows(rows)
            weight[r0 : r0 + step] = q
            scales[r0 : r0 + step] = s
        return {"weight": weight, "scales": scales}

    @staticmethod
    def _quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The search in torch for rows ``w`` [r, Kp] (padded): the fallback without C kernels."""
        # Only the winning scale per row is kept; its integers are recomputed once from it.
        amax = w.abs().amax(1, keepdim=True)
        best_err = best_s = None
        for ratio in RATIOS:
            s = amax * ratio / 127.0
            err = _row_sum(_levels(w, s).mul_(s).sub_(w).square_())
            if best_err is None:
                best_err, best_s = err, s
            else:
                better = err < best_err
                best_err = torch.where(better, err, best_err)
                best_s = torch.where(better, s, best_s)
        q = _levels(w, best_s).nan_to_num_(nan=0.0).to(torch.int8)
        return q, torch.where(best_s.isnan(), _NAN, best_s).reshape(-1)

    def dequantize_rows(self, parts, n, k, r0, r1):
        return parts["weight"][r0:r1].float() * parts["scales"][r0:r1, None]

    def gather_rows(self, parts, n, k, ids):
        return parts["weight"][ids, :k].float() * parts["scales"][ids, None]

    def _kernel_parts(self, parts):
        return parts["weight"], parts["scales"]


INT8 = register(Int8())
