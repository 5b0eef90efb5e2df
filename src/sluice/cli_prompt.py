"""``sluice run``'s prompt: from ``--prompt-file`` or stdin, read and counted in pieces; given as
``--prompt``, checked against the model's limit before the weights load (``prompt_fit``'s rule).

Read whole and tokenized whole, a 50 MB prompt file cost ~15 GB inside the tokenizer before it
was refused as longer than the context, and ``--prompt-file /dev/zero`` never ended before a
``MemoryError``. So, as the server bounds a request (``server/limits.py``), the prompt is read
in pieces of ``PIECE_CHARS`` characters: past ``max_context`` times the longest token of the
vocabulary in characters it is refused unread beyond that point, and each piece is tokenized as
it comes (cut after whitespace), stopping as soon as the count is clearly past the context. A
prompt that passes is tokenized whole by the engine, which checks it exactly.
"""

from __future__ import annotations

from .errors import InvalidArgumentError
from .prompt_fit import check
from .server.limits import longest_token_chars

PIECE_CHARS = 16 << 10


class PromptTooLongError(InvalidArgumentError):
    """A prompt file (or stdin) holds more than the model's context can take."""


def read_prompt(f, what: str, tokenizer, max_context: int, model_limit: int | None = None,
                bound: int | None = None) -> str:
    """The text of ``f`` (a text stream), read in pieces; ``PromptTooLongError`` naming ``what``
    and the limit once it is clearly longer than ``max_context`` tokens (``model_limit``: the
    model's own, named when the prompt is past it, as ``prompt_fit.check`` does). ``bound``: read
    and count up to this many positions (default ``max_context``; the caller then checks the
    exact count against the context)."""
    bound = max_context if bound is None else bound
    longest = longest_token_chars(tokenizer) if tokenizer is not None else 64
    max_chars = bound * longest
    pieces: list[str] = []
    total = counted = 0
    carry = ""
    npieces = 0
    while True:
        chunk = f.read(PIECE_CHARS)
        if not chunk:
            break
        total += len(chunk)
        if total > max_chars:
            if model_limit is not None and bound >= model_limit:
                raise PromptTooLongError(
                    f"{what}: the prompt is longer than the context of {max_context} tokens, past even the model's "
                    f"own limit of {model_limit} positions (max_position_embeddings in its config.json; --max-context "
                    f"cannot go beyond it): more than {max_chars} characters ({longest} per token at most); stopped "
                    "reading there")
            raise PromptTooLongError(
                f"{what}: the prompt is longer than the context of {max_context} tokens can hold: more than "
                f"{max_chars} characters ({longest} per token at most); stopped reading there")
        pieces.append(chunk)
        if tokenizer is None:
            continue
        text = carry + chunk
        cut = max(text.rfind(" "), text.rfind("\n")) + 1
        if cut <= 0 and len(text) < 2 * PIECE_CHARS:
            carry = text  # no whitespace yet: count it with the next piece
            continue
        if cut <= 0:
            cut = len(text)
        counted += len(tokenizer.encode(text[:cut], add_special_tokens=False))
        carry = text[cut:]
        npieces += 1
        # each cut may split what one token would cover into two: allow for that before refusing
        if counted > bound + 2 * npieces:
            try:
                check(counted - 2 * npieces, max_context, model_limit)
            except InvalidArgumentError as e:
                raise PromptTooLongError(f"{what}: {e} (counted in the first {total} characters; stopped reading "
                                         "there)") from None
            raise PromptTooLongError(
                f"{what}: the prompt is longer than the context: {counted} tokens counted in the first {total} "
                f"characters, and the context holds {max_context}; stopped reading there")
    return "".join(pieces)


def precheck(model, prompt: str | None = None, *, source=None, what: str = "", revision=None,
             max_context: int | None = None) -> str | None:
    """Before ``load``: refuse a text prompt that cannot fit, reading only the model's config and
    tokenizer (a local model; a URL's is checked after loading, by the engine). ``source``: a
    prompt file or stdin instead of ``prompt``, read here in pieces (``read_prompt``). Returns the
    prompt (None for a URL's model: read after loading)."""
    from .engine import ModelInfo
    from .options import DEFAULT_MAX_CONTEXT
    from .storage.location import is_url

    if is_url(str(model)):
        return None
    info = ModelInfo(model, revision=revision)
    try:
        limit = info.desc.max_position_embeddings
        ctx = min(max_context, limit) if max_context else min(limit, DEFAULT_MAX_CONTEXT)
        if source is not None:  # read up to the model's own limit; the exact count below names the context
            prompt = read_source(source, what, info.tokenizer, ctx, limit, bound=limit)
        if info.tokenizer is None or (max_context and max_context > limit):
            return prompt  # the engine names that error itself
        check(len(info.tokenizer.encode(prompt)), ctx, limit)
        return prompt
    finally:
        info.close()


def read_source(source, what: str, tokenizer, max_context: int, model_limit: int | None = None,
                bound: int | None = None) -> str:
    """``read_prompt`` with a file's decoding and read errors named as the command line's."""
    try:
        return read_prompt(source, what, tokenizer, max_context, model_limit, bound)
    except UnicodeDecodeError as e:
        raise InvalidArgumentError(f"{what}: not UTF-8 text ({e.reason})") from None
    except OSError as e:
        raise InvalidArgumentError(f"{what}: {e.strerror or e}") from None
