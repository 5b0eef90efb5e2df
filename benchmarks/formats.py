"""Expert formats side by side: quality against the exact model, bytes per token, cold decode speed.

    python benchmarks/formats.py --model DIR [--formats bf16,int8,q4,mxfp4,rvq3] [--tokens 256]
    python benchmarks/formats.py --synthetic 2GB            # writes a synthetic Qwen3-MoE first
    python benchmarks/formats.py --model DIR --formats f32,f32/spine-int8 --budget 395MiB

A format ``FMT/spine-int8`` is the experts in FMT with the lossy int8 spine (``convert --spine int8``).

For every format the model is converted once (kept under --work), then, in this one process:
- quality, teacher-forced on the reference format's greedy output: top-1 agreement and the
  mean / max |logit difference| and the mean KL divergence KL(reference || format) of the
  next-token distributions at every generated position, and the free-running greedy
  agreement (identical prefix length / tokens);
- the relative reconstruction error of the expert weights (a sample of experts, dequantized);
- cold decode with the expert cache at one token's working set: tok/s and bytes read per token;
- with ``--budget``: the resident spine, the expert cache slots the planner gives at that budget
  (with one fixed baseline for every format, ``--baseline``, default: measured once at start) and
  the hit rate of a greedy decode with that cache.
Prints a markdown table and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import sluice  # before torch: it sets OpenMP's wait policy
import torch

from sluice.bench import drop_cache
from sluice.convert import convert
from sluice.demo import demo_config
from sluice.engine import ModelInfo, Options
from sluice.quant import assemble
from sluice.quant import FORMATS
from sluice.storage import AlignedBuffer
from sluice.synthetic import write_model
from sluice.sysmem import current_rss
from sluice.units import parse_size


def split(spec: str) -> tuple[str, str | None]:
    """"FMT" or "FMT/spine-int8" -> (expert format, spine format or None)."""
    fmt, _, spine = spec.partition("/spine-")
    return fmt, spine or None


def kl(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """Mean over positions of KL(softmax(ref) || softmax(logits)), in nats."""
    lp, lq = torch.log_softmax(ref_logits.double(), -1), torch.log_softmax(logits.double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1).mean().item()


def reconstruction_error(ref_box: Path, box: Path, fmt: str, samples: int = 6, seed: int = 0) -> float:
    """Relative Frobenius error of dequantized expert matrices against the reference container's."""
    a, b = ModelInfo(ref_box), ModelInfo(box)
    rng = random.Random(seed)
    keys = [(layer, e) for layer in a.desc.moe_layers for e in range(a.desc.n_experts)]
    num = den = 0.0
    for layer, e in rng.sample(keys, min(samples, len(keys))):
        wa = assemble(buf := AlignedBuffer(a.experts.slot_bytes), 0, a.experts.read(layer, e, buf))
        wb = assemble(buf2 := AlignedBuffer(b.experts.slot_bytes), 0, b.experts.read(layer, e, buf2))
        for role in a.desc.expert.matrix_shapes():
            ref = wa[role].float()
            got = wb[role].float() if isinstance(wb[role], torch.Tensor) else wb[role].dequantize()
            num += float((got - ref).pow(2).sum())
            den += float(ref.pow(2).sum())
    a.checkpoint.close()
    b.checkpoint.close()
    return (num / den) ** 0.5 if den else 0.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="Hugging Face model directory")
    ap.add_argument("--synthetic", default=None, help="write a synthetic Qwen3-MoE of this size instead (e.g. 2GB)")
    ap.add_argument("--formats", default="bf16,int8,q4,mxfp4,rvq3")
    ap.add_argument("--reference", default="bf16", help="the exact format the others are compared with")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--speed-tokens", type=int, default=24)
    ap.add_argument("--prompt", default="def quicksort(items):\n    \"\"\"Sort a list.\"\"\"\n")
    ap.add_argument("--work", default=str(Path.home() / ".cache" / "sluice-bench" / "formats"))
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--budget", default=None, help="also plan every format at this --memory budget: spine, "
                                                   "cache slots, and the hit rate of a decode with that cache")
    ap.add_argument("--baseline", default=None, help="the baseline RSS the budget plans use (default: measured)")
    args = ap.parse_args(argv)

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.synthetic:
        size = parse_size(args.synthetic)
        src = work / f"synthetic-{size / 1e9:.1f}GB"
        if not (src / "config.json").exists():
            write_model(src, demo_config(size))
    elif args.model:
        src = Path(args.model)
    else:
        ap.error("give --model or --synthetic")
    formats = args.formats.split(",")
    boxes = {}
    for spec in dict.fromkeys([args.reference] + formats):
        fmt, spine = split(spec)
        box = work / f"{src.name}.{fmt}{'.spine-' + spine if spine else ''}.sluice"
        if not (box / "manifest.json").exists():
            t0 = time.perf_counter()
            convert(src, box, experts=fmt, spine=spine)
            print(f"converted {spec} in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
        boxes[spec] = box
    budget = parse_size(args.budget) if args.budget else None
    baseline = parse_size(args.baseline) if args.baseline else current_rss()

    common = dict(progress=False, threads=args.threads)
    ref = sluice.load(boxes[args.reference], **common)
    ids = ref.encode(args.prompt) if ref.tokenizer is not None else list(range(3, 40))
    exact = ref.generate(ids, max_new_tokens=args.tokens, ignore_eos=True, speculate=False)
    seq = ids + exact.token_ids
    ref_logits = ref.forward(seq)[len(ids) - 1 : -1]
    ref.close()

    rows = []
    for spec in formats:
        fmt, spine = split(spec)
        eng = sluice.load(boxes[spec], **common)
        logits = eng.forward(seq)[len(ids) - 1 : -1]
        free = eng.generate(ids, max_new_tokens=args.tokens, ignore_eos=True, speculate=False).token_ids
        prefix = next((i for i, (a, b) in enumerate(zip(free, exact.token_ids)) if a != b), len(free))
        eng.close()
        info = ModelInfo(boxes[spec])
        ws, record = info.desc.working_set, info.experts.record_bytes
        planned = info.plan(budget, Options(), baseline=baseline) if budget else None
        info.checkpoint.close()
        at_budget = {}
        if planned is not None:
            warm = sluice.load(boxes[spec], cache_experts=planned.cache_slots, **common)
            w = warm.generate(ids, max_new_tokens=args.tokens, ignore_eos=True, speculate=False)
            warm.close()
            at_budget = {"budget": budget, "baseline": baseline, "spine_bytes": planned.spine_bytes,
                         "cache_slots": planned.cache_slots, "hit_rate_at_budget": w.stats["hit_rate"]}
        cold = sluice.load(boxes[spec], cache_experts=ws, **common)
        drop_cache(cold)
        r = cold.generate(ids, max_new_tokens=args.speed_tokens, ignore_eos=True, speculate=False)
        cold.close()
        row = {
            "format": spec,
            "lossy": bool(spine) or (bool(FORMATS[fmt].lossy) if fmt in FORMATS else False),
            "bits_per_weight": FORMATS[fmt].bits_per_weight if fmt in FORMATS else None,
            "record_bytes": record,
            "top1_agreement": (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item(),
            "mean_abs_logit_diff": (logits - ref_logits).abs().mean().item(),
            "max_abs_logit_diff": (logits - ref_logits).abs().max().item(),
            "kl": kl(ref_logits, logits),
            "greedy_prefix": prefix,
            "greedy_positionwise": sum(a == b for a, b in zip(free, exact.token_ids)) / len(free),
            "weight_rel_error": reconstruction_error(boxes[args.reference], boxes[spec], fmt),
            "cold_decode_tok_s": r.stats["decode_tok_s"],
            "bytes_per_token": r.stats["bytes_read"] / max(1, r.stats["generated_tokens"]),
            "hit_rate": r.stats["hit_rate"],
            **at_budget,
        }
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    base = next((r for r in rows if r["format"] == args.reference), rows[0])
    print(f"\nmodel: {src} ({args.tokens} greedy tokens for quality; {args.speed_tokens} cold tokens for speed, "
          f"expert cache = one token's working set)\n")
    print("| format | lossy | bits/weight | expert record | weight rel. error | top-1 agreement | mean abs logit diff "
          "| KL | greedy prefix | bytes/token | fewer bytes | cold decode tok/s | speedup |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        bpw = f"{r['bits_per_weight']:.2f}" if r["bits_per_weight"] else "-"
        print(f"| {r['format']} | {'yes' if r['lossy'] else 'no'} | {bpw} | {r['record_bytes'] / 2**20:.2f} MiB "
              f"| {100 * r['weight_rel_error']:.2f}% | {100 * r['top1_agreement']:.1f}% "
              f"| {r['mean_abs_logit_diff']:.4f} | {r['kl']:.2e} | {r['greedy_prefix']}/{args.tokens} "
              f"| {r['bytes_per_token'] / 1e6:.1f} MB | {base['bytes_per_token'] / r['bytes_per_token']:.2f}x "
              f"| {r['cold_decode_tok_s']:.2f} | {r['cold_decode_tok_s'] / base['cold_decode_tok_s']:.2f}x |")
    if budget:
        print(f"\nat --memory {args.budget} (baseline {base['baseline'] / 2**20:.1f} MiB for every format; hit rate "
              f"of {args.tokens} greedy tokens with that cache)\n")
        print("| format | resident spine | expert cache slots | hit rate |")
        print("|---|---|---|---|")
        for r in rows:
            print(f"| {r['format']} | {r['spine_bytes'] / 2**20:.2f} MiB | {r['cache_slots']} "
                  f"| {100 * r['hit_rate_at_budget']:.1f}% |")
    if args.out:
        Path(args.out).write_text(json.dumps({"model": str(src), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
