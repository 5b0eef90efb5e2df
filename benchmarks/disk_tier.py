"""What a read from the local disk tier costs beside the same read from a local file (docs/remote.md).

    PYTHONPATH=src python benchmarks/disk_tier.py --dir /var/tmp/sluice-bench --total 1GB --rounds 5

A file of ``--total`` random bytes is cut into records of each ``--record`` size; every record
is put into a fresh tier in that directory (the entries a cold run would write). Then, in random
order, every record is read (A) from the file with ``LocalFile.read_aligned`` into a page-aligned
buffer (what the expert readers do for a local model; O_DIRECT where the filesystem allows it)
and (B) through ``DiskTier.get`` into the same buffer (open the entry and check its header on
its first read, since kept open; read the payload with O_DIRECT, check its CRC-32). The arms
alternate (AB, BA, ...) so that the noise
of a shared machine falls on both; per arm the median GB/s over ``--rounds`` passes is printed
with the ratio B/A, and the insert rate of the cold pass (write, fsync, rename, index).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

from sluice.storage import AlignedBuffer, LocalFile
from sluice.storage.disk_tier import DiskTier, Key, entry_size
from sluice.units import format_size, parse_size


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True, help="a directory on the disk to measure (a tier and a file go there)")
    p.add_argument("--total", default="512MiB", help="bytes read per pass (default 512MiB)")
    p.add_argument("--record", action="append", default=None,
                   help="record size, repeatable (default 1MiB, 4MiB, 16MiB)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    total = parse_size(args.total)
    blob = root / "blob.bin"
    with open(blob, "wb") as f:
        for _ in range(0, total, 64 << 20):
            f.write(os.urandom(min(64 << 20, total)))
    src = LocalFile(str(blob))
    rows = []
    try:
        for rec in [parse_size(r) for r in (args.record or ["1MiB", "4MiB", "16MiB"])]:
            tier_dir = root / "tier"
            shutil.rmtree(tier_dir, ignore_errors=True)
            tier = DiskTier(tier_dir, entry_size(rec) * (total // rec) + (1 << 20))
            buf = AlignedBuffer(rec, huge=True)
            n = total // rec
            t0 = time.perf_counter()
            for i in range(n):
                assert src.read_aligned(buf.view(0, rec), i * rec) == rec
                assert tier.put(Key(str(blob), src.version, i * rec, rec), buf.view(0, rec), "bench")
            insert_s = time.perf_counter() - t0
            rates: dict[str, list[float]] = {"file": [], "tier": []}
            for r in range(args.rounds):
                order = list(range(n))
                random.Random(r).shuffle(order)
                for arm in (("file", "tier") if r % 2 == 0 else ("tier", "file")):
                    t0 = time.perf_counter()
                    for i in order:
                        if arm == "file":
                            assert src.read_aligned(buf.view(0, rec), i * rec) == rec
                        else:
                            assert tier.get(Key(str(blob), src.version, i * rec, rec), buf.view(0, rec))
                    rates[arm].append(n * rec / (time.perf_counter() - t0) / 1e9)
            tier.close()
            f, t = statistics.median(rates["file"]), statistics.median(rates["tier"])
            rows.append({"record_bytes": rec, "records": n, "file_gb_s": f, "tier_gb_s": t, "ratio": t / f,
                         "insert_gb_s": n * rec / insert_s / 1e9, "direct_io": src.direct_io,
                         "load": os.getloadavg()[0]})
    finally:
        src.close()
        shutil.rmtree(root / "tier", ignore_errors=True)
        blob.unlink()
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"{'record':>8} {'file GB/s':>10} {'tier GB/s':>10} {'tier/file':>10} {'insert GB/s':>12}  (O_DIRECT: "
              f"{rows[0]['direct_io']}, load {rows[-1]['load']:.1f})")
        for r in rows:
            print(f"{format_size(r['record_bytes']):>8} {r['file_gb_s']:10.2f} {r['tier_gb_s']:10.2f} "
                  f"{r['ratio']:10.2f} {r['insert_gb_s']:12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
