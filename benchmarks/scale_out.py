"""Experts sharded over Ray workers on one host: what pooling the workers' caches gains, and
what each layer's round trip to the workers costs.

    python benchmarks/scale_out.py [--model demo] [--tokens 48] [--cache 24] [--workers 1,2,3] [--json OUT]

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


def decode_run(model: str, tokens: int, cache: int, **ray_opts) -> dict:
    eng = sluice.load(model, "2GiB", progress=False, cache_experts=cache, **ray_opts)
    try:
        # warm the spine and the process; the cache stays as this first run leaves it, as in serving
        eng.generate(PROMPT, max_new_tokens=4, ignore_eos=True, speculate=False)
        before = eng.totals()
        ex = eng.experts
        d0, n0 = getattr(ex, "dispatch_s", 0.0), getattr(ex, "dispatch_calls", 0)
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--cache", type=int, default=24, help="expert cache slots of the one process and of EACH worker")
    ap.add_argument("--workers", default="1,2,3")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import ray
    from ray.cluster_utils import Cluster

    node = dict(num_cpus=1, node_ip_address="127.0.0.1", object_store_memory=80 << 20)
    cluster = Cluster(initialize_head=True, head_node_args=dict(node, include_dashboard=False))
    for _ in range(2):
        cluster.add_node(**node)
    ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
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
