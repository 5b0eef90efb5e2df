"""Experts sharded over Ray workers on one host: what pooling the workers' caches gains, and
what each layer's round trip to the workers costs.

    python benchmarks/scale_out.py [--model demo] [--tokens 48] [--cache 24] [--workers 1,2,3] [--json OUT]
    python benchmarks/scale_out.py --dispatch [--rounds 3] [--tokens 32] [--json OUT]

A local Ray cluster of three logical nodes on 127.0.0.1 (dashboard and usage reporting off).
For one process with a cache of ``--cache`` experts, then for 1, 2, 3 expert workers with
``--cache`` experts EACH (the pooled cache grows with the workers), greedy decoding of
``--tokens`` tokens of the same prompt: the tokens (must equal the single process's), decode
hit rate, expert bytes read per decoded token, decode tok/s, and the driver's wall time per MoE
layer (``dispatch``: round trip + worker reads and compute) beside the workers' own time per
layer (reads waited for + compute, summed over the layer's workers). Then the bare transport:
a [1, H] fp32 row sent to all workers at once and echoed back (``ping``), median of 200, and a
[64, H] block, as plain actor calls and as a Ray Compiled Graph. The cache is capped by slots
(``--cache-experts`` per worker), not by cgroups.

``--dispatch``: how ``RayExperts`` sends a layer's requests, the same decode in every arm, arms
interleaved round by round (``--rounds``), the load average beside each: plain actor calls
(``--ray-plain-calls``) against the compiled graph (the default), with 1 and 3 workers, and with
3 workers whose every expert has a replica (``--replicate-hot``), decoding layers packed on the
fewest workers (the default) or not. Per arm: decode tok/s, dispatch ms per MoE layer, worker
requests per MoE layer (deterministic for a given placement), tokens equal to one process's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # every node on 127.0.0.1

import sluice  # noqa: E402  (before torch: its OpenMP wait policy)
import torch  # noqa: E402

PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n"


def decode_run(model: str, tokens: int, cache: int, pack: bool = True, **ray_opts) -> dict:
    eng = sluice.load(model, "2GiB", progress=False, cache_experts=cache, **ray_opts)
    try:
        if ray_opts:
            eng.experts.pack_decoding = pack
        # warm the spine and the process; the cache stays as this first run leaves it, as in serving
        eng.generate(PROMPT, max_new_tokens=4, ignore_eos=True, speculate=False)
        before = eng.totals()
        ex = eng.experts
        d0, n0 = getattr(ex, "dispatch_s", 0.0), getattr(ex, "dispatch_calls", 0)
        c0 = getattr(ex, "worker_calls", 0)
        w0 = [s.get("read_wait_s", 0) + s.get("compute_s", 0) for s in ex.worker_stats()] if ray_opts else []
        r = eng.generate(PROMPT, max_new_tokens=tokens, ignore_eos=True, speculate=False)
        after = eng.totals()
        st = r.stats
        expert_bytes = after.bytes_read - before.bytes_read - (after.spine_bytes_read - before.spine_bytes_read)
        out = dict(tokens=r.token_ids, hit_rate=st["hit_rate"], decode_tok_s=st["decode_tok_s"],
                   bytes_per_token=expert_bytes / max(1, tokens))
        if ray_opts:
            layers = ex.dispatch_calls - n0
            w1 = [s.get("read_wait_s", 0) + s.get("compute_s", 0) for s in ex.worker_stats()]
            out["dispatch_ms_per_layer"] = 1e3 * (ex.dispatch_s - d0) / max(1, layers)
            out["calls_per_layer"] = (ex.worker_calls - c0) / max(1, layers)
            out["graph_builds"], out["graph_fallbacks"] = ex.graph_builds, ex.graph_fallbacks
            out["worker_ms_per_layer"] = 1e3 * (sum(w1) - sum(w0)) / max(1, layers)
            out["moe_layers_per_token"] = layers / max(1, tokens + len(eng.encode(PROMPT)))
            out["pooled_slots"] = sum(h["slots"] for h in ex.info)
        return out
    finally:
        eng.close()


def ping(workers: int, hidden: int, rows: int, n: int = 200) -> float:
    import ray

    from sluice.cluster.worker import ExpertWorker

    actor = ray.remote(ExpertWorker).options(num_cpus=0, scheduling_strategy="SPREAD")
    from sluice.demo import SHIPPED_MODEL

    ws = [actor.remote(i, str(SHIPPED_MODEL), {"cache_experts": 1}) for i in range(workers)]
    x = torch.randn(rows, hidden)
    ray.get([w.hello.remote() for w in ws])
    for _ in range(10):
        ray.get([w.ping.remote(x) for w in ws])
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        ray.get([w.ping.remote(x) for w in ws])
        times.append(time.perf_counter() - t0)
    plain = 1e3 * statistics.median(times)
    # the same round trip as a Ray Compiled Graph (shared-memory channels, no per-call scheduling)
    from ray.dag import InputNode, MultiOutputNode

    with InputNode() as inp:
        dag = MultiOutputNode([w.ping.bind(inp) for w in ws])
    cdag = dag.experimental_compile()
    for _ in range(10):
        ray.get(cdag.execute(x))
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        ray.get(cdag.execute(x))
        times.append(time.perf_counter() - t0)
    cdag.teardown()
    for w in ws:
        ray.kill(w)
    return plain, 1e3 * statistics.median(times)


ARMS = [  # (label, workers, replicate_hot (-1: every expert), compiled, pack)
    ("1 worker, plain calls", 1, 0, False, True),
    ("1 worker, compiled graph", 1, 0, True, True),
    ("3 workers, plain calls", 3, 0, False, True),
    ("3 workers, compiled graph", 3, 0, True, True),
    ("3 workers, all replicated, plain, spread", 3, -1, False, False),
    ("3 workers, all replicated, plain, packed", 3, -1, False, True),
    ("3 workers, all replicated, compiled, spread", 3, -1, True, False),
    ("3 workers, all replicated, compiled, packed", 3, -1, True, True),
]


def dispatch(args) -> tuple[list[dict], dict]:
    """The ARMS interleaved round by round; one process's tokens as the reference."""
    n_experts = sluice.load(args.model, "2GiB", progress=False).desc.n_experts
    single = decode_run(args.model, args.tokens, args.cache)
    runs = []
    for rnd in range(args.rounds):
        for label, workers, hot, compiled, pack in ARMS:
            load0 = os.getloadavg()[0]
            r = decode_run(args.model, args.tokens, args.cache, pack=pack, ray="auto", expert_workers=workers,
                           replicate_hot=n_experts if hot < 0 else hot, ray_compiled=compiled)
            r.update(arm=label, round=rnd, exact=r["tokens"] == single["tokens"], load=(load0, os.getloadavg()[0]))
            runs.append(r)
            print(f"round {rnd}: {label}: {r['decode_tok_s']:.1f} tok/s, {r['dispatch_ms_per_layer']:.2f} ms "
                  f"dispatch / layer, {r['calls_per_layer']:.2f} requests / layer, load {load0:.1f}", flush=True)
    return runs, single


def dispatch_table(runs: list[dict], single: dict) -> None:
    print(f"one process: {single['decode_tok_s']:.1f} tok/s")
    print("| arm | exact | decode tok/s (median) | dispatch ms / MoE layer (median) | requests / MoE layer | "
          "ratio to plain calls (tok/s, per round) | load |")
    print("|---|---|---|---|---|---|---|")
    by = {}
    for r in runs:
        by.setdefault(r["arm"], []).append(r)
    plain_of = {label: next(a for a, w, h, c, p in ARMS if (w, h, c, p) == (w0, h0, False, p0))
                for label, w0, h0, _, p0 in ARMS}
    for label, *_ in ARMS:
        rs = by[label]
        base = by[plain_of[label]]
        ratios = [r["decode_tok_s"] / b["decode_tok_s"] for r, b in zip(rs, base)]
        loads = [x for r in rs for x in r["load"]]
        print(f"| {label} | {all(r['exact'] for r in rs)} | {statistics.median(r['decode_tok_s'] for r in rs):.1f} | "
              f"{statistics.median(r['dispatch_ms_per_layer'] for r in rs):.2f} | "
              f"{statistics.median(r['calls_per_layer'] for r in rs):.2f} | "
              f"{', '.join(f'{x:.2f}' for x in ratios)} | {min(loads):.1f}-{max(loads):.1f} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--cache", type=int, default=24, help="expert cache slots of the one process and of EACH worker")
    ap.add_argument("--workers", default="1,2,3")
    ap.add_argument("--dispatch", action="store_true", help="plain calls against the compiled graph (see above)")
    ap.add_argument("--rounds", type=int, default=3, help="--dispatch: rounds of all arms, interleaved")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import ray
    from ray.cluster_utils import Cluster

    node = dict(num_cpus=1, node_ip_address="127.0.0.1", object_store_memory=80 << 20)
    cluster = Cluster(initialize_head=True, head_node_args=dict(node, include_dashboard=False))
    for _ in range(2):
        cluster.add_node(**node)
    ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
    if args.dispatch:
        try:
            runs, single = dispatch(args)
        finally:
            ray.shutdown()
            cluster.shutdown()
        print(f"model {args.model}, {args.tokens} decoded tokens, {args.cache} cache slots per process/worker, "
              f"{os.cpu_count()} cores, {args.rounds} rounds")
        dispatch_table(runs, single)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(args=vars(args), single={k: v for k, v in single.items() if k != "tokens"},
                               runs=[{k: v for k, v in r.items() if k != "tokens"} for r in runs],
                               cores=os.cpu_count()), f, indent=1)
        return 0 if all(r["exact"] for r in runs) else 1
    rows = []
    try:
        single = decode_run(args.model, args.tokens, args.cache)
        rows.append(dict(config="1 process", **single))
        for w in [int(x) for x in args.workers.split(",")]:
            r = decode_run(args.model, args.tokens, args.cache, ray="auto", expert_workers=w)
            r["exact"] = r["tokens"] == single["tokens"]
            rows.append(dict(config=f"{w} worker(s)", **r))
        hidden = sluice.load(args.model, "2GiB", progress=False).desc.hidden
        pings = {f"{w} workers, {n} rows": ping(w, hidden, n) for w in (1, 3) for n in (1, 64)}
    finally:
        ray.shutdown()
        cluster.shutdown()
    print(f"model {args.model}, {args.tokens} decoded tokens, {args.cache} cache slots per process/worker, "
          f"{os.cpu_count()} cores")
    print("| config | exact | hit rate | expert MB read / token | decode tok/s | dispatch ms / layer | "
          "worker ms / layer |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r.get('exact', '-')} | {r['hit_rate']:.3f} | {r['bytes_per_token'] / 1e6:.2f} | "
              f"{r['decode_tok_s']:.1f} | {r.get('dispatch_ms_per_layer', float('nan')):.2f} | "
              f"{r.get('worker_ms_per_layer', float('nan')):.2f} |")
    print("round trip to all workers at once, echo of fp32 rows (median ms): actor calls, compiled graph")
    for k, (v, cg) in pings.items():
        print(f"  {k}: {v:.2f}, {cg:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), rows=[{k: v for k, v in r.items() if k != "tokens"} for r in rows],
                           ping_ms=pings, cores=os.cpu_count()), f, indent=1)
    return 0 if all(r.get("exact", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
