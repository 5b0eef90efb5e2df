"""What every engine arm shares: arguments, the handshake with the harness, the result line.

An arm is a small script run by the harness in the engine's own venv (so it imports only
the standard library and its engine). It prints ``@@MARK name`` at phase boundaries and
waits for the harness to answer one line: the harness samples ``/proc/<pid>/io`` and
``/proc/<pid>/status`` from outside at that moment, the same way for every engine. The
last thing an arm prints is ``@@RESULT {json}``, then a final mark, so that the harness
reads the process's counters before it exits.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", required=True, help="model path (directory or file) for this engine")
    p.add_argument("--ids", required=True, help="prompt token ids, comma-separated")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--memory", type=int, default=None, help="memory cap in bytes (engines that take one)")
    p.add_argument("--warmup", action="store_true", help="generate once before the measured run")
    p.add_argument("--scratch", default=None, help="a directory the engine may write to")
    p.add_argument("--option", action="append", default=[], metavar="KEY=JSON", help="engine-specific option")
    p.add_argument("--profile", default=None, help="write a cProfile of the measured run here")
    return p


def options(args) -> dict:
    out = {}
    for item in args.option:
        k, _, v = item.partition("=")
        out[k] = json.loads(v)
    return out


def ids(args) -> list[int]:
    return [int(x) for x in args.ids.split(",") if x]


def mark(name: str) -> None:
    """Tell the harness a phase ended and wait until it has sampled this process."""
    sys.stdout.write(f"@@MARK {name}\n")
    sys.stdout.flush()
    sys.stdin.readline()


class Clock:
    """Token timestamps for one generation: t_start (call), then one per generated token."""

    def __init__(self):
        self.t_start = time.perf_counter()
        self.times: list[float] = []
        self.tokens: list[int] = []

    def token(self, tok: int) -> None:
        self.times.append(time.perf_counter())
        self.tokens.append(int(tok))
        if len(self.times) == 1:
            mark("first_token")

    def summary(self, prompt_tokens: int) -> dict:
        t = self.times
        ttft = t[0] - self.t_start if t else None
        steady = (len(t) - 2) / (t[-1] - t[1]) if len(t) > 2 and t[-1] > t[1] else None
        return {
            "token_ids": self.tokens,
            "prompt_tokens": prompt_tokens,
            "generated_tokens": len(t),
            "ttft_s": ttft,
            "prefill_tok_s": prompt_tokens / ttft if ttft else None,
            "decode_tok_s": steady,  # steady state: the first decode step (token 1 -> 2) is excluded
            "token_times_s": [x - self.t_start for x in t],
            "total_s": (t[-1] - self.t_start) if t else None,
        }


def finish(result: dict) -> None:
    sys.stdout.write("@@RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()
    mark("end")


def profiled(path: str | None, fn):
    """Run ``fn()``, under cProfile when ``path`` is given (stats written there)."""
    if not path:
        return fn()
    import cProfile

    prof = cProfile.Profile()
    try:
        return prof.runcall(fn)
    finally:
        prof.dump_stats(path)
