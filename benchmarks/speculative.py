"""Lossless n-gram speculation, measured: decode with and without it, in one process per
model, on a repetitive and a less repetitive workload, with a small expert cache.

    python benchmarks/speculative.py [--tokens 128] [--synthetic 500MB] [--repeat 3] [--json OUT]

Models: the shipped trained demo model (cache: a quarter of its experts) and a random-weight
Qwen3-MoE of --synthetic size (cache: one token's working set, so decoding streams). Every
row requires the tokens with and without speculation to be identical (greedy). Each row is
run --repeat times; the row shows the run with the median speedup (timings on a shared
machine move by +-10%; drafted/accepted/bytes are the same every run).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import sluice  # noqa: F401  (before torch: OpenMP wait policy)
from sluice.bench import bench_spec
from sluice.demo import SHIPPED_MODEL, ensure_synthetic
from sluice.engine import ModelInfo
from sluice.units import parse_size

# getters and setters: the continuation repeats what the prompt already holds
REPETITIVE_CODE = """class Config:
    def get_name(self):
        return self._name

    def set_name(self, value):
        self._name = value

    def get_path(self):
        return self._path

    def set_path(self, value):
        self._path = value

    def get_mode(self):
        return self._mode

    def set_mode(self, value):
        self._mode = value

    def get_size(self):
"""
FREE_CODE = "def parse_header(line):\n"
# the model's continuation rarely repeats what the prompt holds: most drafts are rejected
LOW_ACCEPTANCE = "import argparse\n\n\ndef main():\n    parser = argparse.ArgumentParser(description=\"Copy files\")\n"


def random_prompts(vocab: int, seed: int = 0) -> dict[str, list[int]]:
    r = random.Random(seed)
    block = [r.randrange(3, vocab) for _ in range(48)]
    return {"a random 48-token block, repeated 4x": block * 4,
            "192 random tokens": [r.randrange(3, vocab) for _ in range(192)]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--synthetic", default="500MB", help="size of the random model (default 500MB)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per row; the median-speedup run is shown")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    def median_run(*a, **kw) -> dict:
        runs = sorted((bench_spec(*a, **kw) for _ in range(args.repeat)), key=lambda r: r["speedup"])
        r = runs[len(runs) // 2]
        return {**r, "identical": all(x["identical"] for x in runs), "speedups": [x["speedup"] for x in runs]}

    rows = []
    for name, prompt in (("getters/setters (repetitive)", REPETITIVE_CODE),
                         ("def parse_header(line): (free)", FREE_CODE),
                         ("argparse main() (drafts mostly rejected)", LOW_ACCEPTANCE)):
        r = median_run(SHIPPED_MODEL, prompt, new_tokens=args.tokens, memory="4GiB", cache_experts=48)
        rows.append({"model": "trained demo (48/192 experts cached)", "workload": name, **r})
    synth = ensure_synthetic(parse_size(args.synthetic), progress=False)
    cfg = json.loads((synth / "config.json").read_text())
    info = ModelInfo(synth)
    working_set = info.desc.working_set
    info.checkpoint.close()
    for name, ids in random_prompts(cfg["vocab_size"]).items():
        r = median_run(synth, ids, new_tokens=args.tokens, max_context=512, cache_experts=working_set)
        rows.append({"model": f"random {args.synthetic} (cache = one token's experts)", "workload": name, **r})
    print("| model | workload | identical tokens | plain tok/s | speculative tok/s | speedup (median) | all speedups "
          "| drafted | accepted | tokens per forward | bytes read plain / speculative |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['workload']} | {'yes' if r['identical'] else 'NO'} | "
              f"{r['plain_decode_tok_s']:.1f} | {r['spec_decode_tok_s']:.1f} | {r['speedup']:.2f}x | "
              f"{', '.join(f'{x:.2f}' for x in r['speedups'])} | {r['drafted']} | {r['accepted']} | "
              f"{r['tokens_per_forward']:.2f} | "
              f"{r['plain_bytes_read'] / 1e6:.0f} / {r['spec_bytes_read'] / 1e6:.0f} MB |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
