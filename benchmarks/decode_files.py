"""Which of Sluice's source files one decode token passes through (issue 25's count).

Loads a model, warms it up (a short generation, so a warm token's experts are cached; with
``--cold`` the cache holds one layer's experts only, so the token misses), then records with
``sys.setprofile`` every Python function entered during one more decode token (a
``runner.step`` of one sequence's decode ``SeqWork``) and prints the distinct files under the
package, with the call count per file. Run it on two source trees to compare:

    PYTHONPATH=OLD/src python benchmarks/decode_files.py [--model demo] [--cold]
    PYTHONPATH=src python benchmarks/decode_files.py [--model demo] [--cold]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import sluice


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--cold", action="store_true", help="a cache of one layer's experts: the token misses")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    kw = dict(progress=False, threads=1)
    eng = sluice.load(a.model, memory="2GiB", **kw)
    if a.cold:
        k = eng.desc.top_k
        eng.close()
        eng = sluice.load(a.model, memory="2GiB", cache_experts=k * 2, **kw)
    from sluice.runner import SeqWork

    ids = eng.encode("def fibonacci(n):") if eng.tokenizer is not None else [1, 2, 3]
    eng.generate(ids, max_new_tokens=4, speculate=False)  # warm
    seq = eng.runner.slots[0]
    seq.rewind(0)
    eng.runner.run(seq, ids, 0)
    root = os.path.dirname(sluice.__file__)
    calls: collections.Counter = collections.Counter()

    def prof(frame, event, arg):
        if event == "call":
            f = frame.f_code.co_filename
            if f.startswith(root):
                calls[os.path.relpath(f, root)] += 1

    token = [ids[-1]]
    sys.setprofile(prof)
    try:
        eng.runner.step([SeqWork(seq, token, seq.length, 1, True)])
    finally:
        sys.setprofile(None)
    eng.close()
    if a.json:
        print(json.dumps({"files": len(calls), "calls": dict(calls)}))
    else:
        for f, n in sorted(calls.items(), key=lambda x: -x[1]):
            print(f"{n:6d}  {f}")
        print(f"{len(calls)} files, {sum(calls.values())} Python calls ({'cold' if a.cold else 'warm'} decode token)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
