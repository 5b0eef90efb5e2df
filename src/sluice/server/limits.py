"""Bounds on what one request may cost the server before it reaches the engine.

A request is read, parsed, rendered (chat) and tokenized before it waits for the engine,
and each step costs memory in proportion to the body: a 4 MB prompt costs ~1 GB inside
the tokenizer, 140,000 tiny chat messages ~100 MB as parsed objects. So:

- the body is refused (413) past ``--max-body`` before it is read;
- its JSON may hold at most ``max_values`` values (strings, numbers, arrays, objects);
  counted on the raw bytes before parsing;
- a prompt longer than the context can hold in characters (``max_context`` times the
  longest token of the vocabulary) is refused without tokenizing it; a long one is first
  counted piece by piece, stopping as soon as it is clearly over the context;
- every request reserves its estimated cost from a pool (``RequestMemory``) before its
  body is read, and waits (without blocking anything) until the pool has room.
"""

from __future__ import annotations

import asyncio
from collections import deque

# Measured (the tokenizer: tokenizers 0.23; tests/hostile/test_hostile_server.py prints the server's
# peak RSS): the body, its decoded text and the copies made while parsing cost ~4x the body;
# a parsed JSON value (a message object, a token id in a list) up to ~800 bytes; the
# tokenizer ~120 bytes per character of its input (alignments and copies per byte) plus
# ~270 per token it makes.
BODY_FACTOR = 4
VALUE_BYTES = 800
TOKENIZER_BYTES_PER_CHAR = 128
TOKENIZER_BYTES_PER_TOKEN = 300
COUNT_CHUNK_CHARS = 16 << 10  # a long prompt is first counted in pieces of this many characters
MIN_VALUES = 4096  # JSON values a request may hold beyond its prompt's token ids


def json_values(body: bytes, cap: int) -> int:
    """Upper bound on the number of JSON values in ``body``, counting stops past ``cap``.

    Strings count one each (escaped quotes and backslashes removed first, so every quote
    left opens or closes one); outside strings every ``,``, ``[`` and ``{`` may start a value.
    """
    b = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    n, pos, end_all = 1, 0, len(b)
    while True:
        q = b.find(b'"', pos)
        end = end_all if q < 0 else q
        n += b.count(b",", pos, end) + b.count(b"[", pos, end) + b.count(b"{", pos, end)
        if q < 0 or n > cap:
            return n
        close = b.find(b'"', q + 1)
        n += 1
        if close < 0:
            return n
        pos = close + 1


def longest_token_chars(tokenizer) -> int:
    """Characters of the longest vocabulary entry: no token covers more of a prompt (floor 16)."""
    raw = getattr(tokenizer, "_tok", None)
    try:
        vocab = raw.get_vocab(with_added_tokens=True)
    except Exception:  # noqa: BLE001  (no vocabulary to look at: a generous guess)
        return 64
    return max(16, max((len(t) for t in vocab), default=16))


def split_for_counting(text: str, size: int | None = None):
    """Pieces of about ``size`` characters (``COUNT_CHUNK_CHARS``), cut after whitespace where there is some."""
    size = size or COUNT_CHUNK_CHARS
    start, n = 0, len(text)
    while start < n:
        end = min(n, start + size)
        if end < n:
            cut = max(text.rfind(" ", start + size // 2, end), text.rfind("\n", start + size // 2, end))
            if cut > start:
                end = cut + 1
        yield text[start:end]
        start = end


def count_tokens_over(tok, text: str, limit: int) -> int:
    """Tokens of ``text`` counted piece by piece, stopping once past ``limit`` (an estimate:
    pieces are cut at whitespace, where tokenizers split words anyway)."""
    n = 0
    for piece in split_for_counting(text):
        n += len(tok.encode(piece, add_special_tokens=False))
        if n > limit:
            break
    return n


class RequestMemory:
    """A pool of bytes for requests being prepared; ``reserve`` waits (FIFO) for room."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.used = 0
        self.peak = 0
        self._waiters: deque[tuple[int, asyncio.Future]] = deque()

    def _wake(self) -> None:
        while self._waiters:
            n, fut = self._waiters[0]
            if fut.done():
                self._waiters.popleft()
                continue
            if self.used + n > self.capacity:
                return
            self._waiters.popleft()
            self.used += n
            self.peak = max(self.peak, self.used)
            fut.set_result(None)

    async def acquire(self, n: int) -> None:
        n = min(n, self.capacity)
        if not self._waiters and self.used + n <= self.capacity:
            self.used += n
            self.peak = max(self.peak, self.used)
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append((n, fut))
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release(n)  # granted, but the waiter went away
            raise

    def release(self, n: int) -> None:
        self.used -= min(n, self.capacity)
        self._wake()
