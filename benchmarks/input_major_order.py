"""Input-major experts (GPT-OSS): what one summation order for both layouts costs.

Decode (T=1): one expert matrix through the output-major kernel the container used before
(``sk_dense``), the chain kernel it uses now (``sk_dense_chain``, the input-major order) and
the input-major kernel of the Hugging Face directory (``sk_dense_t``, unchanged). Prefill
(T=64, more than ``CHAIN_BATCH`` tokens on one expert): gate and up of one expert through the
container's and the directory's paths, before (``linear`` / ``linear_t``) and now
(``linear_chain``, which copies the directory's input-major slice to [out, in] first).

Every pass cycles through --pool distinct matrices so that weights come from DRAM; the
variants are interleaved and the best of --reps passes is kept. With one thread (the
default) the clock is the thread's CPU time, so that time the scheduler gives to other
processes on a shared machine is not counted (cache and memory contention still are).

    PYTHONPATH=src python benchmarks/input_major_order.py [--threads 1] [--reps 40] [--dim 2880]
"""

from __future__ import annotations

import argparse
import time

import sluice  # noqa: F401  (before torch: it sets OpenMP's wait policy)
import torch

from sluice import kernels
from sluice.quant import linear, linear_chain, linear_t
from sluice.quant.assembly import _gate_up


def best(variants: dict, pool: int, reps: int, clock=time.perf_counter) -> dict:
    out = {k: float("inf") for k in variants}
    for _ in range(reps):
        for name, f in variants.items():
            t = clock()
            for i in range(pool):
                f(i)
            out[name] = min(out[name], (clock() - t) / pool)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--dim", type=int, default=2880, help="H = I (GPT-OSS-20B: 2880)")
    ap.add_argument("--pool", type=int, default=16)
    args = ap.parse_args()
    kernels.set_threads(args.threads)
    torch.set_num_threads(args.threads)
    h = i = args.dim
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    print(f"dim {h}, {args.threads} thread(s), best of {args.reps} ({clock.__name__}); "
          "ms per matrix (decode) / per expert gate+up (prefill)")
    for dtype in (torch.bfloat16, torch.float32):
        om = [torch.randn(i, h).to(dtype) for _ in range(args.pool)]
        im = [w.t().contiguous() for w in om]
        x = torch.randn(1, h)
        r = best({"container before (sk_dense)": lambda j: kernels.dense(x, om[j]),
                  "container now (sk_dense_chain)": lambda j: kernels.dense_chain(x, om[j]),
                  "directory (sk_dense_t)": lambda j: kernels.dense_t(x, im[j])}, args.pool, args.reps, clock)
        base = r["container before (sk_dense)"]
        cells = ", ".join(f"{k} {v * 1e3:.3f} ({v / base:.2f}x)" for k, v in r.items())
        print(f"decode T=1 {str(dtype)[6:]}: " + cells)
        gu = [torch.randn(h, 2 * i).to(dtype) for _ in range(max(2, args.pool // 2))]
        gates = [g[:, 0::2].t().contiguous() for g in gu]
        ups = [g[:, 1::2].t().contiguous() for g in gu]
        x = torch.randn(64, h)
        r = best({"container before": lambda j: (linear(x, gates[j]), linear(x, ups[j])),
                  "container now": lambda j: (linear_chain(x, gates[j]), linear_chain(x, ups[j])),
                  "directory before": lambda j: linear_t(x, gu[j]),
                  "directory now": lambda j: _gate_up({"gate_up_t": gu[j]}, True)(x)}, len(gu), max(3, args.reps // 8),
                 clock)
        print(f"prefill T=64 {str(dtype)[6:]}: " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in r.items()))


if __name__ == "__main__":
    main()
