"""Cold decode against the I/O roofline with lookahead prefetch settings side by side.

    PYTHONPATH=src python benchmarks/prefetch.py MODEL --memory 2.76GiB [--cache-experts N] [--tokens 32]
        [--prompt TEXT] [--reps 3] [--arm NAME:depth=2,min_prob=0.0 ...] [--json OUT]

Arm settings: ``prefetch`` (false: no lookahead reads), ``depth`` (layers ahead always),
``max_depth`` (up to this many while the readers would idle), ``gate`` (0: lfru's fixed rule;
> 0: guesses carry their probability, ``PrefetchOptions.gate``, and lfru's ``gate`` factor),
``latency`` (also look further while a read outlasts the layers before its layer),
``min_prob``, ``reader_cap``, ``piece_cap``, ``spec_hot``, ``verify`` (CRC on read), ``cross`` (lfru's
cold-fresh rule, issue 30; ``cross=0`` is the policy before it).

One engine, one process; the arms (default: no prefetch; ``old``: one layer ahead, fixed rule;
``new``: the gate, two ahead while readers idle) run interleaved ``--reps`` times, each a
decode that starts from an empty expert cache and a fresh cache policy after
the same prompt (``sluice bench io``'s measurement: prefill first, then the cache is
dropped). Around every decode the disk's raw random-read bandwidth at the expert record
size is measured through the engine's own read path (``sluice.bench.raw_read_bandwidth``),
and each decode is put beside the mean of the two: the I/O roofline is that bandwidth over
the expert bytes the decode *needed* (demand reads + prefetches that were used). Reported
per arm: median ratio to the roofline (and every rep's), tok/s, bytes read and needed per
token, wasted prefetch bytes per token, hit rate, expert reads (and demand reads) per token,
lookahead recall one and two layers ahead, time split.
On a shared machine compare the arms of one run, not numbers across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

_SRC = Path(__file__).resolve().parent.parent / "src"
if str(_SRC) not in sys.path:
    sys.path.insert(0, str(_SRC))

import sluice  # noqa: E402
from sluice.bench import drop_cache, raw_read_bandwidth  # noqa: E402
from sluice.experts.policy_spec import make_policy, parse_policy_spec  # noqa: E402
from sluice.storage import file as file_io  # noqa: E402

READER_CAP = 0
# "old": one layer ahead, lfru's fixed hotness rule (main before the gate); "new": the gate and cross-layer lookahead
DEFAULT_ARMS = ["off:prefetch=false", "old:max_depth=1,gate=0", "new:max_depth=2,gate=1"]
SETTINGS = ("prefetch", "depth", "max_depth", "min_prob", "reader_cap", "piece_cap", "spec_hot", "gate", "latency",
            "verify", "cross")


def parse_arm(text: str) -> tuple[str, dict]:
    name, params = parse_policy_spec(text)  # NAME:KEY=VALUE,... (same syntax as cache policies)
    unknown = set(params) - set(SETTINGS)
    if unknown:
        raise SystemExit(f"arm {text!r}: unknown setting(s) {sorted(unknown)} ({', '.join(SETTINGS)})")
    return name, params


def run_arm(engine, ids: list[int], tokens: int, params: dict, read_seconds: float, seed: int) -> dict:
    pf, default = engine.options.prefetch, sluice.PrefetchOptions()  # the settings the engine's Lookahead reads
    pf.enabled = bool(params.get("prefetch", True))
    pf.depth = int(params.get("depth", default.depth))
    # further layers ahead while the provider asks for them (readers idle, reads slower than layers)
    pf.max_depth = int(params.get("max_depth", default.max_depth))
    # ... also while a read outlasts the layers before its layer
    pf.latency = bool(params.get("latency", False))
    # CRC of every record on read (the engine's default: on)
    engine.experts.verify_reads = bool(params.get("verify", engine.options.verify_reads))
    pf.min_prob = float(params.get("min_prob", default.min_prob))
    # how many reader / piece threads may run prefetches at once (0: no limit)
    engine.experts.pool.low_cap = int(params.get("reader_cap", READER_CAP)) or None
    file_io._pieces().low_cap = int(params.get("piece_cap", file_io.PIECE_LOW_CAP)) or None
    drop_cache(engine)
    before = raw_read_bandwidth(engine, read_seconds, seed=seed)["bytes_per_s"]
    drop_cache(engine)
    # every arm starts from an empty cache and a fresh policy (no scores kept from other arms)
    engine.cache.policy = policy = make_policy(engine.options.cache_policy)
    # lfru: a guess may evict a stale key only below this hotness
    if hasattr(policy, "speculative_max_hotness"):
        policy.speculative_max_hotness = float(params.get("spec_hot", type(policy).speculative_max_hotness))
    # guesses carry their probability (lfru's admission gate, the read-time rule); gate=0: the fixed rule
    pf.gate = bool(params.get("gate", default.gate))
    if hasattr(policy, "gate") and params.get("gate"):
        policy.gate = float(params["gate"])
    # lfru's cold-fresh rule (issue 30; 0: the policy before it)
    if "cross" in params:
        if not hasattr(policy, "cross"):
            raise SystemExit(f"cross: the cache policy {engine.options.cache_policy!r} has no cold-fresh rule")
        policy.cross = float(params["cross"])
    c0 = vars(engine.experts.counters).copy()
    r = engine.generate(ids, max_new_tokens=tokens, ignore_eos=True, speculate=False, temperature=1.0, seed=0,
                        reuse_prefix=True)
    c1 = vars(engine.experts.counters)
    d = {k: c1[k] - c0[k] for k in c0}
    after = raw_read_bandwidth(engine, read_seconds, seed=seed + 1)["bytes_per_s"]
    s = r.stats
    n = max(1, s["generated_tokens"])
    record = engine.experts_source.slot_bytes
    needed = (s["demand_reads"] + s["prefetch_used"]) * record / n
    raw = (before + after) / 2
    roofline = raw / needed if needed else float("inf")
    decode_s = s["total_s"] - s["ttft_s"]
    steps = max(1, n - 1)
    return {
        "tokens": r.token_ids,
        "raw_before": before, "raw_after": after,
        "decode_tok_s": s["decode_tok_s"],
        "ratio": s["decode_tok_s"] / roofline if roofline else 0.0,
        "bytes_per_token": s["bytes_read"] / n,
        "needed_per_token": needed,
        "wasted_per_token": s["bytes_read"] / n - needed,
        "hit_rate": s["hit_rate"],
        "reads_per_token": (s["demand_reads"] + s["prefetch_reads"]) / n, "demand_per_token": s["demand_reads"] / n,
        "prefetch_reads": s["prefetch_reads"], "prefetch_used": s["prefetch_used"],
        "prefetch_cancelled": d["prefetch_cancelled"], "prefetch_aborted": d["prefetch_aborted"],
        "recall_1": d["predicted_hits"] / d["predicted"] if d["predicted"] else None,
        "recall_2": d["predicted_far_hits"] / d["predicted_far"] if d["predicted_far"] else None,
        "read_wait_per_token": s["read_wait_s"] / steps,
        "compute_per_token": s["expert_compute_s"] / steps,
        "rest_per_token": max(0.0, decode_s - s["read_wait_s"] - s["expert_compute_s"]) / steps,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--memory", default="2.76GiB")
    ap.add_argument("--cache-experts", type=int, help="expert cache slots (instead of what --memory leaves)")
    ap.add_argument("--max-context", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--prompt", help="a text prompt (the model's tokenizer) instead of --prompt-tokens spread ids")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--read-seconds", type=float, default=2.0)
    ap.add_argument("--arm", action="append", help="NAME:prefetch=..,depth=..,min_prob=.. (repeatable)")
    ap.add_argument("--json", help="write every rep as JSON here")
    args = ap.parse_args(argv)
    arms = [parse_arm(a) for a in (args.arm or DEFAULT_ARMS)]
    engine = sluice.load(args.model, memory=args.memory, max_context=args.max_context, progress=False,
                         cache_experts=args.cache_experts, parallel=1)
    global READER_CAP
    READER_CAP = engine.experts.pool.low_cap or 0
    if args.prompt:
        ids = engine.encode(args.prompt)
    else:
        ids = [(i * 7919) % (engine.desc.vocab - 3) + 3 for i in range(args.prompt_tokens)]
    first = engine.generate(ids, max_new_tokens=1, ignore_eos=True, speculate=False).token_ids
    ids = ids + first
    results: dict[str, list[dict]] = {name: [] for name, _ in arms}
    t0 = time.time()
    for rep in range(args.reps):
        for name, params in arms:
            res = run_arm(engine, ids, args.tokens, params, args.read_seconds, seed=rep * 2)
            results[name].append(res)
            print(f"rep {rep} {name:>10}: {res['ratio']:.3f} of roofline, {res['decode_tok_s']:.2f} tok/s, "
                  f"raw {res['raw_before'] / 1e9:.2f}/{res['raw_after'] / 1e9:.2f} GB/s, load {os.getloadavg()[0]:.1f}",
                  flush=True)
    ref = None
    for name, _ in arms:
        toks = [r["tokens"] for r in results[name]]
        ref = ref if ref is not None else toks[0]
        if any(t != ref for t in toks):
            print(f"ERROR: arm {name} produced different tokens", file=sys.stderr)
            return 1
    mb = 1e6
    print(f"\n{args.reps} reps x {len(arms)} arms in {time.time() - t0:.0f} s; model {args.model}, "
          f"{engine.plan.cache_slots} cache slots of {engine.experts_source.slot_bytes / mb:.1f} MB\n")
    base = results[arms[0][0]]
    print(f"| arm | x roofline (median; reps) | tok/s vs {arms[0][0]} (median of per-rep ratios) | decode tok/s "
          "| read / needed MB per token | wasted MB per token | hit rate | expert reads (demand) per token "
          "| recall 1 / 2 ahead "
          "| prefetches (used, cancelled, stopped) | read wait / compute / rest s per token |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, _ in arms:
        rs = results[name]
        med = lambda k: statistics.median(r[k] for r in rs)  # noqa: E731
        rec = lambda k: "-" if rs[0][k] is None else f"{statistics.median(r[k] for r in rs):.2f}"  # noqa: E731
        paired = statistics.median(r["decode_tok_s"] / b["decode_tok_s"] for r, b in zip(rs, base))
        print(f"| {name} | **{med('ratio'):.2f}** ({', '.join(format(r['ratio'], '.2f') for r in rs)}) "
              f"| {paired:.2f} | {med('decode_tok_s'):.2f} "
              f"| {med('bytes_per_token') / mb:.0f} / {med('needed_per_token') / mb:.0f} "
              f"| {med('wasted_per_token') / mb:.0f} | {med('hit_rate'):.3f} "
              f"| {med('reads_per_token'):.2f} ({med('demand_per_token'):.2f}) | {rec('recall_1')} / {rec('recall_2')} "
              f"| {med('prefetch_reads'):.0f} ({med('prefetch_used'):.0f}, {med('prefetch_cancelled'):.0f}, "
              f"{med('prefetch_aborted'):.0f}) | {med('read_wait_per_token'):.3f} / {med('compute_per_token'):.3f} / "
              f"{med('rest_per_token'):.3f} |")
    if args.json:
        for rs in results.values():
            for r in rs:
                r.pop("tokens")
        Path(args.json).write_text(json.dumps({"model": args.model, "reps": args.reps, "results": results}, indent=1))
    engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
