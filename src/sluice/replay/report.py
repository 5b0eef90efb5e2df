"""``sluice trace-replay``: the sweep's report (text or JSON) and the command's arguments."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import InvalidArgumentError
from ..experts.policy_spec import make_policy
from ..trace import Trace
from .policies import STUDY_POLICIES
from .sim import SCOPES, ReplayResult, capacities_for, sweep
from .synthetic import SyntheticSpec, synthetic_trace

DEFAULT_POLICIES = ("lru", "lfru")


# -- reports ---------------------------------------------------------------------------------


def describe(trace: Trace) -> dict:
    d = {"source": trace.source, "tokens": trace.tokens, "layers": trace.layers, "experts": trace.experts,
         "top_k": trace.top_k, "working_set": trace.top_k * trace.layers, "lookups": trace.lookups,
         "next_token_reuse": trace.reuse()}
    if trace.pred is not None:
        d["prediction_recall"] = trace.prediction_recall()
    if trace.seq is not None or trace.step is not None:
        d["sequences"] = len(trace.sequences())
        d["engine_steps"] = len(trace.groups())
    return d


@dataclass
class Report:
    trace: dict
    semantics: str
    capacities: list[dict]
    results: list[ReplayResult] = field(default_factory=list)
    pins: dict | None = None

    def as_json(self) -> dict:
        return {"trace": self.trace, "semantics": self.semantics, "capacities": self.capacities,
                "results": [r.as_dict() for r in self.results], "pins": self.pins}


def build_report(trace: Trace, policies: Sequence[str], capacities: Sequence[int], scopes: Sequence[str] = SCOPES,
                 semantics: str = "engine", pins: Sequence[tuple[int, int]] = (), pins_source: str = "",
                 predictions: str = "off") -> Report:
    k, layers = trace.top_k, trace.layers
    caps = [{"experts_per_layer": c, "multiple": c / k, "global_slots": c * layers} for c in capacities]
    rep = Report(describe(trace), semantics, caps,
                 sweep(trace, policies, capacities, scopes, semantics, pins=pins, predictions=predictions))
    if pins:
        rep.pins = {"count": len(pins), "source": pins_source}
    return rep


def render(rep: Report) -> str:
    t = rep.trace
    lines = [
        f"trace: {t['source']}",
        f"  {t['tokens']} tokens, {t['layers']} layers, {t['experts']} experts, top-{t['top_k']}: working set "
        f"{t['working_set']} experts/token; next-token same-layer reuse {t['next_token_reuse']:.3f}",
        f"  semantics: {rep.semantics}" + (
            " (a layer's experts are looked up, then pinned while its misses are fetched)"
            if rep.semantics == "engine" else " (each access fetched on its own in id order: only it is pinned)"),
    ]
    if t.get("sequences", 1) > 1 or t.get("engine_steps", t["tokens"]) != t["tokens"]:
        lines.append(f"  {t['sequences']} sequences in {t['engine_steps']} engine steps: each step's rows are "
                     "looked up together, as the engine did (--sequence N: one alone)")
    if "prediction_recall" in t:
        lines.append(f"  lookahead predictions recorded: recall {t['prediction_recall']:.3f} "
                     "(+hint: the policy hears them; +prefetch: they are read ahead too)")
    if rep.pins:
        lines.append(f"  pins: {rep.pins['count']} keys from {rep.pins['source']}")
    caps = [c["experts_per_layer"] for c in rep.capacities]
    names = list(dict.fromkeys(r.policy for r in rep.results))
    width = max([len(n) for n in names] + [16])
    for scope in dict.fromkeys(r.scope for r in rep.results):
        lines.append("")
        layers = t["layers"]
        lines.append("per-layer caches (each layer its own C slots)" if scope == "layer"
                     else f"global cache ({layers} x C slots in one pool)")
        lines.append(f"  {'experts/layer C':<{width}}" + "".join(f"{c:>8}" for c in caps))
        if scope == "global":
            lines.append(f"  {'slots':<{width}}" + "".join(f"{c * layers:>8}" for c in caps))
        lines.append(f"  {'x working set':<{width}}" + "".join(f"{c['multiple']:>7.2g}x" for c in rep.capacities))
        got = {(r.policy, r.capacity): r for r in rep.results if r.scope == scope}
        for name in names:
            cells = [got.get((name, c)) for c in caps]
            lines.append(f"  {name:<{width}}" + "".join(f"{r.hit_rate:>8.3f}" if r else f"{'-':>8}" for r in cells))
    return "\n".join(lines)


def parse_capacities(text: str) -> list[int]:
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            v = int(part)
        except ValueError:
            raise InvalidArgumentError(f"--capacity: {part!r} is not a whole number of experts per layer") from None
        if v < 1:
            raise InvalidArgumentError(f"--capacity: {v} must be at least 1")
        out.append(v)
    if not out:
        raise InvalidArgumentError("--capacity: give at least one capacity, e.g. 8,16,32")
    return sorted(set(out))


def parse_slice(text: str) -> tuple[int | None, int | None]:
    """``"150:"``, ``":150"``, ``"10:20"`` -> python slice bounds over tokens."""
    a, sep, b = text.partition(":")
    if not sep:
        raise InvalidArgumentError(f"--tokens {text!r}: expected START:STOP (either may be empty)")
    try:
        return (int(a) if a.strip() else None, int(b) if b.strip() else None)
    except ValueError:
        raise InvalidArgumentError(f"--tokens {text!r}: START and STOP must be integers") from None


def run_cli(args) -> int:
    """``sluice trace-replay``: see ``cli.py`` for the arguments."""
    from ..trace import hottest, read_pins, read_trace, write_pins

    if (args.trace is None) == (args.synthetic is None):
        raise InvalidArgumentError("give a trace file or --synthetic SPEC (one of the two)")
    trace = read_trace(args.trace) if args.trace else synthetic_trace(SyntheticSpec.parse(args.synthetic))
    seq = getattr(args, "sequence", None)
    if seq is not None:
        if seq not in trace.sequences():
            raise InvalidArgumentError(f"--sequence {seq}: {trace.source} has sequences "
                                       f"{', '.join(map(str, trace.sequences()))}")
        trace = trace.of_sequence(seq)
        trace.source += f" [sequence {seq}]"
    if args.tokens:
        start, stop = parse_slice(args.tokens)
        trace = trace.slice(start, stop)
        trace.source += f" [tokens {args.tokens}]"
        if not trace.steps:
            raise InvalidArgumentError(f"--tokens {args.tokens} selects no tokens")
    if args.pin_count is not None and not args.write_pins:
        raise InvalidArgumentError("--pin-count goes with --write-pins FILE")
    if args.write_pins:
        if not args.pin_count or args.pin_count < 1:
            raise InvalidArgumentError("--write-pins needs --pin-count N (N >= 1)")
        pins = hottest(trace, args.pin_count)
        counts = trace.counts()
        write_pins(args.write_pins, pins, [p for p in (args.trace, args.pins) if p],  # never over an input
                   source=trace.source, tokens=trace.tokens,
                   uses=[counts[p] for p in pins])
        if not args.json:
            print(f"wrote {len(pins)} pins ({sum(counts[p] for p in pins)} of {trace.lookups} uses) "
                  f"to {args.write_pins}")
    pins = read_pins(args.pins) if args.pins else ()
    caps = parse_capacities(args.capacity) if args.capacity else capacities_for(trace)
    policies = args.policy or list(DEFAULT_POLICIES)
    for spec in policies:
        if spec != "belady":
            try:
                make_policy(spec, STUDY_POLICIES)
            except ValueError as e:
                raise InvalidArgumentError(f"--policy: {e}") from None
    scopes = SCOPES if args.scope == "both" else (args.scope,)
    predictions = getattr(args, "predictions", "off")
    if predictions != "off" and trace.pred is None:
        raise InvalidArgumentError(f"--predictions {predictions}: {trace.source} records no lookahead "
                                   "predictions (traces written by --trace-routing do)")
    rep = build_report(trace, [p for p in policies if p != "belady"], caps, scopes, args.semantics, pins,
                       args.pins or "", predictions)
    print(json.dumps(rep.as_json(), indent=1) if args.json else render(rep))
    return 0
