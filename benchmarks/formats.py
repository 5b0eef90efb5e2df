"""Expert formats side by side: quality against the exact model, bytes per token, cold decode speed.

    python benchmarks/formats.py --model DIR [--formats bf16,int8,q4,mxfp4,rvq3] [--tokens 256]
    python benchmarks/formats.py --synthetic 2GB            # writes a synthetic Qwen3-MoE first

For every format the model is converted once (kept under --work), then, in this one process:
- quality, teacher-forced on the reference format's greedy output: top-1 agreement and the
  mean / max |logit difference| at every generated position, and the free-running greedy
  agreement (identical prefix length / tokens);
- the relative reconstruction error of the expert weights (a sample of experts, dequantized);
- cold decode with the expert cache at one token's working set: tok/s and bytes read per token.
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
from sluice.engine import ModelInfo
from sluice.experts.source import views
from sluice.quant import FORMATS
from sluice.storage import AlignedBuffer
from sluice.synthetic import write_model
from sluice.units import parse_size


def reconstruction_error(ref_box: Path, box: Path, fmt: str, samples: int = 6, seed: int = 0) -> float:
    """Relative Frobenius error of dequantized expert matrices against the reference container's."""
    a, b = ModelInfo(ref_box), ModelInfo(box)
    rng = random.Random(seed)
    keys = [(layer, e) for layer in a.desc.moe_layers for e in range(a.desc.n_experts)]
    num = den = 0.0
    for layer, e in rng.sample(keys, min(samples, len(keys))):
        wa = views(buf := AlignedBuffer(a.experts.slot_bytes), 0, a.experts.read(layer, e, buf))
        lb = b.experts.read(layer, e, buf2 := AlignedBuffer(b.experts.slot_bytes))
        wb = views(buf2, 0, lb)
        for role, (n, k) in a.desc.expert.matrix_shapes().items():
            ref = wa[role].float()
            if fmt in ("f32", "bf16", "f16"):
                got = wb[role].float()
            else:
                parts = {name.split(".", 1)[1]: t for name, t in wb.items() if name.startswith(role + ".")}
                got = FORMATS[fmt].dequantize(parts, n, k)
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
    for fmt in dict.fromkeys([args.reference] + formats):
        box = work / f"{src.name}.{fmt}.sluice"
        if not (box / "manifest.json").exists():
            t0 = time.perf_counter()
            convert(src, box, experts=fmt)
            print(f"converted {fmt} in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
        boxes[fmt] = box

    common = dict(progress=False, threads=args.threads)
    ref = sluice.load(boxes[args.reference], **common)
    ids = ref.encode(args.prompt) if ref.tokenizer is not None else list(range(3, 40))
    exact = ref.generate(ids, max_new_tokens=args.tokens, ignore_eos=True, speculate=False)
    seq = ids + exact.token_ids
    ref_logits = ref.forward(seq)[len(ids) - 1 : -1]
    ref.close()

    rows = []
    for fmt in formats:
        eng = sluice.load(boxes[fmt], **common)
        logits = eng.forward(seq)[len(ids) - 1 : -1]
        free = eng.generate(ids, max_new_tokens=args.tokens, ignore_eos=True, speculate=False).token_ids
        prefix = next((i for i, (a, b) in enumerate(zip(free, exact.token_ids)) if a != b), len(free))
        eng.close()
        info = ModelInfo(boxes[fmt])
        ws, record = info.desc.working_set, info.experts.record_bytes
        info.checkpoint.close()
        cold = sluice.load(boxes[fmt], cache_experts=ws, **common)
        drop_cache(cold)
        r = cold.generate(ids, max_new_tokens=args.speed_tokens, ignore_eos=True, speculate=False)
        cold.close()
        row = {
            "format": fmt,
            "lossy": bool(FORMATS[fmt].lossy) if fmt in FORMATS else False,
            "bits_per_weight": FORMATS[fmt].bits_per_weight if fmt in FORMATS else None,
            "record_bytes": record,
            "top1_agreement": (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item(),
            "mean_abs_logit_diff": (logits - ref_logits).abs().mean().item(),
            "max_abs_logit_diff": (logits - ref_logits).abs().max().item(),
            "greedy_prefix": prefix,
            "greedy_positionwise": sum(a == b for a, b in zip(free, exact.token_ids)) / len(free),
            "weight_rel_error": reconstruction_error(boxes[args.reference], boxes[fmt], fmt),
            "cold_decode_tok_s": r.stats["decode_tok_s"],
            "bytes_per_token": r.stats["bytes_read"] / max(1, r.stats["generated_tokens"]),
            "hit_rate": r.stats["hit_rate"],
        }
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    base = next((r for r in rows if r["format"] == args.reference), rows[0])
    print(f"\nmodel: {src} ({args.tokens} greedy tokens for quality; {args.speed_tokens} cold tokens for speed, "
          f"expert cache = one token's working set)\n")
    print("| format | lossy | bits/weight | expert record | weight rel. error | top-1 agreement | mean abs logit diff "
          "| greedy prefix | bytes/token | fewer bytes | cold decode tok/s | speedup |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        bpw = f"{r['bits_per_weight']:.2f}" if r["bits_per_weight"] else "-"
        print(f"| {r['format']} | {'yes' if r['lossy'] else 'no'} | {bpw} | {r['record_bytes'] / 2**20:.2f} MiB "
              f"| {100 * r['weight_rel_error']:.2f}% | {100 * r['top1_agreement']:.1f}% "
              f"| {r['mean_abs_logit_diff']:.4f} | {r['greedy_prefix']}/{args.tokens} "
              f"| {r['bytes_per_token'] / 1e6:.1f} MB | {base['bytes_per_token'] / r['bytes_per_token']:.2f}x "
              f"| {r['cold_decode_tok_s']:.2f} | {r['cold_decode_tok_s'] / base['cold_decode_tok_s']:.2f}x |")
    if args.out:
        Path(args.out).write_text(json.dumps({"model": str(src), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
