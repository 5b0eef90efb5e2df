"""Relative reconstruction error ||W - deq(quant(W))||_F / ||W||_F of each format on random
N(0, 1) matrices, plus the design alternatives that were measured and rejected.

    PYTHONPATH=src python benchmarks/quant_error.py [--rows 1024] [--cols 4096]
"""

from __future__ import annotations

import argparse
import time

import sluice  # noqa: F401  (before torch: it sets OpenMP's wait policy)
import torch

from sluice.quant import FORMATS


def rel(a: torch.Tensor, w: torch.Tensor) -> float:
    return ((a - w).norm() / w.norm()).item()


def q4_variant(w: torch.Tensor, group: int, asym: bool, search: bool) -> torch.Tensor:
    """Alternatives to the shipped q4 (symmetric, 32, searched scale), f16 scale (and min)."""
    n, k = w.shape
    wg = w.reshape(n, k // group, group)
    if asym:  # scale + min, levels 0..15
        lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
        d = ((hi - lo) / 15).half().float()
        lo = lo.half().float()
        q = ((wg - lo) / torch.where(d > 0, d, torch.ones_like(d))).round().clamp(0, 15)
        return (q * d + lo).reshape(n, k)
    m = wg.gather(-1, wg.abs().argmax(-1, keepdim=True))
    best = None
    for c in (torch.linspace(-9.0, -6.5, 17).tolist() if search else [-8.0]):
        d = (m / c).half().float()
        q = (wg / torch.where(d != 0, d, torch.ones_like(d))).round().clamp(-8, 7)
        r = q * d
        e = ((r - wg) ** 2).sum(-1, keepdim=True)
        best = (e, r) if best is None else (torch.minimum(e, best[0]), torch.where(e < best[0], r, best[1]))
    return best[1].reshape(n, k)


def int8_rtn(w: torch.Tensor) -> torch.Tensor:
    s = w.abs().amax(1, keepdim=True) / 127
    return (w / s).round().clamp(-127, 127) * s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    w = torch.randn(args.rows, args.cols, generator=torch.Generator().manual_seed(args.seed))
    print(f"N(0, 1) [{args.rows}, {args.cols}], seed {args.seed}")
    print("| format | bits/weight | relative error | quantize time |")
    print("|---|---|---|---|")
    for name in ("bf16", "f16", "int8", "q4", "mxfp4", "rvq3"):
        fmt = FORMATS[name]
        t = time.perf_counter()
        parts = fmt.quantize(w)
        dt = time.perf_counter() - t
        bits = fmt.nbytes(*w.shape) * 8 / w.numel()
        print(f"| {name} | {bits:.3f} | {rel(fmt.dequantize(parts, *w.shape), w):.4f} | {dt:.1f} s |")
    print("\nalternatives (not shipped):")
    print("| variant | bits/weight | relative error |")
    print("|---|---|---|")
    print(f"| int8, scale = amax/127 (no clipping search) | 8.008 | {rel(int8_rtn(w), w):.4f} |")
    for group in (32, 64, 128):
        for asym in (False, True):
            for search in ((False, True) if not asym else (False,)):
                name = f"q4 g{group} {'scale+min' if asym else 'symmetric'}{', searched scale' if search else ''}"
                bits = 4 + (32 if asym else 16) / group
                print(f"| {name} | {bits:.3f} | {rel(q4_variant(w, group, asym, search), w):.4f} |")
    fmt = FORMATS["mxfp4"]
    plain = fmt.dequantize(fmt.quantize(w, search=False), *w.shape)
    print(f"| mxfp4, OCP exponent only (no e+1 search) | 4.250 | {rel(plain, w):.4f} |")


if __name__ == "__main__":
    main()
