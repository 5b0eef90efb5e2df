"""Warm decode of two source trees side by side (A/B of a code change), per expert format.

A synthetic bf16 Qwen3-MoE checkpoint (``sluice.synthetic``) is written once and converted to
each requested expert format; for every format, child processes alternate between the trees
(``PYTHONPATH`` set to each ``src``), each loading the model with a budget that holds every
expert, generating once (every expert read), then measuring ``--reps`` decodes of fresh
prompts. One kernel thread, so the measure is process CPU time per decoded token (a run of
``--new`` tokens minus a run of 1, as ``warm_roofline.py --threads 1``), which other processes
disturb far less than wall time; wall decode tok/s is reported beside it. Each child also
hashes the logits of one forward and the generated tokens: the trees must agree bit for bit.

    PYTHONPATH=src python benchmarks/code_ab.py --tree old=../main/src --tree new=src \\
        [--formats bf16,q4] [--size 0.2G] [--rounds 4] [--reps 3] [--model-dir DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def child(a) -> None:
    import sluice
    import torch

    with sluice.load(a.model, memory=a.memory, threads=1, progress=False) as eng:
        vocab = eng.raw_config["vocab_size"]
        g = torch.Generator().manual_seed(2)
        eng.generate(torch.randint(2, vocab, (a.prompt,), generator=g).tolist(), max_new_tokens=a.new,
                     ignore_eos=True, speculate=False)
        ids = torch.randint(2, vocab, (a.prompt,), generator=g)
        logits = eng.forward(ids)
        digest = hashlib.sha256(logits.float().contiguous().numpy().tobytes()).hexdigest()[:16]
        cpu, wall, toks = [], [], []
        for _ in range(a.reps):
            ids = torch.randint(2, vocab, (a.prompt,), generator=g).tolist()
            c0 = time.process_time()
            res = eng.generate(ids, max_new_tokens=a.new, ignore_eos=True, speculate=False)
            c1 = time.process_time()
            eng.generate([2 + (ids[0] + 7) % (vocab - 2)] + ids[1:], max_new_tokens=1, ignore_eos=True,
                         speculate=False)
            cpu.append(((c1 - c0) - (time.process_time() - c1)) / (a.new - 1))
            wall.append(res.stats["decode_tok_s"])
            toks.append(list(res.token_ids))
    print(json.dumps({"cpu_s_per_token": cpu, "decode_tok_s": wall, "logits": digest,
                      "tokens": hashlib.sha256(json.dumps(toks).encode()).hexdigest()[:16]}))


def models(a) -> dict[str, Path]:
    import sluice  # noqa: F401  (before torch: it sets OpenMP's wait policy)
    import torch

    from sluice.convert import convert
    from sluice.synthetic import DEMO_CONFIG, scaled_config, write_model

    root = a.model_dir
    root.mkdir(parents=True, exist_ok=True)
    hf = root / "bf16-hf"
    if not (hf / "config.json").exists():
        write_model(hf, scaled_config(float(a.size.rstrip("G")) * 1e9, DEMO_CONFIG), dtype=torch.bfloat16,
                    progress=False, tokenizer=False)
    out = {}
    for fmt in a.formats.split(","):
        if fmt == "hf":
            out[fmt] = hf
            continue
        box = root / f"{fmt}.sluice"
        if not (box / "manifest.json").exists():
            convert(hf, box, experts=fmt, progress=False)
        out[fmt] = box
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", action="append", default=[], help="NAME=PATH of a source tree's src (two)")
    ap.add_argument("--formats", default="hf,bf16,q4", help="hf (the checkpoint itself) and/or container formats")
    ap.add_argument("--size", default="0.2G")
    ap.add_argument("--rounds", type=int, default=4, help="child processes per tree and format, alternating")
    ap.add_argument("--reps", type=int, default=3, help="measured decodes per child")
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=8)
    ap.add_argument("--memory", default="4GiB")
    ap.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "sluice-code-ab")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a)
    trees = dict(t.split("=", 1) for t in a.tree)
    if len(trees) != 2:
        ap.error("give two --tree NAME=PATH")
    paths = models(a)
    names = list(trees)
    for fmt, path in paths.items():
        res = {n: [] for n in names}
        loads = []
        for r in range(a.rounds):
            for n in (names if r % 2 == 0 else names[::-1]):
                env = dict(os.environ, PYTHONPATH=str(Path(trees[n]).resolve()), OMP_NUM_THREADS="1")
                cmd = [sys.executable, __file__, "--child", "--model", str(path), "--reps", str(a.reps),
                       "--new", str(a.new), "--prompt", str(a.prompt), "--memory", a.memory]
                p = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
                res[n].append(json.loads(p.stdout.strip().splitlines()[-1]))
                loads.append(os.getloadavg()[0])
        med = {n: statistics.median(c for x in res[n] for c in x["cpu_s_per_token"]) for n in names}
        wall = {n: statistics.median(w for x in res[n] for w in x["decode_tok_s"]) for n in names}
        same = len({x["logits"] for n in names for x in res[n]}) == 1 and \
            len({x["tokens"] for n in names for x in res[n]}) == 1
        a0, b0 = names
        print(f"{fmt:6s} CPU s/token: " + ", ".join(f"{n} {med[n] * 1e3:.2f} ms" for n in names)
              + f"  {b0}/{a0} speed {med[a0] / med[b0]:.3f}x;  wall decode tok/s: "
              + ", ".join(f"{n} {wall[n]:.1f}" for n in names)
              + f"  ({b0}/{a0} {wall[b0] / wall[a0]:.3f}x);  logits and tokens equal: {same};  "
              f"load {min(loads):.1f}-{max(loads):.1f}", flush=True)


if __name__ == "__main__":
    main()
