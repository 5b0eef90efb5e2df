"""Certain reads on DeepSeek-V4-shaped models: hash layers' read wait vs router layers', on and off.

A hash-routed layer's experts are ``tid2eid[token]``: with ``certain_reads`` (the default) the
engine reads them as soon as a step's token ids are known, before the embedding runs
(``experts/certain.py``); without (arm ``off``), the layer reads them when it runs (the router
lookahead has no guess for it). Arm ``staggered``: certain reads with the later hash layers'
queued behind every demand read until the MoE layer before them has run
(``CertainReads.staggered``), against ``on``'s all at demand priority at once. Two synthetic
V4 shapes (``sluice.synthetic``, random bf16 weights, valid integer hash tables): ``tiny`` (the
test suite's size: every expert fits in the cache) and ``stream`` (``DEEPSEEK_V4_CONFIG``,
~1.8 GB, run under ``--memory`` so its experts stream through a cache that holds a fraction of
them).

Cold, the arms in one run, interleaved (the order rotating per round): a fresh process per
run (an empty expert cache), O_DIRECT where the filesystem allows it, the page cache dropped
first when this process may (recorded). Per arm, medians over the rounds: decode tok/s, read
wait per token in a hash layer and in a router layer (``hash_read_wait_s`` and the rest of
``read_wait_s``, each over decode forwards x that kind's layers), the hash layers' decode
lookups and misses, certain reads and bytes, demand and prefetch reads, bytes read; the load
average before and after each run; the generated tokens of every arm equal.

    PYTHONPATH=src python benchmarks/certain_reads.py [--dir /path/for/models] [--memory 1.5GiB]
        [--tokens 32] [--prompt-tokens 4] [--prefill-chunk N] [--rounds 3] [--arms on,off|on,staggered,off]
        [--json benchmarks/results/certain-reads.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import sluice  # noqa: F401  (before torch: it sets OpenMP's wait policy)
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import drop_caches, loadavg  # noqa: E402

from sluice.synthetic import DEEPSEEK_V4_CONFIG, model_bytes, write_model  # noqa: E402
from sluice.units import format_size  # noqa: E402

TINY = dict(
    DEEPSEEK_V4_CONFIG,
    vocab_size=4096,
    hidden_size=256,
    moe_intermediate_size=128,
    head_dim=64,
    q_lora_rank=64,
    o_lora_rank=32,
    index_head_dim=32,
    n_routed_experts=64,
)
MODELS = {"tiny": (TINY, "4GiB"), "stream": (DEEPSEEK_V4_CONFIG, None)}
KEYS = (
    "decode_tok_s",
    "hash_wait_ms_per_token_layer",
    "router_wait_ms_per_token_layer",
    "hash_misses",
    "hash_lookups",
    "expert_misses",
    "expert_lookups",
    "certain_reads",
    "certain_bytes",
    "demand_reads",
    "prefetch_reads",
    "bytes_read",
    "read_wait_s",
    "hash_read_wait_s",
    "ttft_s",
    "certain_ahead",
)


def child(path: Path, memory: str, tokens: int, arm: str, n_hash: int, n_router: int, prompt_len: int,
          chunk: int | None = None) -> dict:
    """One cold run in this (fresh) process: the generation's stats, and the decode read wait of
    each MoE layer (ms per token)."""
    prompt = torch.randint(3, 4000, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    chunked = {"prefill_chunk": chunk} if chunk else {}
    with sluice.load(path, memory=memory, progress=False, max_context=max(512, prompt_len + tokens + 8),
                     certain_reads=arm != "off", **chunked) as eng:
        if arm == "staggered":  # the later hash layers' reads behind the demand reads
            eng.experts.certain.staggered = True
        provider, per_layer = eng.experts, {}
        run_experts = provider.run_experts

        def timed(layer, *args, **kw):  # the decode read wait each layer's call added
            w0 = provider.counters.read_wait_s
            try:
                return run_experts(layer, *args, **kw)
            finally:
                per_layer[layer] = per_layer.get(layer, 0.0) + provider.counters.read_wait_s - w0

        provider.run_experts = timed
        issue, ahead = provider.certain.issue, [0]

        def counted(certain, rows, is_ahead):  # the experts handed over for a later forward
            if is_ahead:
                ahead[0] += sum(len(set(ids.reshape(-1).tolist())) for ids in certain.values())
            return issue(certain, rows, is_ahead)

        provider.certain.issue = counted
        r = eng.generate(prompt, max_new_tokens=tokens, ignore_eos=True, speculate=False)
        s, plan = r.stats, eng.plan
    forwards = max(1, s["decode_forwards"])
    router_wait = s["read_wait_s"] - s["hash_read_wait_s"]
    out = {k: s[k] for k in KEYS if k in s}
    out["certain_ahead"] = ahead[0]
    out.update(
        arm=arm,
        tokens=r.token_ids,
        direct_io=s["direct_io"],
        cache_slots=plan.cache_slots,
        total_experts=plan.total_experts,
        budget=plan.budget,
        hash_wait_ms_per_token_layer=1e3 * s["hash_read_wait_s"] / forwards / max(1, n_hash),
        router_wait_ms_per_token_layer=1e3 * router_wait / forwards / max(1, n_router),
        wait_ms_per_token_by_layer=[round(1e3 * per_layer.get(i, 0.0) / forwards, 3) for i in range(n_hash + n_router)],
    )
    return out


def run(path: Path, memory: str, tokens: int, arm: str, n_hash: int, n_router: int, prompt_len: int,
        chunk: int | None = None) -> dict:
    """One cold run in a fresh process (the same baseline, so the same cache, for both arms)."""
    dropped, why = drop_caches()
    before = loadavg()
    cmd = [
        sys.executable,
        __file__,
        "--child",
        json.dumps([str(path), memory, tokens, arm, n_hash, n_router, prompt_len, chunk]),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    out = json.loads(done.stdout.strip().splitlines()[-1])
    out.update(page_cache_dropped=dropped, drop_note=why, load_before=before, load_after=loadavg())
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=None, help="where to write the models (default: a temporary directory)")
    ap.add_argument("--memory", default="1.5GiB", help="the stream model's budget (default 1.5GiB)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=4, help="a short prompt: decode meets cold experts")
    ap.add_argument("--models", default="tiny,stream")
    ap.add_argument("--prefill-chunk", type=int, default=None,
                    help="prefill the prompt in chunks of this many tokens (one a step: the next chunk's hash "
                         "experts are handed over ahead); the runs then report ttft_s")
    ap.add_argument(
        "--arms",
        default="on,off",
        help="on, off, and staggered (certain reads, the later hash layers' behind the demand reads)",
    )
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # one run: its arguments as JSON
    a = ap.parse_args()
    if a.child:
        path, memory, tokens, arm, n_hash, n_router, prompt_len, chunk = json.loads(a.child)
        print(json.dumps(child(Path(path), memory, tokens, arm, n_hash, n_router, prompt_len, chunk)))
        return 0
    root = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="certain-bench-"))
    out = {
        "machine": platform.processor() or platform.machine(),
        "tokens": a.tokens,
        "rounds": a.rounds,
        "prompt_tokens": a.prompt_tokens,
        "prefill_chunk": a.prefill_chunk,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "models": {},
    }
    same = True
    for name in a.models.split(","):
        cfg, memory = MODELS[name]
        memory = memory or a.memory
        path = root / f"deepseek-v4-synthetic-{name}"
        if not (path / "config.json").exists():
            write_model(path, cfg, dtype=torch.bfloat16, progress=False)
        n_hash = cfg["mlp_layer_types"].count("hash_moe")
        n_router = len(cfg["mlp_layer_types"]) - n_hash
        arms = a.arms.split(",")
        runs = {arm: [] for arm in arms}
        for i in range(a.rounds):
            for arm in arms[i % len(arms) :] + arms[: i % len(arms)]:  # the order rotating per round
                rec = run(path, memory, a.tokens, arm, n_hash, n_router, a.prompt_tokens, a.prefill_chunk)
                runs[rec["arm"]].append(rec)
                print(
                    f"  {name} {rec['arm']:3s} {rec['decode_tok_s']:.2f} tok/s  hash wait "
                    f"{rec['hash_wait_ms_per_token_layer']:.2f} ms/token/layer  router wait "
                    f"{rec['router_wait_ms_per_token_layer']:.2f}  prefill {rec['ttft_s']:.2f} s (experts handed "
                    f"over ahead {rec['certain_ahead']})  load {rec['load_before']}",
                    flush=True,
                )
        first = runs[arms[0]][0]["tokens"]
        equal = all(r["tokens"] == first for rs in runs.values() for r in rs)
        same &= equal
        m = {
            "model_bytes": model_bytes(cfg),
            "memory": memory,
            "hash_layers": n_hash,
            "router_layers": n_router,
            "cache_slots": runs[arms[0]][0]["cache_slots"],
            "total_experts": runs[arms[0]][0]["total_experts"],
            "direct_io": runs[arms[0]][0]["direct_io"],
            "page_cache_dropped": runs[arms[0]][0]["page_cache_dropped"],
            "tokens_equal": equal,
            "arms": {},
        }
        for arm, rs in runs.items():
            med = {k: statistics.median(r[k] for r in rs) for k in KEYS}
            med["decode_tok_s_all"] = [round(r["decode_tok_s"], 3) for r in rs]
            med["hash_over_router"] = (
                med["hash_wait_ms_per_token_layer"] / med["router_wait_ms_per_token_layer"]
                if med["router_wait_ms_per_token_layer"]
                else None
            )
            med["load"] = [r["load_before"] for r in rs]
            med["wait_ms_per_token_by_layer"] = [
                statistics.median(r["wait_ms_per_token_by_layer"][i] for r in rs) for i in range(n_hash + n_router)
            ]
            m["arms"][arm] = med
        out["models"][name] = m
        print(
            f"{name}: {format_size(m['model_bytes'])} under {memory}, cache {m['cache_slots']} of "
            f"{m['total_experts']} experts, O_DIRECT={m['direct_io']}, tokens equal={equal}"
        )
        for arm, med in m["arms"].items():
            ratio = med["hash_over_router"]
            print(
                f"  {arm:3s} {med['decode_tok_s']:.2f} tok/s  wait per token and layer: hash "
                f"{med['hash_wait_ms_per_token_layer']:.2f} ms, router {med['router_wait_ms_per_token_layer']:.2f} "
                f"ms (ratio {'-' if ratio is None else f'{ratio:.2f}'})  hash misses {med['hash_misses']:.0f}/"
                f"{med['hash_lookups']:.0f}  certain reads {med['certain_reads']:.0f}  prefill {med['ttft_s']:.2f} s"
            )
            print(f"      wait ms/token by layer {med['wait_ms_per_token_by_layer']}")
    out["load_end"] = loadavg()
    out["tokens_equal"] = same
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
