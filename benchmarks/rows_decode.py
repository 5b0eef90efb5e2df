"""Decode with token-keyed tables larger than the memory budget: a synthetic qwen4_exp-shaped model.

A Qwen3.8-Flash-Next-shaped model (``qwen4_exp_text``, Gated DeltaNet + QSA, 4 gated residual
streams, every layer MoE) with PLE n-gram tables on its linear-attention layers, written by
``sluice.synthetic`` with random bf16 weights; the tables are sized to ``--table-gb`` (2 GB by
default) and the model runs under ``--memory`` (800 MiB by default: this process alone takes
~370 MiB before loading), so the tables stream by row
through the row store's cache while the experts stream through theirs.

Measured in one run, alternating so background load hits both alike: decode tok/s cold (O_DIRECT
where the filesystem allows it, a fresh engine per run) with each step's row reads issued at the
step's start (``early``, the default) and with each PLE layer reading its rows when it runs
(``at_layer``); per token the table bytes and expert bytes read, rows read, the row-cache hit
rate; the peak RSS of the process against the budget, and the logits of both modes equal.

    PYTHONPATH=src python benchmarks/rows_decode.py [--dir /path/for/model] [--table-gb 2]
        [--memory 800MiB] [--tokens 24] [--rounds 3] [--json benchmarks/results/rows-decode.json]

``--prefill``: a prompt of ``--prompt`` tokens prefilled in chunks of ``--chunk``, cold, with the
next chunk's rows issued while the current chunk runs (``ahead``, the default) and without
(``own_step``: each chunk issues its rows at its start): prefill seconds, rows read and read
ahead, logits equal.

    PYTHONPATH=src python benchmarks/rows_decode.py --prefill [--prompt 256] [--chunk 32] [--rounds 5]
        [--json benchmarks/results/rows-prefill.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import sys
import tempfile
from pathlib import Path

import sluice  # noqa: F401  (before torch: it sets OpenMP's wait policy)
import torch

from sluice.models import get_family
from sluice.synthetic import QWEN4_EXP_CONFIG, with_tables, write_model
from sluice.units import format_size

def config(table_bytes: float) -> dict:
    """The model (``synthetic.QWEN4_EXP_CONFIG``: 8 layers, PLE on the six linear-attention ones),
    its tables sized to about ``table_bytes``."""
    return with_tables(QWEN4_EXP_CONFIG, table_bytes)


def run(path: Path, memory: str, tokens: int, early: bool) -> dict:
    prompt = torch.randint(3, 32000, (16,), generator=torch.Generator().manual_seed(0)).tolist()
    with sluice.load(path, memory=memory, progress=False, max_context=512) as eng:
        eng.model.early_rows = early
        plan = eng.plan
        r = eng.generate(prompt, max_new_tokens=tokens, ignore_eos=True, speculate=False)
        s = r.stats
        logits = eng.forward(torch.tensor(prompt + r.token_ids[:4]))
        return dict(mode="early" if early else "at_layer", decode_tok_s=s["decode_tok_s"],
                    row_bytes_per_token=s["row_bytes_per_token"], expert_bytes_per_token=s["expert_bytes_per_token"],
                    rows_read_per_token=s["rows_read_per_token"], row_hit_rate=s["row_hit_rate"],
                    direct_io=s["direct_io"], rows_resident=plan.rows_resident, row_cache_bytes=plan.row_bytes,
                    table_bytes=plan.row_table_bytes, tokens=r.token_ids, logits=logits)


def run_prefill(path: Path, memory: str, prompt_len: int, chunk: int, ahead: bool) -> dict:
    prompt = torch.randint(3, 32000, (prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
    with sluice.load(path, memory=memory, progress=False, max_context=prompt_len + 8, prefill_chunk=chunk) as eng:
        eng.model.ahead_rows = ahead
        r = eng.generate(prompt, max_new_tokens=1, ignore_eos=True, speculate=False)
        s = r.stats
        return dict(mode="ahead" if ahead else "own_step", prefill_s=s["ttft_s"], rows_read=s["rows_read"],
                    rows_read_ahead=s["rows_read_ahead"], row_bytes_read=s["row_bytes_read"],
                    bytes_read=s["bytes_read"], tokens=r.token_ids)


def prefill_main(a, path: Path) -> int:
    import os

    runs = {"ahead": [], "own_step": []}
    loads = []
    for i in range(a.rounds):
        order = ("ahead", "own_step") if i % 2 == 0 else ("own_step", "ahead")
        for mode in order:
            loads.append(os.getloadavg()[0])
            runs[mode].append(run_prefill(path, a.memory, a.prompt, a.chunk, mode == "ahead"))
    same = all(r["tokens"] == runs["ahead"][0]["tokens"] for rs in runs.values() for r in rs)
    out = {"memory": a.memory, "prompt": a.prompt, "chunk": a.chunk, "rounds": a.rounds, "same_tokens": same,
           "load": [min(loads), max(loads)], "modes": {}}
    for mode, rs in runs.items():
        out["modes"][mode] = {k: statistics.median(r[k] for r in rs) for k in
                              ("prefill_s", "rows_read", "rows_read_ahead", "row_bytes_read", "bytes_read")}
        out["modes"][mode]["prefill_s_all"] = [round(r["prefill_s"], 3) for r in rs]
    ratios = [b["prefill_s"] / x["prefill_s"] for x, b in zip(runs["ahead"], runs["own_step"])]
    out["own_step_over_ahead"] = [round(x, 3) for x in ratios]
    print(f"prompt {a.prompt} tokens in chunks of {a.chunk} under --memory {a.memory}, {a.rounds} rounds, "
          f"load {min(loads):.1f}-{max(loads):.1f}, same tokens={same}")
    for mode, m in out["modes"].items():
        print(f"  {mode:9s} prefill {m['prefill_s']:.2f} s  rows read {m['rows_read']:.0f} (ahead "
              f"{m['rows_read_ahead']:.0f})  table {format_size(m['row_bytes_read'])}  "
              f"all {format_size(m['bytes_read'])}")
    print(f"  own_step / ahead prefill time per round: {', '.join(f'{x:.2f}' for x in ratios)} "
          f"(median {statistics.median(ratios):.2f})")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0 if same else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=None, help="where to write the model (default: a temporary directory)")
    ap.add_argument("--table-gb", type=float, default=2.0)
    ap.add_argument("--memory", default="800MiB")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--prefill", action="store_true", help="chunked prefill, next chunk's rows ahead or not")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=32)
    a = ap.parse_args()
    root = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="rows-bench-"))
    path = root / "qwen4-exp-synthetic"
    cfg = config(a.table_gb * 1e9)
    if not (path / "config.json").exists():
        write_model(path, cfg, dtype=torch.bfloat16, progress=False)
    if a.prefill:
        return prefill_main(a, path)
    fam = get_family("qwen4_exp_text")
    desc = fam.describe(fam.parse_config(cfg))
    runs = {"early": [], "at_layer": []}
    for _ in range(a.rounds):
        for mode in ("early", "at_layer"):
            runs[mode].append(run(path, a.memory, a.tokens, mode == "early"))
    first = runs["early"][0]
    same = all(r["tokens"] == first["tokens"] and torch.equal(r["logits"], first["logits"])
               for rs in runs.values() for r in rs)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out = {"machine": platform.processor() or platform.machine(), "memory": a.memory, "tokens": a.tokens,
           "rounds": a.rounds, "table_bytes": first["table_bytes"], "row_cache_bytes": first["row_cache_bytes"],
           "rows_resident": first["rows_resident"], "row_tables": len(desc.row_tables),
           "peak_rss_bytes": peak, "bit_identical": same, "direct_io": first["direct_io"], "modes": {}}
    for mode, rs in runs.items():
        out["modes"][mode] = {k: statistics.median(r[k] for r in rs) for k in
                              ("decode_tok_s", "row_bytes_per_token", "expert_bytes_per_token", "rows_read_per_token",
                               "row_hit_rate")}
        out["modes"][mode]["decode_tok_s_all"] = [round(r["decode_tok_s"], 3) for r in rs]
    print(f"tables {format_size(out['table_bytes'])} under --memory {a.memory} (row cache "
          f"{format_size(out['row_cache_bytes'])}, resident={out['rows_resident']}), peak RSS {format_size(peak)}, "
          f"O_DIRECT={out['direct_io']}, bit-identical={same}")
    for mode, m in out["modes"].items():
        print(f"  {mode:9s} {m['decode_tok_s']:.2f} tok/s  table {format_size(m['row_bytes_per_token'])}/token  "
              f"experts {format_size(m['expert_bytes_per_token'])}/token  rows {m['rows_read_per_token']:.1f}/token  "
              f"row hit rate {m['row_hit_rate']:.3f}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
