"""Two builds of the C kernels side by side in one process, on one decode token's shapes.

    python setup.py build_ext --inplace            # in each source tree (old and new)
    PYTHONPATH=src python benchmarks/kernel_ab.py OLD/src/sluice/_kernels*.so NEW/src/sluice/_kernels*.so \\
        [--threads 1 2] [--rounds 5] [--isa 1] [--cases up,down,head,qo,kv,swiglu,up32,attn512,attn4096,sum]

Each library is loaded with ctypes from a private copy (so one file can be compared with
itself: an A/A run shows the noise) and called directly, without the Python wrappers. The
shapes are the 2 GB bf16 Mixtral shape of ``warm_vs_llamacpp.py`` (hidden 1024, intermediate
3584, 16 query / 4 key-value heads of 64, vocab 32000): the expert GEMVs (``up``, ``down``,
bf16; ``up32`` in f32), the attention projections (``qo``, ``kv``), the head, the fused SwiGLU
expert, attention over L cached positions (``attnL``) and the plain read (``sum``, an fp32 sum
of the whole buffer). Weights cycle through a ``--pool`` MiB buffer (1 GiB: from DRAM, as in a
warm decode). Before timing, every case runs once in each build on the same operands and the
outputs are compared bit for bit (``same=``; the exit status is 1 if any differ): a kernel
change that moves a bit shows here. Each round times every build for ``--calls`` seconds per
case, in alternating order (AB, BA, ...); GB/s are medians, ``ratio`` the median of the
per-round ratios to the first build. ``--isa 1`` caps both at AVX2.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import sluice  # noqa: F401  (before torch: it sets OpenMP's wait policy)
import torch
from sluice.synthetic import MIXTRAL_CONFIG as SHAPE  # the shape of decode_kernels.py and warm_vs_llamacpp.py

H, INTER, V = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["vocab_size"]
HQ, HKV, D = SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"], SHAPE["head_dim"]
QD, KVD = HQ * D, HKV * D
WT_F32, WT_BF16 = 0, 1


def load(path: str, tmp: Path, n: int, threads: int, isa: int) -> ctypes.CDLL:
    copy = tmp / f"lib{n}.so"
    shutil.copy(path, copy)
    lib = ctypes.CDLL(str(copy))
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.sk_dense.argtypes = [p, p, p, p, i, i, i, i, i]
    lib.sk_swiglu.argtypes = [p, p, p, p, p, p, i, i, i, ctypes.c_float, i]
    lib.sk_bench_sum.argtypes = [p, ctypes.c_size_t, i]
    lib.sk_bench_sum.restype = ctypes.c_float
    lib.sk_attend.argtypes = [p] * 5 + [i] * 7 + [ctypes.c_float, p, i]
    lib.sk_attend.restype = None
    lib.sk_set_threads(threads)
    lib.sk_set_isa_cap(isa)
    return lib


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("libs", nargs="+", help="kernel libraries (_kernels*.so) to compare; the first is the base")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--isa", type=int, default=-1, help="cap the level (1 = AVX2, 2 = AVX-512F); default the CPU's")
    ap.add_argument("--cases", default="up,down,head,qo,kv,swiglu,up32,attn512,attn4096,sum")
    ap.add_argument("--calls", type=float, default=0.15, help="seconds per case, build and round")
    ap.add_argument("--pool", type=int, default=1024, help="MiB of operands cycled through (1 GiB: beyond the LLC)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    if len(a.libs) < 2:
        ap.error("give at least two libraries (the same one twice is an A/A run)")
    tmp = Path(tempfile.mkdtemp(prefix="kernel-ab-"))
    try:
        libs = [load(path, tmp, n, max(a.threads), a.isa) for n, path in enumerate(a.libs)]
        return run(a, libs)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(a, libs) -> int:
    nbytes = a.pool << 20
    gen = torch.Generator().manual_seed(0)
    f32 = torch.empty(nbytes // 4).normal_(0, 0.05, generator=gen)
    bf = f32[: nbytes // 2].to(torch.bfloat16)
    xh, xi = torch.randn(1, H, generator=gen), torch.randn(1, INTER, generator=gen)

    def operands(buf, n):
        if buf.numel() < 2 * n:
            raise SystemExit(f"--pool {a.pool} MiB holds fewer than two operands of {n} values: give a larger pool")
        return [buf[c * n : (c + 1) * n] for c in range(buf.numel() // n)]

    def dense(n, k, wt):
        x, buf, es = (xh if k == H else xi), (f32 if wt == WT_F32 else bf), (4 if wt == WT_F32 else 2)

        def call(lib, m, y, th):
            lib.sk_dense(x.data_ptr(), m.data_ptr(), None, y.data_ptr(), 1, n, k, wt, th)

        return operands(buf, n * k), call, n * k * es, n

    def swiglu():
        scratch = torch.empty(2 * INTER)

        def call(lib, m, y, th):
            b = m.data_ptr()
            lib.sk_swiglu(xh.data_ptr(), b, b + 2 * INTER * H, b + 4 * INTER * H, scratch.data_ptr(), y.data_ptr(),
                          H, INTER, WT_BF16, 0.5, th)

        return operands(bf, 3 * INTER * H), call, 3 * INTER * H * 2, H

    def attend(length):
        n = HKV * length * D
        q = torch.randn(1, HQ, D, generator=gen)
        strides = (ctypes.c_long * 8)(HQ * D, D, length * D, D, length * D, D, HQ * D, D)

        def call(lib, m, y, th):
            b = m.data_ptr()
            lib.sk_attend(q.data_ptr(), b, b + 4 * n, None, y.data_ptr(), 1, HQ, HKV, D, D, length - 1, 0, D**-0.5,
                          strides, th)

        return operands(f32, 2 * n), call, 2 * n * 4, HQ * D

    def plain():
        def call(lib, m, y, th):
            y[0] = lib.sk_bench_sum(f32.data_ptr(), f32.numel(), th)

        return [None, None], call, nbytes, 1

    cases = {"up": lambda: dense(INTER, H, WT_BF16), "down": lambda: dense(H, INTER, WT_BF16),
             "head": lambda: dense(V, H, WT_BF16), "qo": lambda: dense(QD, H, WT_BF16),
             "kv": lambda: dense(KVD, H, WT_BF16), "up32": lambda: dense(INTER, H, WT_F32), "swiglu": swiglu,
             "sum": plain}
    rows = []
    for th in a.threads:
        for name in a.cases.split(","):
            if name.startswith("attn") and name[4:].isdigit():
                ops, call, size, ny = attend(int(name[4:]))
            elif name in cases:
                ops, call, size, ny = cases[name]()
            else:
                print(f"unknown case {name!r}", file=sys.stderr)
                return 2
            outs = []
            for lib in libs:
                y = torch.zeros(ny)
                call(lib, ops[1], y, th)
                outs.append(y)
            same = all(torch.equal(outs[0], y) for y in outs[1:])
            gbs: list[list[float]] = [[] for _ in libs]
            for r in range(a.rounds):
                order = range(len(libs)) if r % 2 == 0 else reversed(range(len(libs)))
                for j in order:
                    y, c, t0 = torch.empty(ny), 0, time.perf_counter()
                    while c < 3 or time.perf_counter() - t0 < a.calls:
                        call(libs[j], ops[c % len(ops)], y, th)
                        c += 1
                    gbs[j].append(size * c / (time.perf_counter() - t0) / 1e9)
            med = [statistics.median(g) for g in gbs]
            ratio = [statistics.median(g[r] / gbs[0][r] for r in range(a.rounds)) for g in gbs]
            rows.append({"threads": th, "case": name, "same_bits": same, "gb_s": med, "ratio": ratio})
            print(f"threads={th} {name:9s} same={same} " + " ".join(f"{m:6.2f} GB/s" for m in med)
                  + "  ratio " + " ".join(f"{x:.3f}" for x in ratio[1:]), flush=True)
    load = os.getloadavg()[0]
    print(f"1-minute load {load:.1f}")
    if a.json:
        a.json.write_text(json.dumps({"libs": a.libs, "isa": a.isa, "rounds": a.rounds, "load": load, "rows": rows},
                                     indent=1))
    return 0 if all(r["same_bits"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
