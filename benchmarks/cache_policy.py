"""Eviction against Belady's optimum in the engine's layout (one global expert cache), on
every routing trace we have: the real OLMoE trace and the trained demo model's own routing
on a few Python prompts (tuning traces) and on four more prompts held out from tuning
(``HELD_OUT``, reported in their own table), recorded here with ``--trace-routing`` (router weights and the
engine's lookahead predictions included).

    python benchmarks/cache_policy.py [--tokens 300] [--olmoe PATH] [--keep DIR] [--json OUT] [--oracle]
                                      [--horizon]

For each trace and each cache size (1, 1.5, 2, 3 and 4 times one token's working set), the
hit rate of LRU, of ``lfru:router=0,cross=0`` (the default before issue 18), of
``lfru:cross=0`` (the default before issue 30), of the default ``lfru`` (which guesses the next
pass's experts from the router's ranking, and lets a cold fresh key of another layer go before
a stale key its layer keeps using; the OLMoE trace records no router probabilities, so there the
router guesses change nothing), of ``ulfru``, each also hearing the lookahead's predictions
(``--predictions hint``; demo traces only) and of Belady, each with its fraction of Belady and
its hits. Every replay is ``sluice trace-replay``'s, which drives the
engine's own ``ExpertCache`` and ``ExpertProvider`` (docs/cache-policy.md). ``--oracle`` adds
bounds: ``lfru:router=0`` told the true experts of the next layer, or of every layer still to
come in the token, before each layer runs (what a perfect lookahead could tell it), and also
each layer's true experts of the next one or two tokens once it has run (a perfect next-token
predictor). ``--horizon`` adds the bounds of ``HorizonBelady`` (``sluice.replay``): the default
told the future exactly for the rest of the token and the next 1, 2 or 4 tokens, and Belady's
rule applied inside that horizon; and told the next token's experts with a recall of 0.25, 0.5
or 0.75 (a chance per future use). Each table ends with the mean over its traces.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import sluice
from sluice.demo import SHIPPED_MODEL
from sluice.experts.policy_spec import make_policy
from sluice.replay import CacheSim, HorizonBelady, replay
from sluice.trace import Trace, read_trace

PROMPTS = {
    "demo-main": "import os\nimport sys\n\n\ndef main(argv):\n",
    "demo-lru": 'class LRUCache:\n    """A least-recently-used cache with a fixed capacity."""\n\n'
                "    def __init__(self, capacity):\n",
    "demo-config": 'import json\nfrom pathlib import Path\n\n\ndef load_config(path):\n'
                   '    """Read a JSON config file and return a dict."""\n',
    "demo-sort": "def quicksort(items):\n    if len(items) <= 1:\n        return items\n",
}
# Held out from tuning (issue 30): recorded and named before ``ulfru`` was tuned on the traces
# above (OLMoE and PROMPTS); docs/cache-policy.md reports them in their own table.
HELD_OUT = {
    "held-test": "import pytest\n\n\ndef test_parse_empty():\n",
    "held-prose": "# Notes on the release\n\nThis release changes how the server handles",
    "held-async": "import asyncio\n\n\nasync def fetch_all(urls, limit=8):\n",
    "held-data": 'data = {\n    "name": "example",\n    "values": [',
}
MULTIPLES = (1.0, 1.5, 2.0, 3.0, 4.0)
OLD = "lfru:router=0,cross=0"  # the default before the router's next-ranked experts were guessed (issue 18)
PREV = "lfru:cross=0"  # the default before a cold fresh key of another layer could go first (issue 30)
HORIZONS = ((0, 1.0), (1, 1.0), (2, 1.0), (4, 1.0), (1, 0.25), (1, 0.5), (1, 0.75))
ROOT = Path(__file__).resolve().parents[1]
OLMOE = [ROOT / "tests" / "data" / "olmoe-1b-7b_299tok.jsonl",
         ROOT.parent / "shared" / "traces" / "olmoe-1b-7b_299tok.jsonl"]


def record(prompt: str, tokens: int, out: Path) -> Trace:
    """The demo model's decode-time routing for ``prompt`` (temperature 0.7, seed 0, as the
    OLMoE trace was sampled; prefill excluded)."""
    with sluice.load(SHIPPED_MODEL, memory="4GiB", trace_routing=str(out), progress=False) as engine:
        engine.generate(prompt, max_new_tokens=tokens, temperature=0.7, seed=0, ignore_eos=True)
    return read_trace(out)


def oracle(trace: Trace, spec: str, capacity: int, horizon: int, tokens: int = 0) -> tuple[int, int]:
    """(hits, lookups) of ``spec`` in a global cache when, before each layer runs, the policy is
    told the true experts of the next ``horizon`` layers of the same token (a perfect lookahead;
    an upper bound on what predictions within a token can give a policy), and with ``tokens``,
    after each layer has run, the experts it will use at the next ``tokens`` tokens (a perfect
    next-token predictor, told as a prediction: protected until the layer's next pass). The
    router probabilities are not replayed (``spec`` hears no ``ranked``)."""
    sim = CacheSim(capacity * trace.layers, make_policy(spec), trace.experts)
    steps = trace.steps
    for t, step in enumerate(steps):
        sim.tick()
        for layer, ids in enumerate(step):
            for ahead in range(layer + 1, min(trace.layers, layer + 1 + horizon)):
                sim.cache.policy.predict(ahead, step[ahead])
            sim.run_layer(layer, ids)
            if tokens:
                sim.cache.policy.predict(layer, sorted({e for later in steps[t + 1 : t + 1 + tokens]
                                                        for e in later[layer]}))
    return sim.provider.counters.hits, sim.provider.counters.lookups


def horizon_label(horizon: int, recall: float) -> str:
    what = "the rest of the token" if horizon == 0 else f"the next {horizon} token{'s' if horizon > 1 else ''}"
    return f"lfru + Belady within {what}" + ("" if recall >= 1.0 else f", recall {recall:g}")


def rows(name: str, trace: Trace, with_oracle: bool, with_horizon: bool = False) -> list[dict]:
    caps = [round(m * trace.top_k) for m in MULTIPLES]
    belady = [replay(trace, "belady", c, "global") for c in caps]
    runs = [("lru", "off"), (OLD, "off"), (PREV, "off"), ("lfru", "off"), ("ulfru", "off")]
    if trace.pred is not None:
        runs += [(OLD, "hint"), ("lfru", "hint"), ("ulfru", "hint")]
    if with_horizon:
        runs += [("lfru", f"horizon:{h}:{r}") for h, r in HORIZONS]
    if with_oracle:
        runs += [(OLD, "oracle:1:0"), (OLD, f"oracle:{trace.layers}:0"), (OLD, f"oracle:{trace.layers}:1"),
                 (OLD, f"oracle:{trace.layers}:2")]
    out = []
    for spec, mode in runs + [("belady", "off")]:
        for c, b in zip(caps, belady):
            if mode.startswith("horizon"):
                h, r = int(mode.split(":")[1]), float(mode.split(":")[2])
                res = replay(trace, lambda: HorizonBelady(trace, h, make_policy(spec), recall=r), c, "global")
                hits, lookups, label = res.hits, res.lookups, horizon_label(h, r)
            elif mode.startswith("oracle"):
                horizon, tokens = (int(v) for v in mode.split(":")[1:])
                hits, lookups = oracle(trace, spec, c, horizon, tokens)
                label = (f"{spec} + perfect lookahead, {'next layer' if horizon == 1 else 'rest of the token'}"
                         if not tokens else f"{spec} + perfect next {'token' if tokens == 1 else f'{tokens} tokens'}")
            else:
                r = b if spec == "belady" else replay(trace, spec, c, "global", predictions=mode)
                hits, lookups, label = r.hits, r.lookups, r.policy
            out.append({"trace": name, "policy": label, "multiple": c / trace.top_k, "slots": c * trace.layers,
                        "hits": hits, "lookups": lookups, "hit_rate": hits / lookups,
                        "of_belady": hits / b.hits if b.hits else 0.0})
        print(f"  {name}: {spec} {mode} done", file=sys.stderr, flush=True)
    return out


def table(results: list[dict], traces: dict[str, Trace]) -> str:
    head = "| trace | policy | " + " | ".join(f"{m:g}x" for m in MULTIPLES) + " |"
    lines = [head, "|---|---|" + "---:|" * len(MULTIPLES)]
    for name, trace in traces.items():
        by_policy: dict[str, list[dict]] = {}
        for r in results:
            if r["trace"] == name:
                by_policy.setdefault(r["policy"], []).append(r)
        label = f"{name} (reuse {trace.reuse():.3f}" + (
            f", recall {trace.prediction_recall():.3f})" if trace.pred is not None else ")")
        for i, (policy, rs) in enumerate(by_policy.items()):
            cells = [f"{r['hit_rate']:.3f} {r['hits']}" if policy == "belady"
                     else f"{r['hit_rate']:.3f} ({r['of_belady']:.3f}) {r['hits']}" for r in rs]
            lines.append(f"| {label if i == 0 else ''} | {policy} | " + " | ".join(cells) + " |")
    mean: dict[str, list[list[float]]] = {}
    for r in results:
        if r["trace"] in traces and r["policy"] != "belady":
            cols = mean.setdefault(r["policy"], [[] for _ in MULTIPLES])
            cols[MULTIPLES.index(r["multiple"])].append(r["of_belady"])
    for i, (policy, cols) in enumerate(mean.items()):
        cells = [f"{sum(c) / len(c):.3f}" if len(c) == len(traces) else "" for c in cols]
        lines.append(f"| {'**mean** (of Belady)' if i == 0 else ''} | {policy} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=300, help="decode tokens per demo trace (default 300)")
    ap.add_argument("--olmoe", type=Path, default=None, help="the OLMoE routing trace (default: tests/data)")
    ap.add_argument("--keep", type=Path, default=None, help="write the demo traces here (default: a temp dir)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results as JSON")
    ap.add_argument("--oracle", action="store_true",
                    help="add lfru told the true experts of the next layer / of the rest of the token")
    ap.add_argument("--horizon", action="store_true",
                    help="add the bounds of Belady's rule within a horizon of the next 0-4 tokens (HorizonBelady)")
    args = ap.parse_args()
    olmoe = args.olmoe or next((p for p in OLMOE if p.exists()), None)
    traces: dict[str, Trace] = {}
    if olmoe is not None and olmoe.exists():
        traces["olmoe"] = read_trace(olmoe)
    else:
        print("OLMoE trace not found (give --olmoe PATH): demo traces only", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        where = args.keep or Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        for name, prompt in {**PROMPTS, **HELD_OUT}.items():
            traces[name] = record(prompt, args.tokens, where / f"{name}.jsonl")
    results = [r for name, trace in traces.items() for r in rows(name, trace, args.oracle, args.horizon)]
    tuning = [n for n in traces if n not in HELD_OUT]
    for title, names in (("tuning traces", tuning), ("held-out traces", list(HELD_OUT))):
        print(f"\n{title}\n")
        print(table(results, {n: traces[n] for n in names}))
    if args.json:
        args.json.write_text(json.dumps({"multiples": MULTIPLES, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
