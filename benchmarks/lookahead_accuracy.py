"""How well the router lookahead predicts a layer's experts, one and two layers ahead.

    PYTHONPATH=src python benchmarks/lookahead_accuracy.py [MODEL] [--tokens 300] [--json OUT]

MODEL defaults to the trained demo model (``demo``). For each prompt (the four Python
prompts of ``benchmarks/cache_policy.py``, temperature 0.7, seed 0) the engine decodes with
its lookahead on; every prediction it makes (``CausalLM.predict_weights`` after a layer's
attention, for the next layer and the one after it) is checked against the layer's real
routing of that token. Decode tokens only (the prefill's forward is not counted).

Reported per distance: recall (the share of routed experts that were predicted; with
``K`` guesses for ``K`` routed experts per row this is also the precision), the share of
the routing weight the predicted experts carry, and, per router-probability threshold, the
share of guesses kept, their precision and the recall left (what ``PrefetchOptions.min_prob``
would trade).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

_SRC = Path(__file__).resolve().parent.parent / "src"
if str(_SRC) not in sys.path:
    sys.path.insert(0, str(_SRC))

import sluice  # noqa: E402
from sluice.demo import SHIPPED_MODEL  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cache_policy import PROMPTS  # noqa: E402

THRESHOLDS = (0.0, 0.05, 0.1, 0.2, 0.3)


def measure(model, prompt: str, tokens: int) -> dict:
    engine = sluice.load(model, memory="4GiB", progress=False, prefetch=sluice.PrefetchOptions(depth=2))
    guesses: dict[tuple[int, int], list[tuple[int, list[tuple[int, float]]]]] = {}
    step = [0]
    decoding = [False]
    source = [0]  # the layer whose attention just ran (the lookahead's own argument)
    real_predict = engine.model.predict_weights
    real_lookahead = engine.lookahead.after_attention

    def lookahead(layer, h, ctx):
        source[0] = layer
        return real_lookahead(layer, h, ctx)

    def predict_weights(layer, h):
        got = real_predict(layer, h)
        if got is not None and h.shape[0] == 1 and decoding[0]:
            ids, probs = got
            guesses.setdefault((step[0], layer), []).append(
                (layer - source[0], list(zip(ids[0].tolist(), probs[0].tolist()))))
        return got

    routed: dict[tuple[int, int], list[tuple[int, float]]] = {}
    provider = engine.experts
    real_moe = provider.moe

    def moe(layer, x, ids, weights, *args, **kw):
        if x.shape[0] == 1 and decoding[0]:
            routed[(step[0], layer)] = list(zip(ids[0].tolist(), weights[0].tolist()))
        return real_moe(layer, x, ids, weights, *args, **kw)

    engine.model.predict_weights = predict_weights
    engine.lookahead.after_attention = lookahead
    provider.moe = moe
    ids = engine.encode(prompt)
    n = 0
    for _out in engine.stream(ids, max_new_tokens=tokens, temperature=0.7, seed=0, ignore_eos=True):
        decoding[0] = True  # the first step (prefill) is done once the first token comes out
        step[0] += 1
        n += 1
    engine.close()
    return tally(guesses, routed)


def tally(guesses, routed) -> dict:
    out = {}
    for distance in (1, 2):
        hits = total = 0
        wmass = wtotal = 0.0
        kept = {t: [0, 0] for t in THRESHOLDS}  # threshold -> [guesses kept, of them right]
        for (s, layer), per in guesses.items():
            for d, guess in per:
                if d != distance:
                    continue
                truth = routed.get((s, layer))  # the routing of the layer guessed for, same step
                if truth is None:
                    continue
                used = {e for e, _ in truth}
                g = {e for e, _ in guess}
                hits += len(used & g)
                total += len(used)
                wmass += sum(w for e, w in truth if e in g)
                wtotal += sum(w for _, w in truth)
                for t in THRESHOLDS:
                    for e, p in guess:
                        if p >= t:
                            kept[t][0] += 1
                            kept[t][1] += e in used
        n_guess = sum(len(g) for per in guesses.values() for d, g in per if d == distance)
        out[f"ahead{distance}"] = {
            "recall": hits / total if total else None,
            "weight_recall": wmass / wtotal if wtotal else None,
            "thresholds": {str(t): {"kept": kept[t][0] / n_guess if n_guess else 0.0,
                                    "precision": kept[t][1] / kept[t][0] if kept[t][0] else None,
                                    "recall": kept[t][1] / total if total else None} for t in THRESHOLDS},
            "routed": total,
        }
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=str(SHIPPED_MODEL))
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    results = {name: measure(args.model, prompt, args.tokens) for name, prompt in PROMPTS.items()}
    print("| prompt | distance | recall | weight recall | " + " | ".join(
        f"p >= {t}: kept / precision / recall" for t in THRESHOLDS[1:]) + " |")
    print("|---|---|---:|---:|" + "---:|" * (len(THRESHOLDS) - 1))
    for name, res in results.items():
        for dist in ("ahead1", "ahead2"):
            r = res[dist]
            cells = " | ".join(f"{r['thresholds'][str(t)]['kept']:.2f}"
                               f" / {r['thresholds'][str(t)]['precision'] or 0:.2f}"
                               f" / {r['thresholds'][str(t)]['recall']:.2f}" for t in THRESHOLDS[1:])
            print(f"| {name} | {dist[-1]} | {r['recall']:.3f} | {r['weight_recall']:.3f} | {cells} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
