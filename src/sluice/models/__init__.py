"""Model families, one module per Hugging Face ``model_type``, looked up in a registry."""

from __future__ import annotations

import importlib
from types import ModuleType

from ..errors import UnsupportedModelError

FAMILIES = {
    "mixtral": "mixtral",
    "qwen3_moe": "qwen3_moe",
    "olmoe": "olmoe",
    "qwen3_next": "qwen3_next",
    "kimi_linear": "kimi_linear",
    "deepseek_v3": "deepseek_v3",
    "kimi_k2": "deepseek_v3",  # Kimi K2 ships the DeepSeek-V3 architecture under its own model_type
    "gpt_oss": "gpt_oss",
}


def get_family(model_type: str | None) -> ModuleType:
    """The family module for ``model_type``; a clear error listing what is supported."""
    mod = FAMILIES.get(model_type or "")
    if mod is None:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported (supported: {', '.join(sorted(FAMILIES))})"
        )
    return importlib.import_module(f"{__name__}.{mod}")
