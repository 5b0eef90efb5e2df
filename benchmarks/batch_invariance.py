"""Cost of batch-invariant kernels against the fastest non-invariant paths.

Two parts, each alternating the two modes (``sluice.kernels.set_batch_invariant``) pass by
pass so that background load hits both alike; numbers are medians, ratios are fast / invariant
time (above 1: the invariant path is slower by that factor).

- GEMM: ``quant.linear`` x [T, K] @ W [N, K]^T for f32 and bf16 weights at T = 1, 8, 32,
  128, 512 (invariant: the tiled C kernel at every T; fast: the C kernel up to 8 / 32 rows,
  then sgemm), and causal attention over T queries (C kernel vs torch matmul + softmax).
- Model: a synthetic Qwen3-MoE checkpoint (``sluice.synthetic``, ~0.75 GB bf16) held in RAM;
  prefill tokens/s of a fresh prompt and decode tokens/s, per mode.

    PYTHONPATH=src python benchmarks/batch_invariance.py [--reps 5] [--size 0.75G] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import sluice  # noqa: F401  (before torch: it sets OpenMP's wait policy)
import torch

from sluice import kernels
from sluice.layers.attention import attend
from sluice.quant import linear
from sluice.synthetic import DEMO_CONFIG, scaled_config, write_model
from sluice.units import parse_size

MODES = {"invariant": True, "fast": False}


def timed(fn, min_s: float = 0.2) -> float:
    """Seconds per call (repeated until min_s has passed)."""
    fn()
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        dt = time.perf_counter() - t0
        if dt >= min_s:
            return dt / n


def gemm(reps: int, n: int, k: int) -> list[dict]:
    rows = []
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        w = (torch.randn(n, k, generator=g) * 0.02).to(dtype)
        for t in (1, 8, 32, 128, 512):
            x = torch.randn(t, k, generator=g)
            times = {m: [] for m in MODES}
            for r in range(reps):
                for m in (MODES if r % 2 == 0 else reversed(list(MODES))):
                    kernels.set_batch_invariant(MODES[m])
                    times[m].append(timed(lambda: linear(x, w)))
            rows.append(_row(f"linear {str(dtype).split('.')[-1]} {n}x{k}", t, times, 2 * t * n * k))
    return rows


def attention(reps: int) -> list[dict]:
    rows = []
    g = torch.Generator().manual_seed(1)
    hq, hkv, d = 16, 4, 64
    for t, start in ((1, 511), (32, 480), (512, 0)):
        q = torch.randn(t, hq, d, generator=g)
        k = torch.randn(hkv, start + t, d, generator=g)
        v = torch.randn(hkv, start + t, d, generator=g)
        times = {m: [] for m in MODES}
        for r in range(reps):
            for m in (MODES if r % 2 == 0 else reversed(list(MODES))):
                kernels.set_batch_invariant(MODES[m])
                times[m].append(timed(lambda: attend(q, k, v, start, d**-0.5)))
        rows.append(_row(f"attention 16q/4kv heads x {d}, keys {start}+T", t, times, None))
    return rows


def _row(what: str, t: int, times: dict, flops: int | None) -> dict:
    med = {m: statistics.median(v) for m, v in times.items()}
    row = {"what": what, "T": t, "invariant_ms": med["invariant"] * 1e3, "fast_ms": med["fast"] * 1e3,
           "ratio": med["invariant"] / med["fast"]}
    if flops:
        row["invariant_gflops"] = flops / med["invariant"] / 1e9
        row["fast_gflops"] = flops / med["fast"] / 1e9
    print(f"{what:40s} T={t:4d}  invariant {row['invariant_ms']:8.3f} ms  fast {row['fast_ms']:8.3f} ms  "
          f"ratio {row['ratio']:.2f}", flush=True)
    return row


def model(reps: int, size: float, prompt: int, new: int, path: Path | None) -> list[dict]:
    tmp = None
    if path is None or not (path / "config.json").exists():
        if path is None:
            tmp = tempfile.TemporaryDirectory()
            path = Path(tmp.name) / "model"
        write_model(path, scaled_config(size, DEMO_CONFIG), dtype=torch.bfloat16, progress=False, tokenizer=False)
    vocab = DEMO_CONFIG["vocab_size"]
    out = {m: {"prefill": [], "decode": []} for m in MODES}
    with sluice.load(path, memory=int(size * 3), progress=False) as eng:
        g = torch.Generator().manual_seed(2)
        warm = torch.randint(2, vocab, (prompt,), generator=g).tolist()
        eng.generate(warm, max_new_tokens=new, ignore_eos=True)  # every expert read once
        for r in range(reps):
            ids = torch.randint(2, vocab, (prompt,), generator=g).tolist()
            for m in (MODES if r % 2 == 0 else reversed(list(MODES))):
                kernels.set_batch_invariant(MODES[m])
                ids[0] = 2 + (ids[0] + 1) % (vocab - 2)  # a fresh prompt: no prefix reuse
                st = eng.generate(ids, max_new_tokens=new, ignore_eos=True, speculate=False).stats
                out[m]["prefill"].append(st["prefill_tok_s"])
                out[m]["decode"].append(st["decode_tok_s"])
    kernels.set_batch_invariant(True)
    if tmp is not None:
        tmp.cleanup()
    rows = []
    for phase in ("prefill", "decode"):
        med = {m: statistics.median(out[m][phase]) for m in MODES}
        rows.append({"what": f"model {phase} tok/s", "invariant": med["invariant"], "fast": med["fast"],
                     "ratio": med["fast"] / med["invariant"]})
        print(f"model {phase:8s} tok/s: invariant {med['invariant']:8.1f}  fast {med['fast']:8.1f}  "
              f"ratio {med['fast'] / med['invariant']:.2f}", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--shape", type=int, nargs=2, default=(2048, 2048), metavar=("N", "K"))
    ap.add_argument("--size", default="0.75G", help="synthetic model size (bf16)")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--model-dir", type=Path, help="keep the synthetic model here (reused when present)")
    ap.add_argument("--skip-model", action="store_true")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    print(f"threads {kernels.info()['threads']}, C kernels {kernels.info()}", flush=True)
    rows = gemm(a.reps, *a.shape) + attention(a.reps)
    if not a.skip_model:
        rows += model(a.reps, parse_size(a.size), a.prompt, a.new, a.model_dir)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
