"""Start-up time of the command line and of ``import sluice``.

    PYTHONPATH=src python benchmarks/cli_startup.py [--runs 15] [--src OTHER/src --label before] [--json FILE]

Times, in fresh interpreters, ``sluice --help``, ``sluice --version``, ``sluice run --help``,
``sluice serve --help`` and ``python -c "import sluice"``, plus ``python -c pass`` (the interpreter's
own floor), and prints the median and minimum wall time of each over ``--runs`` runs. Each
``sluice ...`` command runs what the installed ``sluice`` script runs (``from sluice.cli import
main; sys.exit(main())``), with ``PYTHONPATH`` set to ``--src`` (default: this checkout's
``src``), so another checkout's code, e.g. an older commit, can be timed the same way for a
before/after comparison. Runs of the commands are interleaved so a background load affects
them alike. Numbers: docs/benchmarks.md, "Start-up time".
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

ENTRY = "import sys; from sluice.cli import main; sys.exit(main())"

COMMANDS = {
    "python -c pass": ["-c", "pass"],
    "python -c 'import sluice'": ["-c", "import sluice"],
    "sluice --help": ["-c", ENTRY, "--help"],
    "sluice --version": ["-c", ENTRY, "--version"],
    "sluice run --help": ["-c", ENTRY, "run", "--help"],
    "sluice serve --help": ["-c", ENTRY, "serve", "--help"],
}


def time_once(args: list[str], env: dict) -> float:
    t = time.perf_counter()
    out = subprocess.run([sys.executable, *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    elapsed = time.perf_counter() - t
    if out.returncode != 0:
        raise SystemExit(f"{args} failed ({out.returncode}): {out.stderr.decode()[-2000:]}")
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=15, help="runs per command (default 15)")
    ap.add_argument("--src", default=str(Path(__file__).resolve().parent.parent / "src"),
                    help="directory holding the sluice package to time (default: this checkout's src)")
    ap.add_argument("--label", default="this checkout", help="name of this measurement in the output")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    args = ap.parse_args()

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = args.src
    for cmd in COMMANDS.values():  # warm the file system cache and the .pyc files
        time_once(cmd, env)
    samples: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(args.runs):
        for name, cmd in COMMANDS.items():
            samples[name].append(time_once(cmd, env))

    print(f"{args.label}: {args.src}, {args.runs} runs each, load average {os.getloadavg()[0]:.2f}")
    print(f"{'command':<28} {'median s':>9} {'min s':>7}")
    rows = []
    for name, xs in samples.items():
        rows.append({"command": name, "median_s": statistics.median(xs), "min_s": min(xs), "runs": xs})
        print(f"{name:<28} {statistics.median(xs):>9.3f} {min(xs):>7.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"label": args.label, "python": sys.version.split()[0],
                                               "cpus": os.cpu_count(), "results": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
