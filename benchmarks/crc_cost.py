"""What verifying expert-record CRCs costs (docs/reliability.md).

    PYTHONPATH=src python benchmarks/crc_cost.py --size 1.5GB --rounds 7 --tokens 32

1. CRC-32 throughput on one core (GB/s): zlib's, and Sluice's (the same function with
   carry-less multiplication in the C kernels), which checks every record.
2. A synthetic random-weight Qwen3-MoE of ``--size`` (bf16), converted to a container (Hugging
   Face directories carry no checksums), run with an expert cache of ``--cache-share`` of its
   experts. One engine; for each measurement the expert cache is emptied (reads then go to
   the disk through O_DIRECT: a cold decode), and ``--tokens`` tokens are decoded with
   verification on (A) or off (B). The arms alternate (ABAB.., BABA.. in turn) so that the
   noise of a shared machine falls on both; medians are reported, and the CRC's own thread
   CPU-seconds per token (counted on the reader threads).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

import sluice
from sluice.bench import drop_cache
from sluice.convert import convert
from sluice.storage.crc import FAST, crc32
from sluice.synthetic import DEMO_CONFIG, model_bytes, scaled_config, write_model
from sluice.units import parse_size


def crc_rate(fn, nbytes: int, seconds: float = 1.0) -> float:
    """``fn`` (a CRC-32 function) bytes per second on one core over a buffer of ``nbytes`` (best of 3)."""
    buf = bytes(range(256)) * (nbytes // 256)
    best = 0.0
    for _ in range(3):
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds / 3:
            fn(buf)
            n += 1
        best = max(best, n * len(buf) / (time.perf_counter() - t0))
    return best


def decode(eng, ids: list[int], tokens: int, verify: bool, seed: int) -> dict:
    eng.experts.verify_reads = verify
    src = eng.experts_source
    drop_cache(eng)
    b0, s0 = src.crc_bytes, src.crc_s
    c0 = time.process_time()
    r = eng.generate(ids, max_new_tokens=tokens, ignore_eos=True, speculate=False, temperature=1.0, seed=seed,
                     reuse_prefix=True)
    cpu = time.process_time() - c0
    st = r.stats
    n = max(1, st["generated_tokens"])
    return {"verify": verify, "decode_tok_s": st["decode_tok_s"], "tokens": n, "cpu_s_per_token": cpu / n,
            "expert_bytes_per_token": st["bytes_read"] / n,
            "crc_bytes_per_token": (src.crc_bytes - b0) / n, "crc_cpu_s_per_token": (src.crc_s - s0) / n}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1.5GB", help="synthetic model size (default 1.5GB)")
    ap.add_argument("--rounds", type=int, default=7, help="A/B pairs (default 7)")
    ap.add_argument("--tokens", type=int, default=32, help="decoded tokens per measurement (default 32)")
    ap.add_argument("--cache-share", type=float, default=0.25, help="expert cache as a share of all experts")
    ap.add_argument("--threads", type=int, default=None, help="compute threads (default: all cores)")
    ap.add_argument("--workdir", default=None, help="where the model is written (default: a temporary directory)")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args(argv)

    out = {"crc_gb_s_per_core": {f"{name} {mb} MiB": crc_rate(fn, mb << 20) / 1e9
                                 for name, fn in (("zlib", zlib.crc32), ("sluice", crc32)) for mb in (1, 4)},
           "sluice_crc_uses_clmul": FAST}
    print(f"CRC-32 on one core, GB/s: {json.dumps(out['crc_gb_s_per_core'])}", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        cfg = scaled_config(parse_size(args.size), DEMO_CONFIG)
        hf = write_model(Path(tmp) / "hf", cfg, progress=False, tokenizer=False)
        box = convert(hf, Path(tmp) / "box.sluice", progress=False)
        eng = sluice.load(box, memory="8GiB", progress=False, threads=args.threads,
                          cache_experts=max(1, int(args.cache_share * cfg["num_experts"] * len(eng_layers(cfg)))))
        ids = [(i * 7919) % (eng.desc.vocab - 3) + 3 for i in range(32)]
        ids += eng.generate(ids, max_new_tokens=1, ignore_eos=True, speculate=False).token_ids
        decode(eng, ids, 4, True, 0)  # warm-up (the code paths, not the cache: every run starts cold)
        runs = []
        for r in range(args.rounds):
            order = (True, False) if r % 2 == 0 else (False, True)
            for verify in order:
                runs.append(decode(eng, ids, args.tokens, verify, seed=r))
                print(json.dumps(runs[-1]), file=sys.stderr)
        eng.close()
        a = [x for x in runs if x["verify"]]
        b = [x for x in runs if not x["verify"]]
        on, off = [x["decode_tok_s"] for x in a], [x["decode_tok_s"] for x in b]
        ratios = [x["decode_tok_s"] / y["decode_tok_s"] for x, y in zip(a, b)]  # the pair of each round
        cpu_on = statistics.median(x["cpu_s_per_token"] for x in a)
        cpu_off = statistics.median(x["cpu_s_per_token"] for x in b)
        crc_cpu = statistics.median(x["crc_cpu_s_per_token"] for x in a)
        q = statistics.quantiles(on + off, n=4)
        out.update({
            "model_bytes": model_bytes(cfg), "experts": cfg["num_experts"], "rounds": args.rounds,
            "tokens": args.tokens, "cache_share": args.cache_share, "threads": args.threads,
            "median_tok_s_verify": statistics.median(on), "median_tok_s_no_verify": statistics.median(off),
            "overhead_of_medians": 1 - statistics.median(on) / statistics.median(off),
            "median_paired_overhead": 1 - statistics.median(ratios),
            "tok_s_quartiles_all_runs": q,
            "median_cpu_s_per_token_verify": cpu_on, "median_cpu_s_per_token_no_verify": cpu_off,
            "cpu_overhead_of_medians": cpu_on / cpu_off - 1,
            # the CRC's own CPU time against the time of a token: the most it can add to a decode
            # if it ran entirely on the critical path
            "crc_share_of_token_time": crc_cpu * statistics.median(off),
            "crc_cpu_s_per_token": crc_cpu,
            "crc_bytes_per_token": statistics.median(x["crc_bytes_per_token"] for x in runs if x["verify"]),
            "expert_bytes_per_token": statistics.median(x["expert_bytes_per_token"] for x in runs),
            "runs": runs,
        })
    summary = {k: v for k, v in out.items() if k != "runs"}
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


def eng_layers(cfg: dict) -> list[int]:
    """MoE layers of a Qwen3-MoE config (all but mlp_only_layers, every decoder_sparse_step)."""
    step = cfg.get("decoder_sparse_step", 1) or 1
    skip = set(cfg.get("mlp_only_layers") or [])
    return [i for i in range(cfg["num_hidden_layers"]) if i not in skip and (i + 1) % step == 0]


if __name__ == "__main__":
    sys.exit(main())
