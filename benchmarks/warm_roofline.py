"""Warm decode and prefill (model in RAM) against the memory roofline, per kernel ISA level.

A synthetic bf16 Qwen3-MoE checkpoint (``sluice.synthetic``) is loaded with a budget that holds
every expert, generated once (every expert read), then measured: each repeat runs a fresh
prompt at every ISA level the host has (``kernels.set_isa_cap``: the widest, then AVX2; the
same bits, so the tokens must be equal), interleaved, with a memory-bandwidth pass (a 256 MiB
sum on the kernels' thread pool) before each so that background load hits all alike. The
roofline is bandwidth / bytes touched per decoded token (spine minus the embedding table plus
one row of it, plus the top-k experts of every MoE layer; ``harness.model_facts``). Numbers
are medians over the repeats. On a shared machine wall time swings with other processes'
load; ``--threads 1`` adds process CPU time per decoded token (a run of N new tokens minus a
run of 1, each from a fresh prompt; one thread, so no pool worker spins), which they disturb
far less: its tok/s and roofline ratio are "per CPU-second".

    PYTHONPATH=src python benchmarks/warm_roofline.py [--size 0.75G] [--reps 5] [--model-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import sluice  # noqa: F401  (before torch: it sets OpenMP's wait policy)
import torch

from harness import loadavg, model_facts
from sluice import kernels
from sluice.synthetic import DEMO_CONFIG, scaled_config, write_model
from sluice.units import parse_size

_BW = None


def bandwidth() -> float:
    global _BW
    if _BW is None:
        _BW = torch.ones(64 << 20, dtype=torch.float32)
    t = time.perf_counter()
    kernels.bench_sum(_BW)
    return _BW.numel() * 4 / (time.perf_counter() - t) / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="0.75G", help="synthetic model size (bf16)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--model-dir", type=Path, help="keep the synthetic model here (reused when present)")
    ap.add_argument("--threads", type=int, help="compute threads (default: Sluice's own choice)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    size = parse_size(a.size)
    tmp = None
    path = a.model_dir
    if path is None or not (path / "config.json").exists():
        if path is None:
            tmp = tempfile.TemporaryDirectory()
            path = Path(tmp.name) / "model"
        write_model(path, scaled_config(size, DEMO_CONFIG), dtype=torch.bfloat16, progress=False, tokenizer=False)
    facts = model_facts(str(path))
    touched = facts["bytes_touched_per_token"]
    levels = sorted(kernels.isa_levels(), reverse=True)
    levels = levels[:1] + [1] if len(levels) > 1 else levels
    names = [kernels.ISA_LEVELS[lv] for lv in levels]
    print(f"model {path}: {facts['checkpoint_bytes'] / 1e9:.2f} GB, {touched / 1e9:.3f} GB touched per token; "
          f"kernels {kernels.info()}; levels {names}", flush=True)
    vocab = DEMO_CONFIG["vocab_size"]
    out = {n: {"prefill": [], "decode": [], "bw": [], "tokens": [], "cpu": []} for n in names}
    loads = [loadavg()[0]]
    kw = {"threads": a.threads} if a.threads else {}
    with sluice.load(path, memory=int(size * 3), progress=False, **kw) as eng:
        g = torch.Generator().manual_seed(2)
        eng.generate(torch.randint(2, vocab, (a.prompt,), generator=g).tolist(), max_new_tokens=a.new, ignore_eos=True)
        for r in range(a.reps):
            ids = torch.randint(2, vocab, (a.prompt,), generator=g).tolist()
            for lv, name in (zip(levels, names) if r % 2 == 0 else reversed(list(zip(levels, names)))):
                kernels.set_isa_cap(lv)
                out[name]["bw"].append(bandwidth())
                c0 = time.process_time()
                res = eng.generate(ids, max_new_tokens=a.new, ignore_eos=True, speculate=False)
                c1 = time.process_time()
                if a.threads == 1:
                    ids1 = [2 + (ids[0] + 7) % (vocab - 2)] + ids[1:]
                    eng.generate(ids1, max_new_tokens=1, ignore_eos=True, speculate=False)
                    out[name]["cpu"].append(((c1 - c0) - (time.process_time() - c1)) / (a.new - 1))
                out[name]["prefill"].append(res.stats["prefill_tok_s"])
                out[name]["decode"].append(res.stats["decode_tok_s"])
                out[name]["tokens"].append(list(res.token_ids))
            loads.append(loadavg()[0])
    kernels.set_isa_cap(max(kernels.ISA_LEVELS))
    if tmp is not None:
        tmp.cleanup()
    rows = []
    for name in names:
        o = out[name]
        bw = statistics.median(o["bw"])
        dec = statistics.median(o["decode"])
        row = {"isa": name, "decode_tok_s": dec, "prefill_tok_s": statistics.median(o["prefill"]),
               "bandwidth_GBps": bw, "roofline_tok_s": bw * 1e9 / touched, "x_roofline": dec * touched / (bw * 1e9),
               "decode_each": o["decode"], "prefill_each": o["prefill"]}
        if o["cpu"]:
            cpu = statistics.median(o["cpu"])
            row.update(cpu_s_per_token=cpu, cpu_tok_s=1 / cpu, cpu_x_roofline=touched / cpu / (bw * 1e9))
        rows.append(row)
        if o["cpu"]:
            print(f"{name:12s} per CPU-second: decode {row['cpu_tok_s']:6.2f} tok/s, "
                  f"x roofline {row['cpu_x_roofline']:.2f}")
        print(f"{name:12s} decode {dec:6.2f} tok/s (each {', '.join(f'{v:.1f}' for v in o['decode'])})  "
              f"prefill {row['prefill_tok_s']:7.1f} tok/s  bandwidth {bw:5.1f} GB/s  roofline "
              f"{row['roofline_tok_s']:6.1f} tok/s  x roofline {row['x_roofline']:.2f}", flush=True)
    same = all(out[n]["tokens"] == out[names[0]]["tokens"] for n in names)
    print(f"tokens equal at every level: {same}; 1-minute load {min(loads):.1f}-{max(loads):.1f}; "
          f"threads {kernels.info()['threads']}, cpus {os.cpu_count()}")
    if len(rows) > 1:
        per_cpu = ""
        if "cpu_tok_s" in rows[0]:
            per_cpu = f", decode per CPU-second {rows[0]['cpu_tok_s'] / rows[1]['cpu_tok_s']:.2f}x"
        print(f"{names[0]} / avx2: decode {rows[0]['decode_tok_s'] / rows[1]['decode_tok_s']:.2f}x, "
              f"prefill {rows[0]['prefill_tok_s'] / rows[1]['prefill_tok_s']:.2f}x"
              + per_cpu)
    if a.json:
        a.json.write_text(json.dumps({"facts": facts, "rows": rows, "tokens_equal": same, "load": loads}, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
