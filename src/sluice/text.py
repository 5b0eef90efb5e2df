"""Streaming text: UTF-8-safe incremental detokenization and stop strings."""

from __future__ import annotations

from .tokenizer import Tokenizer

_CONTEXT = 6  # prompt tokens decoded as left context, so leading spaces come out right


class Detokenizer:
    """Turns generated token ids into text deltas, never splitting a multi-byte character."""

    def __init__(self, tok: Tokenizer, prompt_ids: list[int]):
        self.tok = tok
        self.ids = list(prompt_ids[-_CONTEXT:])
        self.prefix = 0
        self.read = len(self.ids)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix_text = self.tok.decode(self.ids[self.prefix : self.read])
        new_text = self.tok.decode(self.ids[self.prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self.prefix, self.read = self.read, len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        prefix_text = self.tok.decode(self.ids[self.prefix : self.read])
        new_text = self.tok.decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""


class StopStrings:
    """Holds back text that might begin a stop string; reports when one completes."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        """Returns (text safe to emit, stopped)."""
        if not self.stops:
            return delta, False
        self.pending += delta
        hit = min((i for i in (self.pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if hit >= 0:
            out, self.pending = self.pending[:hit], ""
            return out, True
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def limit_note(finish_reason: str | None, generated_tokens: int | None, max_new_tokens: int | None) -> str:
    """Why a generation that ran out of room stopped, for a stats line; '' when it was not cut.

    'length' is either the ``max_new_tokens`` limit or the end of the context (whichever came first).
    """
    if finish_reason != "length":
        return ""
    if max_new_tokens is not None and generated_tokens == max_new_tokens:
        return f"stopped at --max-new-tokens {max_new_tokens}"
    return "stopped at the end of the context (--max-context)"
