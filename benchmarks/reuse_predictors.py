"""What predicts next-token reuse of an expert (issue 18 §2): studied on routing traces that
record the router's probabilities of all experts (``--trace-routing`` writes them).

    python benchmarks/reuse_predictors.py [TRACE ...] [--tokens 300] [--hidden]

Without TRACE files, records the trained demo model's four traces of benchmarks/cache_policy.py
(temperature 0.7, seed 0). Per trace:

* the chance that layer l uses expert e at token t+1, by e's rank in token t's router
  probabilities at layer l (ranks 1..k are the routed experts: that is next-token reuse);
* for the *stale* keys (not routed at t: the eviction candidates), how well each signal ranks
  those used at t+1 (and within 4 tokens) above those not: the area under the ROC curve of
  the router probability at t, decayed hotness (half-lives 4, 16, 64, as ``lfru`` keeps it),
  recency, and combinations.

``--hidden`` (transformers, demo model): how well layer l's router applied to token t's
residual stream at each depth predicts token t+1's experts at layer l (recall of the top-k and
top-2k), against plain reuse and against the router applied to the *next* token's embedding
(known only once it is sampled).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

from sluice.trace import Trace, read_trace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cache_policy import PROMPTS, record  # noqa: E402


def auc(pos: np.ndarray, neg: np.ndarray) -> float:
    """P(a random positive scores above a random negative), ties counted half."""
    both = np.concatenate([pos, neg])
    order = both.argsort(kind="stable")
    ranks = np.empty(len(both))
    sorted_v = both[order]
    i = 0
    while i < len(sorted_v):
        j = i
        while j + 1 < len(sorted_v) and sorted_v[j + 1] == sorted_v[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return float((ranks[: len(pos)].sum() - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg)))


def study(name: str, trace: Trace) -> None:
    if trace.probs is None:
        print(f"{name}: no router probabilities recorded (re-record with --trace-routing)")
        return
    k, n_e, n_l = trace.top_k, len(trace.probs[0][0]), trace.layers
    probs = np.array(trace.probs)  # [T, L, E]
    t_n = len(trace.steps)
    used = np.zeros((t_n, n_l, n_e), bool)
    for t, step in enumerate(trace.steps):
        for layer, ids in enumerate(step):
            used[t, layer, ids] = True
    rank = (-probs).argsort(-1, kind="stable").argsort(-1)
    cur, nxt, rk = used[:-1], used[1:], rank[:-1]
    buckets = [(0, k), (k, 2 * k), (2 * k, 3 * k), (3 * k, n_e)]
    cells = [f"{lo + 1}-{hi}: {nxt[(rk >= lo) & (rk < hi)].mean():.3f}" for lo, hi in buckets if lo < n_e]
    print(f"{name} (reuse {trace.reuse():.3f}): P(used at t+1 | router rank at t)  " + "  ".join(cells))

    def hotness(half_life: float) -> np.ndarray:
        out, h, a = np.zeros((t_n, n_l, n_e)), np.zeros((n_l, n_e)), 0.5 ** (1 / half_life)
        for t in range(t_n):
            h = h * a + used[t]
            out[t] = h
        return out[:-1]

    last, seen = np.zeros((t_n, n_l, n_e)), np.full((n_l, n_e), -1e9)
    for t in range(t_n):
        seen = np.where(used[t], t, seen)
        last[t] = t - seen
    soon = np.zeros_like(cur)
    for d in range(1, 5):
        soon[: t_n - 1 - d + 1] |= used[d:]
    hot = {h: hotness(h) for h in (4, 16, 64)}
    p = probs[:-1]
    signals = [("router p", p), ("hot4", hot[4]), ("hot16", hot[16]), ("hot64", hot[64]), ("recency", -last[:-1]),
               ("hot16 + p", hot[16] + p), ("hot16 + 10p", hot[16] + 10 * p),
               ("log hot16 + 0.2 log p", np.log(hot[16] + 1e-3) + 0.2 * np.log(p + 1e-6))]
    stale = ~cur
    y1, y4 = nxt[stale], soon[stale]
    print("  stale keys, AUC (used at t+1 / within 4 tokens): " + "  ".join(
        f"{n} {auc(x[stale][y1], x[stale][~y1]):.3f}/{auc(x[stale][y4], x[stale][~y4]):.3f}" for n, x in signals))


def hidden(tokens: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sluice.demo import SHIPPED_MODEL

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(SHIPPED_MODEL, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(SHIPPED_MODEL)
    n_l, k = model.config.num_hidden_layers, model.config.num_experts_per_tok
    layers = model.model.layers

    def route(layer: int, h: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(layers[layer].post_attention_layernorm(h), layers[layer].mlp.gate.weight)

    agg: dict = {}
    for prompt in PROMPTS.values():
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            seq = model.generate(ids, max_new_tokens=tokens, do_sample=True, temperature=0.7, top_k=0, top_p=1.0)
            gate_in: dict = {}
            hooks = [layers[i].mlp.gate.register_forward_hook(
                lambda mod, inp, out, i=i: gate_in.__setitem__(i, inp[0].detach())) for i in range(n_l)]
            out = model(seq, output_hidden_states=True)
            for hk in hooks:
                hk.remove()
            n0, t_n = ids.shape[1], seq.shape[1]
            for layer in range(n_l):
                true = torch.nn.functional.linear(gate_in[layer], layers[layer].mlp.gate.weight).view(t_n, -1)
                true = [set(r) for r in true.topk(k).indices.tolist()]
                span = range(n0, t_n - 1)
                agg.setdefault((layer, "reuse"), []).extend(len(true[t] & true[t + 1]) / k for t in span)
                emb = route(layer, out.hidden_states[0][0]).topk(k).indices.tolist()
                agg.setdefault((layer, "embed"), []).extend(len(set(emb[t + 1]) & true[t + 1]) / k for t in span)
                for depth in range(n_l + 1):
                    guess = route(layer, out.hidden_states[depth][0]).topk(2 * k).indices.tolist()
                    for kk in (k, 2 * k):
                        agg.setdefault((layer, depth, kk), []).extend(
                            len(set(guess[t][:kk]) & true[t + 1]) / k for t in span)
    print("\nrecall of token t+1's experts at layer l (demo model, HF, 4 prompts): reuse of t's experts; "
          "layer l's router on the next token's embedding; on token t's stream at depth j (top-k / top-2k)")
    for layer in range(n_l):
        cells = " ".join(f"j{d} {np.mean(agg[(layer, d, k)]):.2f}/{np.mean(agg[(layer, d, 2 * k)]):.2f}"
                         for d in range(n_l + 1))
        print(f"  layer {layer}: reuse {np.mean(agg[(layer, 'reuse')]):.3f}  next embedding "
              f"{np.mean(agg[(layer, 'embed')]):.3f}  | {cells}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="*", type=Path, help="routing traces with router probabilities")
    ap.add_argument("--tokens", type=int, default=300, help="decode tokens per demo trace (default 300)")
    ap.add_argument("--hidden", action="store_true", help="also the hidden-state study (transformers)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        traces = {p.stem: read_trace(p) for p in args.traces} or {
            name: record(prompt, args.tokens, Path(tmp) / f"{name}.jsonl") for name, prompt in PROMPTS.items()}
        for name, trace in traces.items():
            study(name, trace)
    if args.hidden:
        hidden(args.tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
