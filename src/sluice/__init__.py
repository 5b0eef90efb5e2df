"""Sluice: run Mixture-of-Experts language models larger than memory, token-exact.

    import sluice
    engine = sluice.load("./Qwen3-30B-A3B", memory="8GiB")
    result = engine.generate("The capital of France is", max_new_tokens=32)
    print(result.text, result.stats["decode_tok_s"])
"""

import os as _os
import sys as _sys

# OpenMP threads that spin while they wait stall every parallel region when another process
# holds a core: a 512-token prefill of the demo model took 9-22 s instead of 0.15 s on a busy
# 2-core machine (docs/optimizations.md). Sleeping waiters cost microseconds per region. The
# setting is read when torch's OpenMP runtime loads, so it applies only if torch is not yet
# imported; a user's own OMP_WAIT_POLICY wins.
if "torch" not in _sys.modules:
    _os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
elif "OMP_WAIT_POLICY" not in _os.environ:
    import warnings as _warnings

    _warnings.warn("torch was imported before sluice, so its OpenMP threads spin while they wait: on a busy "
                   "machine multi-threaded prefill can run many times slower. Import sluice first, or set "
                   "OMP_WAIT_POLICY=PASSIVE in the environment.", RuntimeWarning, stacklevel=2)

from .errors import (
    BudgetError,
    ChatTemplateError,
    CheckpointError,
    ConfigError,
    ConvertError,
    ExpertReadError,
    GenerationCancelled,
    InvalidArgumentError,
    SluiceError,
    UnsupportedModelError,
)
from .units import format_size, parse_size

__version__ = "0.1.0"

# The engine (and with it torch, a second or more to import) loads on first use of one of these
# names, so `import sluice`, `sluice --help` and `sluice --version` stay fast
# (benchmarks/cli_startup.py). The OMP_WAIT_POLICY default above is set before that happens.
_ENGINE_EXPORTS = ("DebugOptions", "Engine", "Options", "PrefetchOptions", "Result", "Step", "load")


def __getattr__(name: str):
    if name in _ENGINE_EXPORTS:
        from . import engine

        value = getattr(engine, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'sluice' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_ENGINE_EXPORTS))


__all__ = [
    "BudgetError", "ChatTemplateError", "CheckpointError", "ConfigError", "ConvertError", "DebugOptions", "Engine",
    "ExpertReadError", "GenerationCancelled", "InvalidArgumentError", "Options", "PrefetchOptions", "Result",
    "SluiceError", "Step", "UnsupportedModelError", "format_size", "load", "parse_size", "__version__",
]
