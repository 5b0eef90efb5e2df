"""Warm decode and prefill (model in RAM) of two Sluice source trees, side by side.

Each arm is a child process importing Sluice from its own source tree (``--old`` / ``--new``,
e.g. a checkout of main and a branch), with the model loaded once and every expert read
before the first measurement. The parent then alternates (AB, BA, AB, ...): each turn one arm
generates ``--new-tokens`` from a fresh ``--prompt``-token prompt (both arms get the same
prompts), reporting decode and prefill tok/s, process CPU time per decoded token (a run of N
new tokens minus a run of 1; meaningful at ``--threads 1``, where no pool worker spins: the
least load-sensitive number on a shared machine), prompt tokens per CPU-second of the 1-token
run (its prefill, plus one token) and a memory-bandwidth probe taken just
before (a 256 MiB sum on the kernels' pool). Medians per arm; the roofline is bandwidth /
bytes touched per decoded token (``harness.model_facts``). The arms' tokens must be equal
(checked and printed).

    PYTHONPATH=src:benchmarks python benchmarks/warm_ab.py --model-dir DIR --old ../main/src \\
        --new src [--rounds 7] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def child(a) -> int:
    import sluice  # noqa: F401  (before torch: it sets OpenMP's wait policy)
    import torch

    from sluice import kernels

    bw_buf = torch.ones(64 << 20, dtype=torch.float32)
    kw = {"threads": a.threads} if a.threads else {}
    with sluice.load(a.model_dir, memory=a.memory, progress=False, parallel=1, **kw) as eng:
        vocab = eng.desc.vocab if hasattr(eng, "desc") else 32000
        g = torch.Generator().manual_seed(1)
        eng.generate(torch.randint(2, vocab, (a.prompt,), generator=g).tolist(), max_new_tokens=a.new_tokens,
                     ignore_eos=True, speculate=False)
        if getattr(eng, "cache", None) is not None:  # every expert read once, also those not routed to yet
            for layer in eng.desc.moe_layers:
                eng.experts.prefetch(layer, list(range(eng.desc.n_experts)))
                eng.experts.drain()
        print(json.dumps({"ready": True, "sluice": os.path.dirname(sluice.__file__)}), flush=True)
        for line in sys.stdin:
            seed = int(line)
            ids = torch.randint(2, vocab, (a.prompt,), generator=torch.Generator().manual_seed(seed)).tolist()
            t = time.perf_counter()
            kernels.bench_sum(bw_buf)
            bw = bw_buf.numel() * 4 / (time.perf_counter() - t) / 1e9
            c0 = time.process_time()
            res = eng.generate(ids, max_new_tokens=a.new_tokens, ignore_eos=True, speculate=False)
            c1 = time.process_time()
            eng.generate(ids, max_new_tokens=1, ignore_eos=True, speculate=False)
            one = time.process_time() - c1  # the prompt's prefill and one sampled token
            cpu = ((c1 - c0) - one) / (a.new_tokens - 1)
            print(json.dumps({"decode": res.stats["decode_tok_s"], "prefill": res.stats["prefill_tok_s"],
                              "cpu_s_per_token": cpu, "cpu_prefill_tok_s": a.prompt / one, "bw": bw,
                              "tokens": list(res.token_ids)}), flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", required=True, type=Path)
    ap.add_argument("--old", required=True, type=Path, help="source tree of arm A (the dir holding sluice/)")
    ap.add_argument("--new", required=True, type=Path, help="source tree of arm B")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, help="compute threads (default: Sluice's own choice)")
    ap.add_argument("--memory", type=int, default=None, help="budget in bytes (default: 3x the model)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.memory is None:
        a.memory = 3 * sum(f.stat().st_size for f in a.model_dir.iterdir() if f.is_file())
    if a.child:
        return child(a)
    sys.path.insert(0, str(HERE))
    from harness import loadavg, model_facts

    touched = model_facts(str(a.model_dir))["bytes_touched_per_token"]
    arms = {"old": a.old.resolve(), "new": a.new.resolve()}
    procs = {}
    args = [sys.executable, str(Path(__file__).resolve()), "--child", "--model-dir", str(a.model_dir),
            "--old", str(a.old), "--new", str(a.new), "--prompt", str(a.prompt), "--new-tokens", str(a.new_tokens),
            "--memory", str(a.memory)] + (["--threads", str(a.threads)] if a.threads else [])
    for name, src in arms.items():
        env = {**os.environ, "PYTHONPATH": str(src)}
        procs[name] = subprocess.Popen(args, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = json.loads(procs[name].stdout.readline())
        print(f"{name}: sluice from {ready['sluice']}", flush=True)
    out = {n: [] for n in arms}
    loads = [loadavg()[0]]
    try:
        for r in range(a.rounds):
            order = list(arms) if r % 2 == 0 else list(reversed(list(arms)))
            for name in order:
                p = procs[name]
                p.stdin.write(f"{100 + r}\n")
                p.stdin.flush()
                out[name].append(json.loads(p.stdout.readline()))
            loads.append(loadavg()[0])
            print(f"round {r}: " + "  ".join(
                f"{n} decode {out[n][-1]['decode']:.1f} prefill {out[n][-1]['prefill']:.1f} "
                f"cpu/token {out[n][-1]['cpu_s_per_token'] * 1e3:.1f} ms "
                f"prefill/cpu-s {out[n][-1]['cpu_prefill_tok_s']:.0f}"
                for n in arms), flush=True)
    finally:
        for p in procs.values():
            p.stdin.close()
            p.wait()
    rows = {}
    for n in arms:
        runs = out[n]
        keys = ("decode", "prefill", "cpu_s_per_token", "cpu_prefill_tok_s", "bw")
        med = {k: statistics.median(x[k] for x in runs) for k in keys}
        med["x_roofline"] = med["decode"] * touched / (med["bw"] * 1e9)
        med["cpu_x_roofline"] = touched / med["cpu_s_per_token"] / (med["bw"] * 1e9)
        rows[n] = med
        print(f"{n:4s} decode {med['decode']:6.2f} tok/s  prefill {med['prefill']:7.1f} tok/s  "
              f"cpu/token {med['cpu_s_per_token'] * 1e3:6.2f} ms  prefill per CPU-s {med['cpu_prefill_tok_s']:6.1f}  "
              f"bandwidth {med['bw']:5.1f} GB/s  "
              f"x roofline {med['x_roofline']:.2f} (per CPU-second {med['cpu_x_roofline']:.2f})")
    same = [x["tokens"] for x in out["old"]] == [x["tokens"] for x in out["new"]]
    o, nw = rows["old"], rows["new"]
    print(f"new/old: decode {nw['decode'] / o['decode']:.2f}x, prefill {nw['prefill'] / o['prefill']:.2f}x, "
          f"CPU per token {nw['cpu_s_per_token'] / o['cpu_s_per_token']:.2f}x, prefill per CPU-second "
          f"{nw['cpu_prefill_tok_s'] / o['cpu_prefill_tok_s']:.2f}x; tokens equal: {same}; "
          f"{touched / 1e9:.3f} GB touched per token; 1-minute load {min(loads):.1f}-{max(loads):.1f}")
    if a.json:
        a.json.write_text(json.dumps({"rows": rows, "runs": out, "tokens_equal": same, "load": loads,
                                      "bytes_touched_per_token": touched}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
