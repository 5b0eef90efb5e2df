"""Micro-benchmark behind a profile finding: torch's ``index_add_`` (the prefill fold in
``ExpertProvider.moe``) right after a call into Sluice's C kernel pool.

    PYTHONPATH=src python benchmarks/fold_stall.py

Prints the time of one small ``index_add_`` ([32, 1024] fp32, two rows) alone, and right after
a ``sluice.kernels.dense`` call with torch at 1 and at 2 threads.
"""

from __future__ import annotations

import time

import sluice  # noqa: F401  (before torch: it sets OpenMP's wait policy)
import torch

from sluice import kernels


def main() -> None:
    acc, y, idx = torch.zeros(32, 1024), torch.randn(2, 1024), torch.tensor([3, 17])
    w, x = torch.randn(7168, 1024).to(torch.bfloat16), torch.randn(2, 1024)
    kernels.set_threads(2)
    for threads in (2, 1):
        torch.set_num_threads(threads)
        for _ in range(5):
            acc.index_add_(0, idx, y)
        t = time.perf_counter()
        for _ in range(200):
            acc.index_add_(0, idx, y)
        alone = (time.perf_counter() - t) / 200
        spent = 0.0
        for _ in range(50):
            kernels.dense(x, w)
            t = time.perf_counter()
            acc.index_add_(0, idx, y)
            spent += time.perf_counter() - t
        print(f"torch threads {threads}: index_add_ alone {alone * 1e6:.1f} us, "
              f"right after kernels.dense {spent / 50 * 1e6:.1f} us")


if __name__ == "__main__":
    main()
