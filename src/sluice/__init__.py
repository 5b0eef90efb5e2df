"""Sluice: run Mixture-of-Experts language models larger than memory, token-exact.

    import sluice
    engine = sluice.load("./Qwen3-30B-A3B", memory="8GiB")
    result = engine.generate("The capital of France is", max_new_tokens=32)
    print(result.text, result.stats["decode_tok_s"])
"""

from .engine import Engine, Options, Result, Step, load
from .errors import (
    BudgetError,
    CheckpointError,
    ExpertReadError,
    GenerationCancelled,
    SluiceError,
    UnsupportedModelError,
)
from .units import format_size, parse_size

__version__ = "0.1.0"

__all__ = [
    "BudgetError", "CheckpointError", "Engine", "ExpertReadError", "GenerationCancelled", "Options", "Result",
    "SluiceError", "Step", "UnsupportedModelError", "format_size", "load", "parse_size", "__version__",
]
