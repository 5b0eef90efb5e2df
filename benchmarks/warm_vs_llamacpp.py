"""Warm decode and prefill, Sluice against llama.cpp (``llama-bench``): same model, precision, threads.

    PYTHONPATH=src python benchmarks/warm_vs_llamacpp.py MODEL --llama-cpp DIR --reps 5 \\
        --json benchmarks/results/warm-vs-llamacpp.json

MODEL is a Hugging Face checkpoint that fits in memory; a directory without one gets a
synthetic Mixtral shape of ``--size`` (default 2GB, bf16; ``make_model.py write --family mixtral``);
llama.cpp gets it converted to GGUF at the same precision
(``benchmarks/llamacpp.py``: bf16 stays bf16, f32 stays f32; converted once and cached).
``--llama-cpp DIR`` (or ``$SLUICE_LLAMA_CPP``) is a llama.cpp tree built with cmake.

Sluice runs in this process (``sluice.load`` with a budget that holds every expert, ``threads``
compute threads), generates once so every expert is read, then each repeat, in alternating
order: Sluice generates ``--new`` tokens from a fresh ``--prompt``-token prompt (prefill tok/s =
prompt / time to first token, decode tok/s over the tokens after the first), and ``llama-bench
-p PROMPT -n NEW -r 1 -t THREADS`` runs once (its own warm-up first; pp = prompt processing,
tg = generation from an empty context), with the OpenMP wait policy Sluice uses (PASSIVE: threads
sleep while they wait) and, by default, also with libgomp's default (threads spin a while
first; the arm "llamacpp-spin"); the ratios are against the faster of the two. Before each arm
the memory read bandwidth is measured
(a 256 MiB fp32 sum on Sluice's kernel pool, best of 3); the memory roofline is the highest of
these bandwidths (the least disturbed by other processes) / bytes touched
per decoded token (spine minus the embedding table plus one row of it, plus the top-k experts
of every MoE layer: ``harness.model_facts``). Medians over the repeats, the 1-minute load
average beside them.
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

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import sluice  # noqa: E402,F401  (before torch: it sets OpenMP's wait policy)
import torch  # noqa: E402

import llamacpp  # noqa: E402
from harness import loadavg, model_facts  # noqa: E402
from sluice import kernels  # noqa: E402

_BW = None


def bandwidth() -> float:
    global _BW
    if _BW is None:
        _BW = torch.ones(64 << 20, dtype=torch.float32)
    best = 0.0
    for _ in range(3):
        t = time.perf_counter()
        kernels.bench_sum(_BW)
        best = max(best, _BW.numel() * 4 / (time.perf_counter() - t))
    return best


def llama_bench(binary: Path, gguf: Path, prompt: int, new: int, threads: int, wait: str) -> dict:
    cmd = [str(binary), "-m", str(gguf), "-p", str(prompt), "-n", str(new), "-r", "1", "-t", str(threads),
           "-o", "json"]
    env = dict(os.environ)
    if wait == "passive":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    else:  # libgomp's default: threads spin a while before they sleep
        env.pop("OMP_WAIT_POLICY", None)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({out.returncode}): {out.stderr[-2000:]}")
    res = {}
    for test in json.loads(out.stdout):
        if test.get("n_prompt") and not test.get("n_gen"):
            res["prefill_tok_s"] = test["avg_ts"]
        elif test.get("n_gen") and not test.get("n_prompt"):
            res["decode_tok_s"] = test["avg_ts"]
        res.setdefault("build", f"{test.get('build_commit')} ({test.get('build_number')})")
        res.setdefault("cpu", test.get("cpu_info"))
        res.setdefault("backends", test.get("backends"))
        res.setdefault("type_k", test.get("type_k"))
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path, help="Hugging Face checkpoint directory (fits in memory)")
    ap.add_argument("--llama-cpp", default=None, metavar="DIR", help="llama.cpp tree (default $SLUICE_LLAMA_CPP)")
    ap.add_argument("--gguf", type=Path, default=None, help="the model as GGUF (default: converted and cached)")
    ap.add_argument("--size", default="2GB", help="size of the Mixtral shape written to MODEL if it is not there")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--llama-wait", default="both", choices=["passive", "spin", "both"],
                    help="llama.cpp's OpenMP wait policy: PASSIVE (as Sluice), its default (spin), or both arms")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    model = a.model.expanduser().resolve()
    if not (model / "config.json").exists():  # written once: a Mixtral shape of --size, bf16
        import make_model
        from sluice.units import parse_size

        make_model.write(model, family="mixtral", size=parse_size(a.size), dtype="bf16")
    gguf = a.gguf or llamacpp.gguf(model, a.llama_cpp)
    bench_bin = llamacpp.binary("llama-bench", a.llama_cpp)
    facts = model_facts(str(model))
    touched = facts["bytes_touched_per_token"]
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    print(f"model {model.name}: {facts['checkpoint_bytes'] / 1e9:.2f} GB {facts['dtype']}, {touched / 1e9:.3f} GB "
          f"touched per token; GGUF {gguf.name}; {a.threads} threads; kernels {kernels.info()}", flush=True)
    wait_arms = {"passive": ["llamacpp"], "spin": ["llamacpp-spin"], "both": ["llamacpp", "llamacpp-spin"]}
    llama_arms = wait_arms[a.llama_wait]
    arms = ["sluice"] + llama_arms
    out = {arm: {"prefill": [], "decode": [], "bw": []} for arm in arms}
    loads = [loadavg()[0]]
    meta = {}
    budget = int(facts["checkpoint_bytes"] * 1.5 + (2 << 30))
    with sluice.load(model, memory=budget, threads=a.threads, progress=False,
                     max_context=a.prompt + a.new + 16) as eng:
        g = torch.Generator().manual_seed(2)
        for _ in range(2):  # every expert read (the first prompt's prefill touches nearly all of them)
            eng.generate(torch.randint(3, vocab, (a.prompt,), generator=g).tolist(), max_new_tokens=a.new,
                         ignore_eos=True, speculate=False)
        for r in range(a.reps):
            ids = torch.randint(3, vocab, (a.prompt,), generator=g).tolist()
            for arm in (arms if r % 2 == 0 else arms[::-1]):
                out[arm]["bw"].append(bandwidth())
                if arm == "sluice":
                    res = eng.generate(ids, max_new_tokens=a.new, ignore_eos=True, speculate=False)
                    out[arm]["prefill"].append(res.stats["prefill_tok_s"])
                    out[arm]["decode"].append(res.stats["decode_tok_s"])
                    meta["sluice_misses"] = res.stats.get("expert_misses", res.stats.get("misses"))
                else:
                    res = llama_bench(bench_bin, gguf, a.prompt, a.new, a.threads,
                                      "spin" if arm == "llamacpp-spin" else "passive")
                    out[arm]["prefill"].append(res["prefill_tok_s"])
                    out[arm]["decode"].append(res["decode_tok_s"])
                    meta.update(llama={k: v for k, v in res.items() if k not in ("prefill_tok_s", "decode_tok_s")})
                loads.append(loadavg()[0])
                print(f"rep {r} {arm:9s} prefill {out[arm]['prefill'][-1]:7.1f} tok/s  decode "
                      f"{out[arm]['decode'][-1]:6.2f} tok/s  bandwidth {out[arm]['bw'][-1] / 1e9:5.1f} GB/s  "
                      f"load {loads[-1]:.1f}", flush=True)
    rows = {}
    for arm, o in out.items():
        bw = max(sum((o2["bw"] for o2 in out.values()), []))  # the least disturbed pass: the machine's bandwidth
        dec = statistics.median(o["decode"])
        rows[arm] = {"decode_tok_s": dec, "prefill_tok_s": statistics.median(o["prefill"]), "bandwidth_Bps": bw,
                     "roofline_tok_s": bw / touched, "x_roofline": dec * touched / bw,
                     "decode_each": o["decode"], "prefill_each": o["prefill"], "bandwidth_each": o["bw"]}
    # against llama.cpp at its faster wait policy in this run (by median decode)
    best = max(llama_arms, key=lambda arm: rows[arm]["decode_tok_s"])
    pair_dec = [s_ / q for s_, q in zip(out["sluice"]["decode"], out[best]["decode"])]
    pair_pre = [s_ / q for s_, q in zip(out["sluice"]["prefill"], out[best]["prefill"])]
    ratio = {"against": best, "decode": rows["sluice"]["decode_tok_s"] / rows[best]["decode_tok_s"],
             "prefill": rows["sluice"]["prefill_tok_s"] / rows[best]["prefill_tok_s"],
             "decode_pairs": pair_dec, "prefill_pairs": pair_pre}
    for arm, row in rows.items():
        print(f"{arm:9s} decode {row['decode_tok_s']:6.2f} tok/s "
              f"(each {', '.join(f'{v:.1f}' for v in row['decode_each'])})"
              f"  x memory roofline {row['x_roofline']:.2f}  prefill {row['prefill_tok_s']:7.1f} tok/s "
              f"(each {', '.join(f'{v:.0f}' for v in row['prefill_each'])})")
    print(f"Sluice / {best}: decode {ratio['decode']:.2f}x (pairs {', '.join(f'{v:.2f}' for v in pair_dec)}; "
          f"median {statistics.median(pair_dec):.2f}), prefill {ratio['prefill']:.2f}x "
          f"(pairs {', '.join(f'{v:.2f}' for v in pair_pre)}; median {statistics.median(pair_pre):.2f})")
    print(f"memory roofline {rows['sluice']['roofline_tok_s']:.1f} tok/s; 1-minute load {min(loads):.1f}-"
          f"{max(loads):.1f}; cpus {os.cpu_count()}; llama.cpp {meta.get('llama', {}).get('build')}")
    if a.json:
        a.json.write_text(json.dumps({"model": model.name, "gguf": gguf.name, "threads": a.threads, "prompt": a.prompt,
                                      "new": a.new, "reps": a.reps, "facts": facts, "rows": rows, "ratio": ratio,
                                      "load1": loads, "meta": meta, "kernels": kernels.info()}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
