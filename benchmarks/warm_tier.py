"""Warm disk tier decode beside local-disk decode, and the tier's hit read in one C call or split.

    PYTHONPATH=src python benchmarks/warm_tier.py --rounds 11

The model of ``benchmarks/remote.py`` (a synthetic Qwen3-MoE checkpoint, 8 layers of 16 experts
of 3.15 MB, in 8 MB shards, written once under ``--models``) is served by nginx on loopback
(``tests/remote_servers.py``; no proxy: a warm tier fetches no expert bytes, only the files'
HEADs). One run fills a fresh tier; then each round runs, in a random order, three cold-cache
decodes (``remote.decode_run``: a new engine, 32 expert slots, an 8-token prompt, ``--tokens``
greedy tokens, decode timed from the end of the first decode step):

- ``local``: the local directory (O_DIRECT reads);
- ``one-call``: the URL through the warm tier, a hit on a kept-open entry read and checked by
  ``sk_pread_crc32`` (kernels/crc32.c: pread and CRC-32 in one call without the GIL);
- ``split``: the same, with that call switched off (``os.preadv``, then the CRC kernel with the
  GIL held: the build before it).

Printed: per round the three tok/s and the load average; medians; and the medians of the paired
per-round ratios (each warm arm / local, one-call / split), which is what docs/remote.md reports.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH), str(BENCH.parent / "tests")]

import remote as rb  # noqa: E402  (benchmarks/remote.py: the model and one decode run)
from remote_servers import CLIENT_ENV, NginxServer  # noqa: E402

from sluice.storage import crc as crcmod  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=os.path.expanduser("~/.cache/sluice-bench/models"))
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--tokens", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    os.environ.update(CLIENT_ENV)
    model = rb.make_model(Path(args.models), 8, 16, 8)
    prompt = list(range(100, 108))
    opts = {"cache_experts": 32, "reader_threads": 4}
    root = Path(tempfile.mkdtemp(prefix="sluice-warm-tier-"))
    (root / "doc").mkdir()
    (root / "doc" / rb.NAME).symlink_to(model)
    http = NginxServer(root / "doc", root / "nginx")
    one_call = crcmod._pread_crc
    if one_call is None:
        print("this build has no sk_pread_crc32 (C kernels not built?): the one-call arm would be the split one")
        return 1
    try:
        url = f"{http.url}/{rb.NAME}"
        tier = dict(opts, disk_cache="2GB", disk_cache_dir=str(root / "tier"))
        rb.decode_run(url, prompt, args.tokens, **tier)  # fills the tier
        res: dict[str, list[float]] = {"local": [], "one-call": [], "split": []}
        loads = []
        for r in range(args.rounds):
            arms = list(res)
            random.shuffle(arms)
            for arm in arms:
                crcmod._pread_crc = one_call if arm == "one-call" else None
                warm = arm != "local"
                out = rb.decode_run(url if warm else str(model), prompt, args.tokens, **(tier if warm else opts))
                if warm and out["disk_tier_misses"] > 2:  # the warm tier serves (nearly) everything
                    raise SystemExit(f"the tier missed {out['disk_tier_misses']} reads: not warm")
                res[arm].append(out["decode_tok_s"])
            loads.append(os.getloadavg()[0])
            speeds = ", ".join(f"{k} {v[-1]:.2f}" for k, v in res.items())
            print(f"round {r}: {speeds} tok/s, load {loads[-1]:.1f}", flush=True)
    finally:
        crcmod._pread_crc = one_call
        http.close()
        shutil.rmtree(root, ignore_errors=True)

    def paired(a, b):
        return statistics.median(x / y for x, y in zip(res[a], res[b]))

    summary = {"median_tok_s": {k: statistics.median(v) for k, v in res.items()},
               "one-call/local": paired("one-call", "local"), "split/local": paired("split", "local"),
               "one-call/split": paired("one-call", "split"), "load": [min(loads), max(loads)], "runs": res}
    print("medians: " + ", ".join(f"{k} {v:.2f}" for k, v in summary["median_tok_s"].items()) + " tok/s; paired: "
          f"one-call/local {summary['one-call/local']:.3f}, split/local {summary['split/local']:.3f}, "
          f"one-call/split {summary['one-call/split']:.3f} (load {min(loads):.1f}-{max(loads):.1f})")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
