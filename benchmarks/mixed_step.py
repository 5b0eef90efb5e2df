"""N sequences decoded in one step vs the same N sequences in N solo steps (issue 17 §2).

    PYTHONPATH=src python benchmarks/mixed_step.py MODEL [--memory 3GB] [--seqs 4] [--rounds 8]
        [--prompt-tokens 32] [--warmup 0] [--repeat 2] [--json OUT]

Each run loads the model, prefills ``--seqs`` different random prompts (each alone, in its
own state slot), then decodes ``--rounds`` greedy tokens per sequence: ``mixed`` runs each
round as one ``ModelRunner.step`` of all sequences, ``solo`` as one step per sequence. Modes
alternate (mixed, solo, mixed, ...), each on a fresh load in a child process of its own (a
cold expert cache, the same memory baseline; reads are O_DIRECT where the file system allows,
so the page cache does not carry over). Reported per
mode (medians over ``--repeat``; ``--warmup`` rounds decoded first are not counted): decode wall
seconds, expert bytes read from storage, demand
reads, expert compute calls, the union of the experts routed per forward and MoE layer next
to the sum of each sequence's own union, and whether the generated tokens are the same in
both modes (they must be: the mixed step is bit-identical to the solo runs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

_SRC = Path(__file__).resolve().parent.parent / "src"
if str(_SRC) not in sys.path:
    sys.path.insert(0, str(_SRC))

import sluice  # noqa: E402  (first: it sets OpenMP's wait policy before torch loads)
import torch  # noqa: E402

from sluice.runner import SeqState, SeqWork  # noqa: E402


def run(path: str, mode: str, memory: str, seqs: int, rounds: int, prompt_tokens: int, warmup: int = 0) -> dict:
    with sluice.load(path, memory=memory, progress=False, prefetch=False) as eng:
        runner = eng.runner
        ctx = prompt_tokens + warmup + rounds + 1
        slots = [SeqState(eng.model.new_state(ctx), i) for i in range(seqs)]
        nxt = []
        for i, s in enumerate(slots):
            g = torch.Generator().manual_seed(100 + i)
            ids = torch.randint(3, eng.desc.vocab, (prompt_tokens,), generator=g).tolist()
            nxt.append(int(runner.run(s, ids, 0)[-1].argmax()))
        tokens: list[list[int]] = [[] for _ in slots]
        for k in range(warmup + rounds):
            if k == warmup:
                before = runner.counters()
                t0 = time.perf_counter()
            work = [SeqWork(s, [t], s.length, decoding=True) for s, t in zip(slots, nxt)]
            results = runner.step(work) if mode == "mixed" else [runner.step([w])[0] for w in work]
            for i, r in enumerate(results):
                tokens[i].append(nxt[i])
                nxt[i] = int(r.logits[-1].argmax())
        wall = time.perf_counter() - t0
        d = runner.counters() - before
    return {"mode": mode, "decode_s": wall, "tokens": tokens,
            "expert_bytes_read": d.bytes_read - d.spine_bytes_read, "demand_reads": d.demand_reads,
            "expert_compute_calls": d.expert_compute_calls, "expert_union": d.expert_union,
            "expert_seq_union": d.expert_seq_union, "forwards": d.forwards, "evictions": d.evictions,
            "hit_rate": d.expert_hits / d.expert_lookups if d.expert_lookups else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--memory", default="3GB")
    ap.add_argument("--seqs", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=0, help="decode rounds before measuring (a warm cache)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json")
    ap.add_argument("--child", choices=("mixed", "solo"), help=argparse.SUPPRESS)  # one run, JSON on stdout
    a = ap.parse_args()
    if a.child:
        print(json.dumps(run(a.model, a.child, a.memory, a.seqs, a.rounds, a.prompt_tokens, a.warmup)))
        return
    runs: dict[str, list[dict]] = {"mixed": [], "solo": []}
    for _ in range(a.repeat):
        for mode in ("mixed", "solo"):
            cmd = [sys.executable, __file__, a.model, "--child", mode, "--memory", a.memory, "--seqs", str(a.seqs),
                   "--rounds", str(a.rounds), "--prompt-tokens", str(a.prompt_tokens), "--warmup", str(a.warmup)]
            r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
            runs[mode].append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "tokens"}), flush=True)
    same = all(r["tokens"] == runs["solo"][0]["tokens"] for rs in runs.values() for r in rs)
    keys = ("decode_s", "expert_bytes_read", "demand_reads", "expert_compute_calls", "expert_union",
            "expert_seq_union", "forwards", "hit_rate")
    summary = {mode: {k: statistics.median(r[k] for r in rs) for k in keys} for mode, rs in runs.items()}
    generated = a.seqs * a.rounds
    for s in summary.values():
        s["tok_s"] = generated / s["decode_s"]
        s["expert_bytes_per_token"] = s["expert_bytes_read"] / generated
    out = {"model": a.model, "memory": a.memory, "seqs": a.seqs, "rounds": a.rounds, "warmup": a.warmup,
           "prompt_tokens": a.prompt_tokens, "repeat": a.repeat, "tokens_identical": same, "summary": summary,
           "runs": {mode: [{k: v for k, v in r.items() if k != "tokens"} for r in rs] for mode, rs in runs.items()}}
    print(f"{'':10} {'mixed':>14} {'solo':>14}")
    for k in ("decode_s", "tok_s", "expert_bytes_per_token", "demand_reads", "expert_compute_calls",
              "expert_union", "expert_seq_union", "forwards", "hit_rate"):
        print(f"{k:24} {summary['mixed'][k]:>14.4g} {summary['solo'][k]:>14.4g}")
    print(f"tokens identical in both modes: {same}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
