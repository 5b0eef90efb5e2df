"""``sluice run``'s prompt from ``--prompt-file`` or stdin, read and counted in pieces.

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
from .server.limits import longest_token_chars

PIECE_CHARS = 16 << 10


class PromptTooLongError(InvalidArgumentError):
    """A prompt file (or stdin) holds more than the model's context can take."""


def read_prompt(f, what: str, tokenizer, max_context: int) -> str:
    """The text of ``f`` (a text stream), read in pieces; ``PromptTooLongError`` naming ``what``
    and the limit once it is clearly longer than ``max_context`` tokens."""
    longest = longest_token_chars(tokenizer) if tokenizer is not None else 64
    max_chars = max_context * longest
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
        if counted > max_context + 2 * npieces:
            raise PromptTooLongError(
                f"{what}: the prompt is longer than the context: {counted} tokens counted in the first {total} "
                f"characters, and the context holds {max_context}; stopped reading there")
    return "".join(pieces)
