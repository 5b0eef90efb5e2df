"""int8: per-output-row symmetric 8-bit integers with one fp32 scale per row.

Parts of an [N, K] matrix (K padded with zero weights to a multiple of 32):
  ``weight`` int8 [N, Kp]   values in [-127, 127]
  ``scales`` f32 [N]        W[n, k] = weight[n, k] * scales[n]
8 + 32/K bits per weight. The scale of each row is chosen among clipping ratios of its
absolute maximum by squared error (round to nearest, ties to even).
"""

from __future__ import annotations

import torch

from .formats import Format, PartSpec, register


def _levels(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """round(w / s) to nearest even, clamped to [-127, 127] (s = 0 divides by 1)."""
    return w.div(torch.where(s > 0, s, 1.0)).round_().clamp_(-127, 127)


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
        n, k = w.shape
        weight = torch.zeros(n, self.padded_k(k), dtype=torch.int8)
        scales = torch.empty(n, dtype=torch.float32)
        step = max(1, (1 << 22) // max(k, 1))  # bounded fp32 temporaries
        for r0 in range(0, n, step):
            q, s = self._quantize_rows(w[r0 : r0 + step].float())
            weight[r0 : r0 + step, :k] = q
            scales[r0 : r0 + step] = s
        return {"weight": weight, "scales": scales}

    @staticmethod
    def _quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Same bytes as keeping each ratio's integers: only the winning scale per row is kept,
        # and its integers are recomputed once from that same scale with the same operations.
        amax = w.abs().amax(1, keepdim=True)
        best_err = best_s = None
        for ratio in (1.0, 0.98, 0.96, 0.94, 0.92, 0.9, 0.88, 0.85, 0.82, 0.8):
            s = amax * ratio / 127.0
            err = _levels(w, s).mul_(s).sub_(w).square_().sum(1, keepdim=True)
            if best_err is None:
                best_err, best_s = err, s
            else:
                better = err < best_err
                best_err = torch.where(better, err, best_err)
                best_s = torch.where(better, s, best_s)
        return _levels(w, best_s).to(torch.int8), best_s.reshape(-1)

    def dequantize_rows(self, parts, n, k, r0, r1):
        return parts["weight"][r0:r1].float() * parts["scales"][r0:r1, None]

    def gather_rows(self, parts, n, k, ids):
        return parts["weight"][ids, :k].float() * parts["scales"][ids, None]

    def _kernel_parts(self, parts):
        return parts["weight"], parts["scales"]


INT8 = register(Int8())
