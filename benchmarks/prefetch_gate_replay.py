"""Hit rates with the prefetch admission gate on replayed routing traces, against no prefetch.

    PYTHONPATH=src python benchmarks/prefetch_gate_replay.py TRACE.jsonl [TRACE.jsonl ...]

Each trace must record the lookahead's predictions (``--trace-routing`` writes them; the
command in docs/io.md records two from the trained demo model). The replay drives the engine's
own cache and provider (``sluice.replay``; reads complete at once, so a prefetch that its
layer uses counts as a hit) in the engine's layout (one global cache), ``lfru``, at 1-4x one
token's working set, three ways: no prefetch; prefetch with lfru's fixed rule (``gate=0``: a
guess evicts only a stale key colder than 0.25); prefetch with the admission gate. A trace
records which experts were predicted but not the router's probability of each, so every
guess is given the trace's own one-ahead precision (its recall: with K guesses for K experts
they are equal) as its probability. Reported: hit rate, speculative reads and how many of
them the layer used (the rest are wasted reads), and expert reads per token (misses plus
speculative reads: what the disk or link carries).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

_SRC = Path(__file__).resolve().parent.parent / "src"
if str(_SRC) not in sys.path:
    sys.path.insert(0, str(_SRC))

from sluice.replay import sim as replay_sim  # noqa: E402
from sluice.trace import read_trace  # noqa: E402

MULTIPLES = (1.0, 1.5, 2.0, 3.0, 4.0)


def _with_probability(p: float):
    def predict(self, layer, experts, read):
        self.provider.prefetch(layer, list(experts), read=read, probs=[p] * len(experts))
    return predict


def reads(r, trace) -> float:
    return (r.lookups - r.hits + r.prefetch_reads) / max(1, trace.tokens)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+")
    args = ap.parse_args(argv)
    plain = replay_sim.CacheSim.predict
    print("| trace | x working set | no prefetch: hit rate | fixed rule: hit rate, reads (used) "
          "| gate: hit rate, reads (used) | gate - no prefetch | expert reads per token: none / fixed / gate |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for path in args.traces:
        trace = read_trace(path)
        if trace.pred is None:
            raise SystemExit(f"{path}: records no predictions (record it with --trace-routing)")
        p = trace.prediction_recall()
        for m in MULTIPLES:
            cap = max(trace.top_k, round(m * trace.top_k))
            replay_sim.CacheSim.predict = plain
            off = replay_sim.replay(trace, "lfru", cap, "global")
            fixed = replay_sim.replay(trace, "lfru:gate=0", cap, "global", predictions="prefetch")
            replay_sim.CacheSim.predict = _with_probability(p)
            gate = replay_sim.replay(trace, "lfru", cap, "global", predictions="prefetch")
            replay_sim.CacheSim.predict = plain
            print(f"| {Path(path).stem} (recall {p:.3f}) | {m:g} | {off.hit_rate:.3f} | {fixed.hit_rate:.3f}, "
                  f"{fixed.prefetch_reads} ({fixed.prefetch_used}) | {gate.hit_rate:.3f}, {gate.prefetch_reads} "
                  f"({gate.prefetch_used}) | {gate.hit_rate - off.hit_rate:+.3f} | {reads(off, trace):.2f} / "
                  f"{reads(fixed, trace):.2f} / {reads(gate, trace):.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
