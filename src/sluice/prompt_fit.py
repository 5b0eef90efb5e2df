"""Whether a prompt fits the context, and what to do when it does not.

The context (``--max-context``) can be raised only up to the model's own limit, its
``max_position_embeddings``; a prompt longer than that limit cannot run at all, and the message
says so instead of suggesting ``--max-context``. ``cli_prompt.precheck`` runs the same test on
the command line before the model's weights are loaded (the tokenizer and config only).
"""

from __future__ import annotations

from .errors import InvalidArgumentError


def check(n_tokens: int, max_context: int, model_limit: int | None) -> None:
    """``InvalidArgumentError`` unless a prompt of ``n_tokens`` leaves room in the context (at
    least one token to generate)."""
    if n_tokens < max_context:
        return
    if model_limit is not None and n_tokens >= model_limit:
        raise InvalidArgumentError(
            f"prompt of {n_tokens} tokens does not fit the model's own limit of {model_limit} positions "
            "(max_position_embeddings in its config.json; --max-context cannot go beyond it): shorten the prompt")
    top = f" (the model allows up to {model_limit})" if model_limit is not None else ""
    raise InvalidArgumentError(f"prompt of {n_tokens} tokens does not fit the context of {max_context} tokens "
                               f"(raise --max-context{top} or shorten the prompt)")
