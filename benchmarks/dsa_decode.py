"""Decode attention time per token of one DeepSeek sparse attention layer at 4K and 32K positions.

``--model deepseek_v32`` (the default): one ``layers.dsa.SparseMLA`` layer with DeepSeek-V3.2's sizes
(hidden 7168, 128 heads, q_lora_rank 1536, kv_lora_rank 512, rope 64, nope 128, v 128; indexer 64
heads x 128, index_topk 2048), random weights (block FP8 as published, or bf16 with ``--format
bf16``), its latent cache and indexer keys filled with random values for L - 1 positions. One decode
step is ``attn.segments`` of one token at position L - 1 (it writes that position, the indexer scores
all L and keeps 2048, MLA attends over them). Reported per context: the median (and fastest) step
time, the indexer's own share (its keys, queries and selection for the same step, timed alone) and,
for comparison, plain MLA over all L positions (what attention without the selection costs).

``--model glm5_next``: GLM-5.3-Flash's indexed layer (hidden 4096, 64 heads, q_lora_rank 1536,
kv_lora_rank 512, no rope, nope 256, v 256; ``PooledIndexer`` 32 heads x 128 over pools of 16,
index_topk 2048 = 128 pools), bf16 weights (its only format); the indexer's keys of L - 1 positions
and the keys of their complete pools cached (``PooledKeys``), as after decoding to there. Besides
the step and the indexer's share (cached pools: the step at L - 1 completes one pool and computes
its key), the same two with every pool's key recomputed from all L positions' keys (the previous
code's work at every step: ``cache.index.done = 0`` before the step; the indexer alone through
``select`` over the keys tensor), and the pools computed per step (a deterministic count).

The contexts and arms are measured interleaved, each rep in an order rotated by one (so neither
background load nor what ran just before favours an arm); the 1-minute load average is recorded
before and after.

    PYTHONPATH=src python benchmarks/dsa_decode.py [--model deepseek_v32|glm5_next] [--contexts 4096 32768]
        [--reps 7] [--threads 2] [--format fp8|bf16] [--json benchmarks/results/dsa-decode.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import sluice  # noqa: F401  (before torch: it sets OpenMP's wait policy)
import torch

from sluice import kernels
from sluice.layers.dsa import SparseMLA
from sluice.layers.indexer import LightningIndexer, PooledIndexer
from sluice.layers.mla import MLA
from sluice.layers.rotary import Rotary
from sluice.quant import linear
from sluice.quant.fp8 import BlockFP8, quantize as fp8_quantize

SIZES = dict(hidden=7168, heads=128, q_lora=1536, kv_lora=512, rope=64, nope=128, v=128, index_heads=64,
             index_dim=128, topk=2048)
# GLM-5.3-Flash's indexed attention layer (transformers' Glm5NextTextConfig defaults)
GLM5_NEXT_SIZES = dict(hidden=4096, heads=64, q_lora=1536, kv_lora=512, rope=0, nope=256, v=256, index_heads=32,
                       index_dim=128, topk=2048, pool=16)


def _weights(fmt: str):
    def w(gen: torch.Generator, *shape: int, plain: bool = False):
        t = torch.randn(*shape, generator=gen) * shape[-1] ** -0.5
        if fmt == "bf16" or plain:
            return t.to(torch.bfloat16)
        return BlockFP8(*fp8_quantize(t, (128, 128)), (128, 128))

    return w


def build(gen: torch.Generator, fmt: str = "fp8", s: dict = SIZES) -> tuple[SparseMLA, MLA]:
    """The sparse layer and the same MLA without an indexer (sharing the weights): block-FP8 linears as
    the published checkpoint stores them (``weights_proj`` bf16), or every weight bf16."""
    h, r, dr = s["hidden"], s["kv_lora"], s["rope"]
    _w = _weights(fmt)
    mla = dict(wq_a=_w(gen, s["q_lora"], h), q_a_norm=torch.ones(s["q_lora"]),
               wq_b=_w(gen, s["heads"] * (s["nope"] + dr), s["q_lora"]), wkv_a=_w(gen, r + dr, h),
               kv_a_norm=torch.ones(r), wkv_b=_w(gen, s["heads"] * (s["nope"] + s["v"]), r),
               wo=_w(gen, h, s["heads"] * s["v"]), n_heads=s["heads"], kv_lora_rank=r, qk_nope_head_dim=s["nope"],
               qk_rope_head_dim=dr, v_head_dim=s["v"], scale=(s["nope"] + dr) ** -0.5)
    d = s["index_dim"]
    ix = dict(wq_b=_w(gen, s["index_heads"] * d, s["q_lora"]), wk=_w(gen, d, h),
              weights_proj=_w(gen, s["index_heads"], h, plain=True), k_norm_weight=torch.ones(d),
              k_norm_bias=torch.zeros(d), n_heads=s["index_heads"], head_dim=d, topk=s["topk"])
    if "pool" in s:  # GLM-5.3-Flash: pools, no rope
        indexer = PooledIndexer(compress_gate=_w(gen, d, h, plain=True),
                                ape=torch.randn(s["pool"], d, generator=gen), pool=s["pool"], **ix)
    else:
        indexer = LightningIndexer(interleave=False, **ix)
    return SparseMLA(indexer=indexer, **mla), MLA(**mla)


def _seconds(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measure(contexts: list[int], reps: int, fmt: str = "fp8", seed: int = 0, s: dict = SIZES) -> dict:
    gen = torch.Generator().manual_seed(seed)
    sparse, dense = build(gen, fmt, s)
    ix = sparse.indexer
    pooled = isinstance(ix, PooledIndexer)
    rot = Rotary(s["rope"], {"rope_type": "default", "rope_theta": 10000.0}, max(contexts)) if s["rope"] else None
    x = torch.randn(1, s["hidden"], generator=gen)
    steps, counts = {}, {}
    for n in contexts:
        cache = sparse.new_cache(n)
        cache.ckv[: n - 1] = torch.randn(n - 1, s["kv_lora"] + s["rope"], generator=gen)
        cache.index.keys[: n - 1] = torch.randn(n - 1, ix.key_dim, generator=gen)
        if pooled:
            ix.pooled(cache.index, n - 1)  # the complete pools' keys, as decoding to L - 1 leaves them
        plain = dense.new_cache(n)
        plain.ckv[: n - 1] = cache.ckv[: n - 1]
        cos, sin = rot.cos_sin(torch.tensor([n - 1])) if rot is not None else (None, None)

        def step(n=n, cache=cache, cos=cos, sin=sin):
            sparse.segments(x, [(0, 1, n - 1, cache)], cos, sin)

        def indexer(n=n, cache=cache, cos=cos, sin=sin):
            q_resid = sparse.q_a_norm(linear(x, sparse.wq_a))
            k = ix.keys(x, cos, sin)
            q, w = ix.queries(q_resid, x, cos, sin)
            if pooled:  # the step's own write (it drops the pool it completes) and selection over the cache
                cache.index.write(n - 1, k)
                ix.select_cached(q, w, cache.index, n - 1)
            else:
                ix.select(q, w, cache.index.keys[:n], n - 1)

        def full(n=n, plain=plain, cos=cos, sin=sin):
            dense.segments(x, [(0, 1, n - 1, plain)], cos, sin)

        arms = dict(step=step, indexer=indexer, full=full)
        if pooled:
            def step_recompute(cache=cache, step=step):
                cache.index.done = 0  # every pool's key from all positions' keys, as before the cache
                step()

            def indexer_recompute(n=n, cache=cache, cos=cos, sin=sin):
                q_resid = sparse.q_a_norm(linear(x, sparse.wq_a))
                ix.keys(x, cos, sin)
                q, w = ix.queries(q_resid, x, cos, sin)
                ix.select(q, w, cache.index.keys[:n], n - 1)

            arms.update(step_recompute=step_recompute, indexer_recompute=indexer_recompute)
            counts[n] = {name: _pools_computed(ix, arms[name]) for name in ("step", "step_recompute")}
        steps[n] = arms
    out = {n: {k: [] for k in arms} for n, arms in steps.items()}
    for fns in steps.values():  # warm
        for fn in fns.values():
            fn()
    runs = [(n, name) for n in contexts for name in steps[n]]
    for r in range(reps):  # interleaved: each rep measures every context and arm once, the order rotated
        k = r % len(runs)
        for n, name in runs[k:] + runs[:k]:
            out[n][name].append(_seconds(steps[n][name]))
    res = {n: {**{f"{k}_ms": 1e3 * statistics.median(v) for k, v in d.items()},
               **{f"{k}_min_ms": 1e3 * min(v) for k, v in d.items()}} for n, d in out.items()}
    for n, c in counts.items():
        res[n].update({f"{k}_pools_computed": v for k, v in c.items()})
    return res


def _pools_computed(ix: PooledIndexer, fn) -> int:
    """Pool keys ``fn`` computes (``pool_keys`` rows), counted on one call."""
    rows = []
    orig = ix.pool_keys

    def counting(keys):
        out = orig(keys)
        rows.append(out.shape[0])
        return out

    ix.pool_keys = counting
    try:
        fn()
    finally:
        del ix.pool_keys
    return sum(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["deepseek_v32", "glm5_next"], default="deepseek_v32")
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--format", choices=["fp8", "bf16"], default=None, help="fp8 (DeepSeek-V3.2's default) or bf16")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sizes = GLM5_NEXT_SIZES if args.model == "glm5_next" else SIZES
    fmt = args.format or ("bf16" if args.model == "glm5_next" else "fp8")
    if args.model == "glm5_next" and fmt != "bf16":
        ap.error("glm5_next runs bf16 weights only (its quantized checkpoints are not read)")
    torch.set_num_threads(args.threads)
    kernels.set_threads(args.threads)
    load = [os.getloadavg()[0]]
    res = measure(args.contexts, args.reps, fmt, s=sizes)
    load.append(os.getloadavg()[0])
    lo, hi = min(args.contexts), max(args.contexts)
    for n, r in res.items():
        print(f"L={n:6d}: decode step {r['step_ms']:7.1f} ms (indexer {r['indexer_ms']:6.1f} ms, "
              f"{100 * r['indexer_ms'] / r['step_ms']:4.1f}%); plain MLA over all L {r['full_ms']:7.1f} ms")
        if "step_recompute_ms" in r:
            print(f"          pools recomputed every step: decode step {r['step_recompute_ms']:7.1f} ms (indexer "
                  f"{r['indexer_recompute_ms']:6.1f} ms); pools computed per step {r['step_pools_computed']} "
                  f"cached, {r['step_recompute_pools_computed']} recomputed")
    ratio = res[hi]["step_ms"] / res[lo]["step_ms"]
    print(f"step time {hi} / {lo}: {ratio:.2f}x (plain MLA: {res[hi]['full_ms'] / res[lo]['full_ms']:.2f}x; "
          f"of the fastest runs: {res[hi]['step_min_ms'] / res[lo]['step_min_ms']:.2f}x)")
    extra = {}
    if "step_recompute_ms" in res[hi]:
        extra["ratio_recompute"] = res[hi]["step_recompute_ms"] / res[lo]["step_recompute_ms"]
        print(f"step time {hi} / {lo} with every pool recomputed: {extra['ratio_recompute']:.2f}x")
    print(f"1-minute load average: {load[0]:.2f} before, {load[1]:.2f} after")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=args.model, sizes=sizes, format=fmt, threads=args.threads, reps=args.reps,
                           machine=platform.processor() or platform.machine(), kernels=kernels.info().get("isa"),
                           loadavg_1min=load, results=res, ratio=ratio, **extra), f, indent=1)


if __name__ == "__main__":
    main()
