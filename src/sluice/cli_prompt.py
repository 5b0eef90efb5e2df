"""The command line's check of a prompt before the weights load (``prompt_fit``'s rule)."""

from __future__ import annotations

from .prompt_fit import check


def precheck(model, prompt: str, *, revision=None, max_context: int | None = None) -> None:
    """Before ``load``: refuse a text prompt that cannot fit, reading only the model's config and
    tokenizer (a local model; a URL's is checked after loading, by the engine)."""
    from .engine import DEFAULT_MAX_CONTEXT, ModelInfo
    from .storage.location import is_url

    if not isinstance(prompt, str) or is_url(str(model)):
        return
    info = ModelInfo(model, revision=revision)
    try:
        if info.tokenizer is None:
            return
        limit = info.desc.max_position_embeddings
        ctx = min(max_context, limit) if max_context else min(limit, DEFAULT_MAX_CONTEXT)
        if max_context and max_context > limit:
            return  # the engine names that error itself
        check(len(info.tokenizer.encode(prompt)), ctx, limit)
    finally:
        info.close()
