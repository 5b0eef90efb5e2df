"""Decode attention time per token of one DeepSeek sparse attention layer at 4K and 32K positions.

One ``layers.dsa.SparseMLA`` layer with DeepSeek-V3.2's sizes (hidden 7168, 128 heads, q_lora_rank
1536, kv_lora_rank 512, rope 64, nope 128, v 128; indexer 64 heads x 128, index_topk 2048), random
weights (block FP8 as published, or bf16 with ``--format bf16``), its latent cache and indexer keys
filled with random values for L - 1 positions. One decode step is ``attn.segments`` of one token at
position L - 1 (it writes that position, the indexer scores all L and keeps 2048, MLA attends over
them). Reported per context: the median step time, the indexer's own share (its keys, queries and
selection for the same step, timed alone) and, for comparison, plain MLA over all L positions (what
attention without the selection costs). The contexts are measured interleaved, so background load hits them alike.

    PYTHONPATH=src python benchmarks/dsa_decode.py [--contexts 4096 32768] [--reps 7] [--threads 2]
        [--format fp8|bf16] [--json benchmarks/results/dsa-decode.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import sluice  # noqa: F401  (before torch: it sets OpenMP's wait policy)
import torch

from sluice import kernels
from sluice.layers.dsa import SparseMLA
from sluice.layers.indexer import LightningIndexer
from sluice.layers.mla import MLA
from sluice.layers.rotary import Rotary
from sluice.quant import linear
from sluice.quant.fp8 import BlockFP8, quantize as fp8_quantize

SIZES = dict(hidden=7168, heads=128, q_lora=1536, kv_lora=512, rope=64, nope=128, v=128, index_heads=64,
             index_dim=128, topk=2048)


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
    indexer = LightningIndexer(wq_b=_w(gen, s["index_heads"] * d, s["q_lora"]), wk=_w(gen, d, h),
                               weights_proj=_w(gen, s["index_heads"], h, plain=True), k_norm_weight=torch.ones(d),
                               k_norm_bias=torch.zeros(d), n_heads=s["index_heads"], head_dim=d, topk=s["topk"],
                               interleave=False)
    return SparseMLA(indexer=indexer, **mla), MLA(**mla)


def _seconds(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measure(contexts: list[int], reps: int, fmt: str = "fp8", seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    sparse, dense = build(gen, fmt)
    s = SIZES
    rot = Rotary(s["rope"], {"rope_type": "default", "rope_theta": 10000.0}, max(contexts))
    x = torch.randn(1, s["hidden"], generator=gen)
    steps = {}
    for n in contexts:
        cache = sparse.new_cache(n)
        cache.ckv[: n - 1] = torch.randn(n - 1, s["kv_lora"] + s["rope"], generator=gen)
        cache.index.keys[: n - 1] = torch.randn(n - 1, s["index_dim"], generator=gen)
        plain = dense.new_cache(n)
        plain.ckv[: n - 1] = cache.ckv[: n - 1]
        cos, sin = rot.cos_sin(torch.tensor([n - 1]))
        ix = sparse.indexer

        def step(n=n, cache=cache, cos=cos, sin=sin):
            sparse.segments(x, [(0, 1, n - 1, cache)], cos, sin)

        def indexer(n=n, cache=cache, cos=cos, sin=sin):
            q_resid = sparse.q_a_norm(linear(x, sparse.wq_a))
            ix.keys(x, cos, sin)
            q, w = ix.queries(q_resid, x, cos, sin)
            ix.select(q, w, cache.index.keys[:n], n - 1)

        def full(n=n, plain=plain, cos=cos, sin=sin):
            dense.segments(x, [(0, 1, n - 1, plain)], cos, sin)

        steps[n] = dict(step=step, indexer=indexer, full=full)
    out = {n: {k: [] for k in ("step", "indexer", "full")} for n in contexts}
    for fns in steps.values():  # warm
        for fn in fns.values():
            fn()
    for _ in range(reps):  # interleaved: each rep measures every context once
        for n in contexts:
            for name, fn in steps[n].items():
                out[n][name].append(_seconds(fn))
    return {n: {f"{k}_ms": 1e3 * statistics.median(v) for k, v in d.items()} for n, d in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--format", choices=["fp8", "bf16"], default="fp8")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kernels.set_threads(args.threads)
    res = measure(args.contexts, args.reps, args.format)
    lo, hi = min(args.contexts), max(args.contexts)
    for n, r in res.items():
        print(f"L={n:6d}: decode step {r['step_ms']:7.1f} ms (indexer {r['indexer_ms']:6.1f} ms, "
              f"{100 * r['indexer_ms'] / r['step_ms']:4.1f}%); plain MLA over all L {r['full_ms']:7.1f} ms")
    ratio = res[hi]["step_ms"] / res[lo]["step_ms"]
    print(f"step time {hi} / {lo}: {ratio:.2f}x (plain MLA: {res[hi]['full_ms'] / res[lo]['full_ms']:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(sizes=SIZES, format=args.format, threads=args.threads, reps=args.reps,
                           machine=platform.processor() or platform.machine(), kernels=kernels.info().get("isa"),
                           results=res, ratio=ratio), f, indent=1)


if __name__ == "__main__":
    main()
