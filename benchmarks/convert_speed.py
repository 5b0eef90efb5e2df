"""Conversion speed and peak memory of ``sluice convert``, per expert format and model size.

Writes a synthetic Qwen3-MoE model of each size (random weights; the expert count scales
the size), then converts it to each format, one at a time, ``--repeats`` times, each in a
fresh process. The time counts from just before ``convert()`` is called to its return
(start-up and imports excluded); MB/s is the source checkpoint's weight bytes over that
time, peak RSS the process's high-water mark. Reports medians, and the 1-minute load
average before and after each format (the machine may be shared).

    PYTHONPATH=src python benchmarks/convert_speed.py --sizes 0.6GB,1.2GB \
        --formats f32,bf16,int8,q4,mxfp4 --repeats 3 --root /tmp/convert-speed
    PYTHONPATH=src python benchmarks/convert_speed.py --sizes 0.1GB,0.3GB --formats rvq3 --repeats 3

Side by side (``--trees``): each repeat converts with every listed source tree in turn (the
trees' ``src`` directories go first on PYTHONPATH), so that a shared machine's load hits them
alike; ``--model`` converts an existing checkpoint directory instead of synthetic ones:

    PYTHONPATH=src python benchmarks/convert_speed.py --sizes 0.3GB --formats q4,mxfp4,int8 \
        --trees before=../old/src,after=src --repeats 3 --root /tmp/convert-speed
    PYTHONPATH=src python benchmarks/convert_speed.py --model src/sluice/demo_model --formats rvq3 \
        --trees before=../old/src,after=src --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import sluice  # noqa: F401  (before torch: it sets OpenMP's wait policy)
import torch

from sluice.units import parse_size

CHILD = r"""
import json, sys, time
import sluice
from sluice.checkpoint import Checkpoint
from sluice.convert import convert
from sluice.sysmem import peak_rss
src, dst, fmt = sys.argv[1:4]
ck = Checkpoint(src)
nbytes = sum(t.nbytes for t in ck.tensors.values())
ck.close()
t0 = time.perf_counter()
c0 = time.process_time()
convert(src, dst, experts=fmt, progress=False, force=True)
dt = time.perf_counter() - t0
print(json.dumps({"seconds": dt, "cpu_seconds": time.process_time() - c0, "source_bytes": nbytes,
                  "peak_rss": peak_rss()}))
"""


def one(src: Path, dst: Path, fmt: str, tree: str | None = None) -> dict:
    env = dict(os.environ)
    if tree:
        inherited = [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []
        env["PYTHONPATH"] = os.pathsep.join([str(Path(tree).resolve())] + inherited)
    out = subprocess.run([sys.executable, "-c", CHILD, str(src), str(dst), fmt],
                         capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"convert {src} -> {fmt} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _row(size: str, fmt: str, tree: str, runs: list[dict], load: list[float], repeats: int) -> dict:
    src_bytes = runs[0]["source_bytes"]
    sec = statistics.median(r["seconds"] for r in runs)
    cpu = statistics.median(r["cpu_seconds"] for r in runs)
    row = {"size": size, "source_bytes": src_bytes, "format": fmt, "tree": tree, "seconds": sec, "cpu_seconds": cpu,
           "mb_per_s": src_bytes / sec / 1e6, "mb_per_cpu_s": src_bytes / cpu / 1e6,
           "peak_rss_mib": statistics.median(r["peak_rss"] for r in runs) / 2**20,
           "all_seconds": [r["seconds"] for r in runs], "load": load}
    label = f"{fmt}{' ' + tree if tree else ''}"
    print(f"{size:>6} {src_bytes / 1e9:5.2f} GB {label:>14}: {row['mb_per_s']:7.1f} MB/s "
          f"({row['mb_per_cpu_s']:7.1f} MB/cpu-s) median of {repeats} "
          f"[{', '.join(f'{s:.1f}' for s in row['all_seconds'])} s], peak RSS "
          f"{row['peak_rss_mib']:.0f} MiB, load {load[0]:.1f} -> {load[1]:.1f}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="0.6GB,1.2GB", help="model sizes (source bytes, bf16)")
    ap.add_argument("--formats", default="f32,bf16,int8,q4,mxfp4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "f32"], help="dtype of the synthetic source model")
    ap.add_argument("--root", default=None, help="work directory (default: a temporary one, removed at the end)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--model", default=None, help="convert this checkpoint directory instead of synthetic models")
    ap.add_argument("--trees", default=None,
                    help="NAME=SRC,... source trees to compare side by side (each repeat runs every tree in turn)")
    args = ap.parse_args()
    from sluice.synthetic import scaled_config, write_model

    dtype = {"bf16": torch.bfloat16, "f32": torch.float32}[args.dtype]
    root = Path(args.root) if args.root else Path(tempfile.mkdtemp(prefix="convert-speed-"))
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        trees = [t.split("=", 1) for t in args.trees.split(",")] if args.trees else [["", None]]
        models = [(Path(args.model).name, Path(args.model))] if args.model else []
        for size in [] if args.model else args.sizes.split(","):
            model = root / f"model-{size}-{args.dtype}"
            if not (model / "config.json").exists():
                write_model(model, scaled_config(parse_size(size), dtype=dtype), dtype=dtype, progress=False,
                            tokenizer=False)
            models.append((size, model))
        for size, model in models:
            for fmt in args.formats.split(","):
                load0 = os.getloadavg()[0]
                runs: dict[str, list[dict]] = {name: [] for name, _ in trees}
                for _ in range(args.repeats):
                    for name, tree in trees:
                        runs[name].append(one(model, root / f"out-{fmt}.sluice", fmt, tree))
                load1 = os.getloadavg()[0]
                shutil.rmtree(root / f"out-{fmt}.sluice", ignore_errors=True)
                for name, _ in trees:
                    rows.append(_row(size, fmt, name, runs[name], [load0, load1], args.repeats))
    finally:
        if not args.root:
            shutil.rmtree(root, ignore_errors=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
