"""How realistic is the shipped demo model's routing? Its decode-time routing trace, side by
side with a real OLMoE trace and with the same architecture on random weights.

    python benchmarks/routing_realism.py [--tokens 300] [--olmoe PATH] [--json OUT]

For each trace: next-token same-layer expert reuse (and what independent uniform routing
would give, top-k / experts), per-expert frequency skew (the share of lookups that go to the
hottest eighth of a layer's experts; normalised entropy of the per-layer load), and the hit
rates of LRU, Sluice's default policy (lfru) and Belady's optimum replayed with per-layer
caches of 2x top-k slots (a quarter of the experts for both the demo model and OLMoE).

The demo trace is written by Sluice itself (``--trace-routing``), sampling at temperature 0.7
with seed 0 as the OLMoE trace was recorded; prefill is excluded in both.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

import sluice
from sluice.demo import SHIPPED_MODEL
from sluice.replay import replay
from sluice.trace import Trace, read_trace

PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n"
DEFAULT_OLMOE = Path(__file__).resolve().parents[1] / "tests" / "data" / "olmoe-1b-7b_299tok.jsonl"


def sluice_trace(model: Path, tokens: int, out: Path) -> Trace:
    engine = sluice.load(model, memory="4GiB", trace_routing=str(out), progress=False)
    engine.generate(PROMPT, max_new_tokens=tokens, temperature=0.7, seed=0, ignore_eos=True)
    engine.close()
    return read_trace(out)


def random_twin(dst: Path) -> Path:
    """The demo model's exact architecture with random weights (Sluice's synthetic writer)."""
    import shutil

    import torch

    from sluice.synthetic import write_model

    cfg = json.loads((SHIPPED_MODEL / "config.json").read_text())
    write_model(dst, cfg, dtype=torch.float32, progress=False, tokenizer=False)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SHIPPED_MODEL / name, dst / name)
    return dst


def skew(trace: Trace) -> dict:
    counts = trace.counts()
    n_exp, hot = trace.experts, max(1, trace.experts // 8)
    shares, entropies = [], []
    for layer in range(trace.layers):
        c = sorted((counts.get((layer, e), 0) for e in range(n_exp)), reverse=True)
        total = sum(c)
        shares.append(sum(c[:hot]) / total)
        p = [x / total for x in c if x]
        entropies.append(-sum(x * math.log(x) for x in p) / math.log(n_exp))
    return {"hot_eighth_share": sum(shares) / len(shares), "load_entropy": sum(entropies) / len(entropies)}


def row(name: str, trace: Trace) -> dict:
    cap = 2 * trace.top_k
    r = {"trace": name, "tokens": trace.tokens, "layers": trace.layers, "experts": trace.experts,
         "top_k": trace.top_k, "reuse": trace.reuse(), "reuse_if_uniform": trace.top_k / trace.experts,
         "capacity_per_layer": cap, **skew(trace)}
    for policy in ("lru", "lfru", "belady"):
        r[policy] = replay(trace, policy, cap, scope="layer").hit_rate
    return r


def markdown(rows: list[dict]) -> str:
    lines = [
        "| trace | tokens | layers x experts, top-k | next-token reuse (uniform would give) "
        "| hottest 1/8 of experts' share of lookups | load entropy (1 = uniform) | cache per layer "
        "| LRU | lfru (default) | Belady |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['trace']} | {r['tokens']} | {r['layers']} x {r['experts']}, top-{r['top_k']} | "
            f"{r['reuse']:.3f} ({r['reuse_if_uniform']:.3f}) | {r['hot_eighth_share']:.3f} "
            f"({1 / 8:.3f} if uniform) | {r['load_entropy']:.3f} | {r['capacity_per_layer']} "
            f"({r['capacity_per_layer'] / r['experts']:.0%}) | {r['lru']:.3f} | {r['lfru']:.3f} | {r['belady']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=300, help="decode tokens to trace (default 300)")
    ap.add_argument("--olmoe", type=Path, default=DEFAULT_OLMOE, help="the OLMoE routing trace (JSONL)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        rows.append(row("Sluice demo model (trained), via --trace-routing",
                        sluice_trace(SHIPPED_MODEL, args.tokens, tmp / "demo.jsonl")))
        rows.append(row("same architecture, random weights",
                        sluice_trace(random_twin(tmp / "random"), args.tokens, tmp / "random.jsonl")))
    if args.olmoe.is_file():
        rows.append(row("OLMoE-1B-7B (real trace, tests/data)", read_trace(args.olmoe)))
    else:
        print(f"[routing] no OLMoE trace at {args.olmoe}; pass --olmoe", file=sys.stderr)
    print(markdown(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
