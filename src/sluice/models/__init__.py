"""Model families, one module per Hugging Face ``model_type``, found by what they declare.

A family module is a module of this package with a ``MODEL_TYPE`` (and optionally
``ALIASES``: other model types read as this family); adding one needs no edit here.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from types import ModuleType

from ..errors import UnsupportedModelError


@functools.cache
def families() -> dict[str, str]:
    """model_type -> family module name, for every family module of this package."""
    out: dict[str, str] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"{__name__}.{info.name}")
        model_type = getattr(mod, "MODEL_TYPE", None)
        if model_type is None:
            continue  # a shared module (base, config, declare, parts, ...)
        for t in (model_type, *getattr(mod, "ALIASES", ())):
            if t in out:
                raise RuntimeError(f"model_type {t!r} is declared by both models/{out[t]}.py and models/{info.name}.py")
            out[t] = info.name
    return out


def get_family(model_type: str | None) -> ModuleType:
    """The family module for ``model_type``; a clear error listing what is supported."""
    table = families()
    mod = table.get(model_type or "")
    if mod is None:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported (supported: {', '.join(sorted(table))})"
        )
    return importlib.import_module(f"{__name__}.{mod}")
