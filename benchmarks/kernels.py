"""Kernel benchmark: memory bandwidth, then each weight format's GEMV (T=1) and prefill (T=64).

Every measurement cycles through enough distinct matrices (>= --pool MiB, far beyond the
last-level cache) that weights come from DRAM, as an expert just read from disk does.
Throughput is bytes of the *stored* format per second; the ratio is to the memory
bandwidth (a 256 MiB sum with the same thread count) measured interleaved with the kernel
passes, so that background load hits both alike. Numbers are medians over --reps passes;
the variants of one format (activation modes, pool schedules, an older build) are
interleaved too.

    PYTHONPATH=src python benchmarks/kernels.py [--threads 1 2] [--reps 7] [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import platform
import statistics
import time

import sluice  # noqa: F401  (before torch: it sets OpenMP's wait policy)
import torch

from sluice import kernels, quant
from sluice.quant import FORMATS, QuantMatrix

SHAPES = [(768, 2048), (2048, 768), (1408, 2048), (14336, 4096)]


def random_parts(fmt, n: int, k: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random stored parts with realistic magnitudes (kernel speed does not depend on values)."""
    out = {}
    for name, (dtype, shape) in fmt.parts(n, k).items():
        if dtype in (torch.uint8, torch.int8):
            t = torch.randint(0, 256, shape, generator=gen, dtype=torch.int32).to(torch.uint8)
            if name == "scales":  # e8m0 around 2^-6
                t = torch.randint(118, 124, shape, generator=gen, dtype=torch.int32).to(torch.uint8)
            out[name] = t.view(dtype) if dtype == torch.int8 else t
        elif name == "weight":
            out[name] = torch.randn(shape, generator=gen).to(dtype)
        else:
            out[name] = (torch.rand(shape, generator=gen) * 0.02 + 0.01).to(dtype)
    return out


def bandwidth(threads: int, reps: int) -> dict:
    torch.set_num_threads(threads)
    kernels.set_threads(threads)
    a = torch.ones(256 << 20, dtype=torch.float32)  # 1 GiB
    b = torch.empty_like(a)
    sums, copies, pool_sums = [], [], []
    for _ in range(reps):
        t = time.perf_counter()
        a.sum()
        sums.append(a.numel() * 4 / (time.perf_counter() - t) / 1e9)
        t = time.perf_counter()
        kernels.bench_sum(a)
        pool_sums.append(a.numel() * 4 / (time.perf_counter() - t) / 1e9)
        t = time.perf_counter()
        b.copy_(a)
        copies.append(2 * a.numel() * 4 / (time.perf_counter() - t) / 1e9)
    del a, b
    return {"sum_GBps": statistics.median(sums), "pool_sum_GBps": statistics.median(pool_sums),
            "copy_GBps": statistics.median(copies)}


def make_pool(fmt_name: str, n: int, k: int, pool_bytes: int, seed: int = 0) -> list:
    fmt = FORMATS[fmt_name]
    gen = torch.Generator().manual_seed(seed)
    count = max(2, -(-pool_bytes // fmt.nbytes(n, k)))
    return [QuantMatrix(fmt, random_parts(fmt, n, k, gen), n, k) for _ in range(count)]


def time_pool(pool: list, x: torch.Tensor) -> float:
    """Seconds per matrix for one pass over the pool."""
    t = time.perf_counter()
    for m in pool:
        m.matmul(x)
    return (time.perf_counter() - t) / len(pool)


_BW_ARRAY: torch.Tensor | None = None


def _bandwidth_pass() -> float:
    """One large sum (256 MiB) between kernel passes, on the kernels' own thread pool (torch's
    OpenMP sum collapses when the machine is oversubscribed): GB/s under the same load."""
    global _BW_ARRAY
    if _BW_ARRAY is None:
        _BW_ARRAY = torch.ones(64 << 20, dtype=torch.float32)
    t = time.perf_counter()
    kernels.bench_sum(_BW_ARRAY)
    return _BW_ARRAY.numel() * 4 / (time.perf_counter() - t) / 1e9


def measure(variants: dict, x: torch.Tensor, reps: int) -> tuple[dict[str, float], float]:
    """variants: label -> (pool, setup callable). Interleaved passes (with a bandwidth pass in
    each round); median seconds per matrix of each variant, and median bandwidth GB/s."""
    times: dict[str, list[float]] = {label: [] for label in variants}
    bw = []
    for pool, setup in variants.values():  # warm-up
        setup()
        time_pool(pool[:2], x)
    for _ in range(reps):
        bw.append(_bandwidth_pass())
        for label, (pool, setup) in variants.items():
            setup()
            times[label].append(time_pool(pool, x))
    quant.set_activations(None)
    kernels.set_schedule(True)
    kernels.set_isa_cap(max(kernels.ISA_LEVELS))
    return {label: statistics.median(v) for label, v in times.items()}, statistics.median(bw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--pool", type=int, default=256, help="MiB of distinct matrices cycled through")
    ap.add_argument("--formats", nargs="+", default=["bf16", "int8", "q4", "mxfp4", "rvq3"])
    ap.add_argument("--shapes", nargs="+", default=[f"{n}x{k}" for n, k in SHAPES])
    ap.add_argument("--prefill-tokens", type=int, default=64)
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--schedules", action="store_true", help="bf16 at 2+ threads: dynamic vs static pool schedule")
    ap.add_argument("--isa", action="store_true",
                    help="also time each format on the AVX2 path (default activations) beside the host's widest")
    ap.add_argument("--baseline-so", help="an older build of the C kernels, to compare its bf16 GEMV side by side")
    ap.add_argument("--hot", action="store_true",
                    help="instead: one thread, one cache-resident matrix, CPU time (the kernels' compute"
                         " throughput, insensitive to other processes)")
    ap.add_argument("--json", help="write all results here")
    args = ap.parse_args()
    if args.hot:
        return hot(args)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    info = {"machine": platform.machine(), "processor": _cpu_name(), "kernels": kernels.info(),
            "torch": torch.__version__, "cpus": torch.get_num_threads()}
    print(json.dumps(info))
    results: dict = {"info": info, "bandwidth": {}, "gemv": [], "prefill": []}
    baseline = _load_baseline(args.baseline_so) if args.baseline_so else None

    for th in args.threads:
        results["bandwidth"][th] = bw = bandwidth(th, args.reps)
        print(f"threads={th} memory bandwidth: torch sum {bw['sum_GBps']:.1f} GB/s, kernel-pool sum "
              f"{bw['pool_sum_GBps']:.1f} GB/s, torch copy (read+write) {bw['copy_GBps']:.1f} GB/s")

    for th in args.threads:
        kernels.set_threads(th)
        torch.set_num_threads(th)
        for n, k in shapes:
            x = torch.randn(1, k)
            for name in args.formats:
                pool = make_pool(name, n, k, args.pool << 20)
                nb = FORMATS[name].nbytes(n, k)
                top = max(kernels.ISA_LEVELS)
                variants = {"": (pool, lambda: kernels.set_isa_cap(top))}
                if name in ("int8", "q4", "mxfp4"):
                    variants = {"f32": (pool, lambda: (quant.set_activations("f32"), kernels.set_isa_cap(top))),
                                "q8": (pool, lambda: (quant.set_activations("q8"), kernels.set_isa_cap(top)))}
                if args.isa and len(kernels.isa_levels()) > 1:  # the same bits on the AVX2 path, side by side
                    variants["avx2"] = (pool, lambda: (quant.set_activations(None), kernels.set_isa_cap(1)))
                if name == "bf16" and th > 1 and args.schedules:
                    variants = {"dynamic": (pool, lambda: kernels.set_schedule(True)),
                                "static": (pool, lambda: kernels.set_schedule(False))}
                if name == "bf16" and baseline is not None:
                    variants["baseline"] = ([_BaselineMatrix(baseline, m, th) for m in pool], lambda: None)
                secs, bw_now = measure(variants, x, args.reps)
                for label, s in secs.items():
                    gbps = nb / s / 1e9
                    row = {"threads": th, "shape": f"{n}x{k}", "format": name, "variant": label or "default",
                           "us": s * 1e6, "GBps": gbps, "bandwidth_GBps": bw_now, "ratio": gbps / bw_now}
                    results["gemv"].append(row)
                    print(f"gemv  threads={th} {n:5d}x{k:<5d} {name:6s} {label or '':8s} {s * 1e6:9.1f} us"
                          f" {gbps:6.2f} GB/s  bandwidth {bw_now:5.1f} GB/s  ratio {gbps / bw_now:5.2f}")
                del pool
            if args.no_prefill:
                continue
            x = torch.randn(args.prefill_tokens, k)
            for name in args.formats:
                pool = make_pool(name, n, k, args.pool << 20)
                nb = FORMATS[name].nbytes(n, k)
                s = measure({"": (pool, lambda: None)}, x, max(3, args.reps // 2))[0][""]
                row = {"threads": th, "shape": f"{n}x{k}", "format": name, "T": args.prefill_tokens, "us": s * 1e6,
                       "GBps": nb / s / 1e9, "GFLOPs": 2 * args.prefill_tokens * n * k / s / 1e9}
                results["prefill"].append(row)
                print(f"prefill threads={th} T={args.prefill_tokens} {n:5d}x{k:<5d} {name:6s} {s * 1e6:9.1f} us"
                      f" {row['GBps']:6.2f} GB/s  {row['GFLOPs']:6.1f} GFLOP/s")
                del pool
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def hot(args) -> None:
    """Compute throughput: thread CPU time per GEMV on one cache-resident matrix, one thread."""
    kernels.set_threads(1)
    torch.set_num_threads(1)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    gen = torch.Generator().manual_seed(0)
    for n, k in shapes:
        if n * k > (4 << 20):
            continue  # not cache resident
        for name in args.formats:
            fmt = FORMATS[name]
            m = QuantMatrix(fmt, random_parts(fmt, n, k, gen), n, k)
            levels = [max(kernels.isa_levels() or [1])] + ([1] if args.isa and len(kernels.isa_levels()) > 1 else [])
            for mode in (("f32", "q8") if name in ("int8", "q4", "mxfp4") else (None,)):
                quant.set_activations(mode)
                for t in (1, 8):
                    x = torch.randn(t, k)
                    reps = 20
                    samples = {lv: [] for lv in levels}
                    for _ in range(args.reps):  # the levels interleaved
                        for lv in levels:
                            kernels.set_isa_cap(lv)
                            c = time.thread_time()
                            for _ in range(reps):
                                m.matmul(x)
                            samples[lv].append((time.thread_time() - c) / reps)
                    for lv in levels:
                        s = statistics.median(samples[lv])
                        print(f"hot {n:5d}x{k:<5d} {name:6s} {mode or '':4s} {kernels.ISA_LEVELS[lv]:11s} T={t}"
                              f"  {s * 1e6:8.1f} us CPU  {fmt.nbytes(n, k) * t / s / 1e9:6.2f} GB/s x tokens"
                              f"  {n * k * t / s / 1e9:6.1f} Gweights/s")
            quant.set_activations(None)
            kernels.set_isa_cap(max(kernels.ISA_LEVELS))


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _load_baseline(path: str):
    lib = ctypes.CDLL(path)
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.sk_dense.argtypes = [p, p, p, p, i, i, i, i, i]
    lib.sk_set_threads.argtypes = [i]
    lib.sk_set_threads.restype = i
    return lib


class _BaselineMatrix:
    """A bf16 matrix multiplied by an older build of sk_dense."""

    def __init__(self, lib, m: QuantMatrix, threads: int):
        self.lib, self.w, self.threads = lib, m.parts["weight"], threads
        lib.sk_set_threads(threads)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        t, k = x.shape
        n = self.w.shape[0]
        y = torch.empty(t, n)
        self.lib.sk_dense(x.data_ptr(), self.w.data_ptr(), None, y.data_ptr(), t, n, k, 1, self.threads)
        return y


if __name__ == "__main__":
    main()
