"""The paper model of docs/scale-out.md: what a decoded token costs when the experts of a large
MoE are pooled over N machines on Ray, beside one machine reading its misses from local disk.

    python benchmarks/scale_out_model.py [--call-ms 0.5] [--json OUT]

Per token, the driver runs every layer in order; each MoE layer is one round of calls to the
workers holding the token's K experts (all at once), so a token pays, in sequence, per MoE layer:
the call overhead (``--call-ms``: Ray's actor-call round trip plus the network's RTT), the
transfer (one fp32 hidden row to each of min(K, N) workers, K fp32 output rows back, at the
link's rate), the expert reads of that layer's misses (spread over the workers' disks, which
read in parallel) and the compute (each worker's share of the K experts, weight bytes at its
memory bandwidth). One machine pays the reads from its single disk and all K experts' compute,
and no round trips.

The hit rate of a cache holding a fraction f of all experts: ``h(f) = 1 - (1 - f) ** a``; a = 3.95
fits the demo model's measured pooled hit rates (benchmarks/scale_out.py: 0.41, 0.69, 0.85 at
f = 1/8, 1/4, 3/8); a = 1 is uniform routing (h = f), the pessimistic bound.
"""

from __future__ import annotations

import argparse
import json

MODELS = {
    # hidden, MoE layers, experts per layer, top-k, bytes per expert (3 matrices, stored format)
    "Qwen3-235B-A22B (bf16)": dict(hidden=4096, layers=94, experts=128, k=8, expert_bytes=3 * 4096 * 1536 * 2),
    "DeepSeek-V3 (fp8)": dict(hidden=7168, layers=58, experts=256, k=8, expert_bytes=3 * 7168 * 2048 * 1),
}
LINKS_GBIT = (10, 25, 100)
MACHINES = (1, 2, 4, 8, 16, 32, 64)
CACHE_GB = 64  # expert cache per machine (one worker each)
DISK_GBS = 3.0  # NVMe read per machine, GB/s
MEM_GBS = 20.0  # memory bandwidth an expert's compute streams its weights at, per machine, GB/s
ALPHAS = {"measured skew (a=3.95)": 3.95, "uniform routing (a=1)": 1.0}


def token_ms(m: dict, n: int, link_gbit: float, call_ms: float, a: float) -> dict:
    total = m["layers"] * m["experts"] * m["expert_bytes"]
    f = min(1.0, n * CACHE_GB * 1e9 / total)
    h = 1 - (1 - f) ** a
    per_layer_read = (1 - h) * m["k"] * m["expert_bytes"]  # bytes missed per MoE layer per token
    holders = min(m["k"], n)
    read_ms = per_layer_read / (holders * DISK_GBS * 1e9) * 1e3  # misses spread over the holders' disks
    compute_ms = (m["k"] / holders) * m["expert_bytes"] / (MEM_GBS * 1e9) * 1e3
    if n == 1:
        rt_ms = xfer_ms = 0.0
    else:
        xfer_bytes = 4 * m["hidden"] * (holders + m["k"])
        xfer_ms = xfer_bytes * 8 / (link_gbit * 1e9) * 1e3
        rt_ms = call_ms
    layer = rt_ms + xfer_ms + read_ms + compute_ms
    return dict(hit_rate=h, cached_fraction=f, per_token_ms=layer * m["layers"],
                round_trip_ms=(rt_ms + xfer_ms) * m["layers"], read_ms=read_ms * m["layers"],
                compute_ms=compute_ms * m["layers"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--call-ms", type=float, default=0.5, help="Ray actor-call round trip + network RTT, ms")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    out = {}
    for name, m in MODELS.items():
        total_gb = m["layers"] * m["experts"] * m["expert_bytes"] / 1e9
        ws_gb = m["layers"] * m["k"] * m["expert_bytes"] / 1e9
        print(f"\n{name}: experts {total_gb:.0f} GB, one token's {ws_gb:.1f} GB; {CACHE_GB} GB cache, "
              f"{DISK_GBS} GB/s disk, {MEM_GBS} GB/s memory per machine; call {args.call_ms} ms")
        for alpha_name, a in ALPHAS.items():
            print(f"\n{alpha_name}: tok/s (round trips+transfer / disk reads / compute, ms per token)")
            print("| link | " + " | ".join(f"{n} machine{'s' if n > 1 else ''}" for n in MACHINES) + " |")
            print("|---|" + "---|" * len(MACHINES))
            for link in LINKS_GBIT:
                cells = []
                for n in MACHINES:
                    r = token_ms(m, n, link, args.call_ms, a)
                    out.setdefault(name, {}).setdefault(alpha_name, {}).setdefault(f"{link}Gb", {})[n] = r
                    cells.append(f"{1e3 / r['per_token_ms']:.2f} (h {r['hit_rate']:.2f}: {r['round_trip_ms']:.0f}/"
                                 f"{r['read_ms']:.0f}/{r['compute_ms']:.0f})")
                print(f"| {link} Gb/s | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(call_ms=args.call_ms, models=MODELS, results=out), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
