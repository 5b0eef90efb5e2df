"""``sluice bench``: measurements that put numbers beside their physical limits.

- ``io``: raw random-read bandwidth of this disk at the expert record size (same reader
  threads, same O_DIRECT path) measured in the same run as a cold decode with a small
  cache; reports the decode speed as a ratio to that I/O roofline and the time split.
- ``lossy``: greedy agreement and logit divergence of a lossy routing setting against the
  exact output, beside the speedup, in one process.
- ``spec``: decode speed with and without n-gram speculation, tokens per forward.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from .engine import load
from .errors import SluiceError
from .storage import AlignedBuffer


def raw_read_bandwidth(engine, seconds: float = 3.0, threads: int | None = None, seed: int = 0,
                       huge_pages: bool | None = None) -> dict:
    """Random expert-record reads through the engine's own read path (no cache), bytes/s."""
    src = engine.experts_source
    keys = [(layer, e) for layer in engine.desc.moe_layers for e in range(engine.desc.n_experts)]
    rng = random.Random(seed)
    threads = threads or engine.options.reader_threads
    huge = engine.options.huge_pages if huge_pages is None else huge_pages
    bufs = [AlignedBuffer(src.slot_bytes, huge=huge) for _ in range(threads)]
    before = engine.checkpoint.stats.bytes_read
    deadline = time.perf_counter() + seconds
    count = [0] * threads

    def worker(i):
        r = random.Random(rng.random() + i)
        while time.perf_counter() < deadline:
            layer, e = keys[r.randrange(len(keys))]
            src.read(layer, e, bufs[i])
            count[i] += 1

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(worker, range(threads)))
    dt = time.perf_counter() - t0
    nbytes = engine.checkpoint.stats.bytes_read - before
    return {"bytes_per_s": nbytes / dt, "reads": sum(count), "record_bytes": nbytes / max(1, sum(count)),
            "threads": threads, "seconds": dt, "direct_io": src.direct_io}


def drop_cache(engine) -> None:
    """Empty the expert cache (a cold start for the next measurement)."""
    cache = engine.cache
    if cache is None:
        raise SluiceError("sluice bench measures the expert cache of this process; with --ray the experts are on "
                          "the workers (benchmarks/scale_out.py measures those)")
    engine.experts.drain()
    for key in list(cache.keys()):
        cache.discard(cache.lookup(key))


def bench_io(path, memory=None, prompt_tokens: int = 32, new_tokens: int = 32, read_seconds: float = 3.0,
             temperature: float = 1.0, seed: int = 0, **options) -> dict:
    """Cold decode against the I/O roofline. Tokens are sampled (temperature 1, fixed seed) so
    that a random-weight model does not settle into a loop that routes every step alike."""
    options.setdefault("progress", False)
    with load(path, memory=memory, **options) as engine:  # closed however the run ends
        raw = raw_read_bandwidth(engine, read_seconds)
        ids = [(i * 7919) % (engine.desc.vocab - 3) + 3 for i in range(prompt_tokens)]
        # prefill first, then measure a decode that starts cold: the prompt's KV is reused, so the
        # measured call prefills one token and reads only what decoding needs
        first = engine.generate(ids, max_new_tokens=1, ignore_eos=True, speculate=False).token_ids
        drop_cache(engine)
        r = engine.generate(ids + first, max_new_tokens=new_tokens, ignore_eos=True, speculate=False,
                            temperature=temperature, seed=seed, reuse_prefix=True)
        s = r.stats
        # the disk moves between runs on a shared machine: measure it again after the decode and
        # put the decode beside the mean of the two
        raw_after = raw_read_bandwidth(engine, read_seconds, seed=1)
        raw = {**raw, "bytes_per_s_before": raw["bytes_per_s"], "bytes_per_s_after": raw_after["bytes_per_s"],
               "bytes_per_s": (raw["bytes_per_s"] + raw_after["bytes_per_s"]) / 2}
        steps = max(1, s["generated_tokens"] - 1)
        decode_s = s["total_s"] - s["ttft_s"]
        per_token_bytes = s["bytes_read"] / max(1, s["generated_tokens"])
        # the roofline counts only reads the tokens needed (demand misses + prefetches that were used):
        # wasted speculative reads make Sluice slower and must not make its roofline look closer
        needed_reads = s["demand_reads"] + s["prefetch_used"]
        record = engine.experts_source.slot_bytes
        spine_per_token = s.get("spine_bytes_read", 0) / max(1, s["generated_tokens"])
        expert_per_token = needed_reads * record / max(1, s["generated_tokens"])
        needed_per_token = expert_per_token + spine_per_token
        spine_raw = None
        seconds_per_token = expert_per_token / raw["bytes_per_s"]
        if spine_per_token and engine.spine is not None:
            # streamed layers are long sequential reads: their own bandwidth, measured the same way
            spine_raw = engine.spine.read_bandwidth(read_seconds)
            seconds_per_token += spine_per_token / spine_raw["bytes_per_s"]
        roofline_tok_s = 1.0 / seconds_per_token if seconds_per_token else float("inf")
        return {
            "model": str(path),
            "raw_read": raw,
            "raw_spine_read": spine_raw,
            "decode_tok_s": s["decode_tok_s"],
            "bytes_per_token": per_token_bytes,
            "needed_bytes_per_token": needed_per_token,
            "spine_bytes_per_token": spine_per_token,
            "spine_streamed_layers": s.get("spine_streamed_layers", 0),
            "wasted_prefetch_reads": s["prefetch_reads"] - s["prefetch_used"] - s["prefetch_cancelled"],
            # bytes read for guesses nobody used (a guess stopped between pieces counts what it read)
            "wasted_prefetch_bytes_per_token": max(0.0, per_token_bytes - needed_per_token),
            "achieved_bytes_per_s": per_token_bytes * s["decode_tok_s"],
            "io_roofline_tok_s": roofline_tok_s,
            "roofline_ratio": s["decode_tok_s"] / roofline_tok_s if roofline_tok_s else 0.0,
            "hit_rate": s["hit_rate"],
            "lookahead_recall": s["lookahead_recall"],
            "prefetch_reads": s["prefetch_reads"],
            # overlap: the share of decode time spent waiting for any read (experts or spine layers)
            "read_wait_share": (s["read_wait_s"] + s.get("spine_read_wait_s", 0.0)) / decode_s if decode_s > 0 else 0.0,
            "time_split_s": {
                "read_wait": s["read_wait_s"],
                "spine_read_wait": s.get("spine_read_wait_s", 0.0),
                "expert_compute": s["expert_compute_s"],
                "attention_and_rest": max(0.0, decode_s - s["read_wait_s"] - s.get("spine_read_wait_s", 0.0)
                                          - s["expert_compute_s"]),
                "decode_total": decode_s,
                "per_token": decode_s / steps,
            },
            "stats": s,
            "plan": engine.plan.to_dict(),
        }


def bench_lossy(path, prompt, new_tokens: int = 64, memory=None, moe_top_k: int | None = None,
                prefer_cached: float = 0.0, **options) -> dict:
    """Exact vs lossy in one engine: speed, free-running agreement, teacher-forced top-1 and logit error."""
    options.setdefault("progress", False)
    with load(path, memory=memory, **options) as engine:  # closed however the run ends
        ids = engine.encode(prompt) if isinstance(prompt, str) else list(prompt)
        setting = dict(moe_top_k=moe_top_k, prefer_cached=prefer_cached)
        runs = {}
        for name, kw in (("exact", {}), ("lossy", setting)):
            engine.set_lossy(**kw, warn=False)
            drop_cache(engine)
            runs[name] = engine.generate(ids, max_new_tokens=new_tokens, ignore_eos=True, speculate=False)
        exact, lossy = runs["exact"], runs["lossy"]
        seq = ids + exact.token_ids  # teacher forcing on the exact output
        engine.set_lossy(warn=False)
        ref = engine.forward(seq)[len(ids) - 1 : -1]
        engine.set_lossy(**setting, warn=False)
        logits = engine.forward(seq)[len(ids) - 1 : -1]
        engine.set_lossy(warn=False)
        same = 0
        for a, b in zip(exact.token_ids, lossy.token_ids):
            if a != b:
                break
            same += 1
        logp_ref, logp = torch.log_softmax(ref, -1), torch.log_softmax(logits, -1)
        kl = (logp_ref.exp() * (logp_ref - logp)).sum(-1)
        return {
            "setting": {"moe_top_k": moe_top_k, "prefer_cached": prefer_cached},
            "tokens": new_tokens,
            "exact_decode_tok_s": exact.stats["decode_tok_s"],
            "lossy_decode_tok_s": lossy.stats["decode_tok_s"],
            "speedup": (lossy.stats["decode_tok_s"] / exact.stats["decode_tok_s"]
                        if exact.stats["decode_tok_s"] else 0.0),
            "exact_bytes_read": exact.stats["bytes_read"],
            "lossy_bytes_read": lossy.stats["bytes_read"],
            "greedy_prefix_agreement": same / len(exact.token_ids),
            "positionwise_agreement": (sum(a == b for a, b in zip(exact.token_ids, lossy.token_ids))
                                       / len(exact.token_ids)),
            "teacher_forced_top1": (ref.argmax(-1) == logits.argmax(-1)).float().mean().item(),
            "mean_abs_logit_diff": (ref - logits).abs().mean().item(),
            "mean_kl": kl.mean().item(),
            "exact_hit_rate": exact.stats["hit_rate"],
            "lossy_hit_rate": lossy.stats["hit_rate"],
        }


def bench_spec(path, prompt, new_tokens: int = 128, memory=None, **options) -> dict:
    """Decode with and without speculation (cold cache each), identical tokens required."""
    options.setdefault("progress", False)
    with load(path, memory=memory, **options) as engine:  # closed however the run ends
        out = {}
        for name, spec in (("plain", False), ("speculative", True)):
            drop_cache(engine)
            r = engine.generate(prompt, max_new_tokens=new_tokens, ignore_eos=True, speculate=spec)
            out[name] = r
        p, s = out["plain"], out["speculative"]
        return {
            "tokens": new_tokens,
            "identical": p.token_ids == s.token_ids,
            "plain_decode_tok_s": p.stats["decode_tok_s"],
            "spec_decode_tok_s": s.stats["decode_tok_s"],
            "speedup": s.stats["decode_tok_s"] / p.stats["decode_tok_s"] if p.stats["decode_tok_s"] else 0.0,
            "plain_total_s": p.stats["total_s"],
            "spec_total_s": s.stats["total_s"],
            "drafted": s.stats["drafted"],
            "accepted": s.stats["accepted"],
            "tokens_per_forward": s.stats["tokens_per_forward"],
            "plain_bytes_read": p.stats["bytes_read"],
            "spec_bytes_read": s.stats["bytes_read"],
        }
