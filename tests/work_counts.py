"""A pytest plugin that counts the expensive work a run does: ``-p work_counts``.

Wall times on a shared machine are noisy; these counts are not. It counts (and times) what
the model tests spend their time on: transformers checkpoints built (``from_config``) and
saved, ``from_pretrained`` loads, top-level transformers forward passes (outside and inside
``generate``), engine opens, engine forwards and generations, and conversions. The totals
print at the end of the run, with the test files doing the most of each; with
``SLUICE_WORK_COUNTS=<file>`` they are also written there as JSON (docs/testing.md).
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections import Counter, defaultdict

COUNTS: Counter = Counter()
SECONDS: Counter = Counter()
BY_FILE: dict = defaultdict(Counter)
_state = {"file": "(setup)", "depth": 0, "gen": 0}


def _count(name: str, timed: bool = True, nested: str | None = None):
    """Wrap a function: count each call as ``name`` (as ``nested`` inside a counted call), time the outermost."""

    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            key = nested if (nested and _state["depth"]) else name
            COUNTS[key] += 1
            BY_FILE[_state["file"]][key] += 1
            if not timed or _state["depth"]:
                return fn(*args, **kwargs)
            _state["depth"] += 1
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                SECONDS[key] += time.perf_counter() - t
                _state["depth"] -= 1

        return inner

    return wrap


def _patch_transformers() -> None:
    from transformers import PreTrainedModel
    from transformers.generation.utils import GenerationMixin
    from transformers.models.auto.auto_factory import _BaseAutoModelClass

    PreTrainedModel.save_pretrained = _count("hf save_pretrained")(PreTrainedModel.save_pretrained)
    fp = PreTrainedModel.from_pretrained.__func__
    PreTrainedModel.from_pretrained = classmethod(_count("hf from_pretrained")(fp))
    fc = _BaseAutoModelClass.from_config.__func__
    _BaseAutoModelClass.from_config = classmethod(_count("hf from_config")(fc))
    GenerationMixin.generate = _count("hf generate")(GenerationMixin.generate)
    call = PreTrainedModel.__call__

    def forward(self, *args, **kwargs):
        top = not _state["gen"]
        _state["gen"] += 1
        try:
            if top:  # a forward the test asked for (not a generate step, not a submodule)
                return _count("hf forward", nested="hf forward (in generate)")(call)(self, *args, **kwargs)
            return call(self, *args, **kwargs)
        finally:
            _state["gen"] -= 1

    PreTrainedModel.__call__ = forward


def _patch_sluice() -> None:
    import sluice.convert
    import sluice.engine

    sluice.engine.Engine.__init__ = _count("engine open")(sluice.engine.Engine.__init__)
    sluice.engine.Engine.forward = _count("engine forward", nested="engine forward (nested)")(
        sluice.engine.Engine.forward)
    sluice.engine.Engine.generate = _count("engine generate", nested="engine generate (nested)")(
        sluice.engine.Engine.generate)
    sluice.convert.convert = _count("convert")(sluice.convert.convert)


def pytest_configure(config) -> None:
    _patch_transformers()
    _patch_sluice()


def pytest_runtest_logstart(nodeid, location) -> None:
    _state["file"] = nodeid.split("::")[0]


def pytest_terminal_summary(terminalreporter) -> None:
    tr = terminalreporter
    tr.section("work counts")
    for name in sorted(COUNTS):
        top = sorted(((c[name], f) for f, c in BY_FILE.items() if c[name]), reverse=True)[:3]
        where = ", ".join(f"{f.rsplit('/', 1)[-1]} {n}" for n, f in top)
        tr.write_line(f"{name:28s} {COUNTS[name]:6d}  {SECONDS.get(name, 0):8.1f} s   ({where})")
    out = os.environ.get("SLUICE_WORK_COUNTS")
    if out:
        with open(out, "w") as f:
            json.dump({"counts": dict(COUNTS), "seconds": {k: round(v, 2) for k, v in SECONDS.items()},
                       "by_file": {k: dict(v) for k, v in BY_FILE.items()}}, f, indent=1, sort_keys=True)
