"""Lossless n-gram (prompt-lookup) drafting for speculative decoding.

The drafter proposes the tokens that followed the most recent earlier occurrence of the
longest suffix of the context (n from ``n_max`` down to ``n_min``). No draft model: a
proposal costs a dict lookup. The draft length adapts to recent acceptance.
"""

from __future__ import annotations

from .layers.attention import MAX_DRAFT


class NgramDrafter:
    """``max_draft`` is at most ``MAX_DRAFT``: sliding-window caches keep that many positions
    beyond their window, so that a rejected draft rolls back without recomputation."""

    def __init__(self, tokens: list[int], n_max: int = 6, n_min: int = 2, max_draft: int = MAX_DRAFT,
                 start_draft: int = 4):
        self.tokens: list[int] = []
        self.n_max, self.n_min, self.max_draft = n_max, n_min, max_draft
        self.k = start_draft
        # n -> {n-gram: end (exclusive) of its most recent occurrence before the current suffix}
        self._index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(n_min, n_max + 1)}
        for t in tokens:
            self.append(t)

    def append(self, token: int) -> None:
        """Add a token; index the n-grams that end just before it (the suffix stays unindexed)."""
        end = len(self.tokens)  # n-grams ending at position end-1 become visible now
        for n in self._index:
            if end >= n:
                self._index[n][tuple(self.tokens[end - n : end])] = end
        self.tokens.append(token)

    def propose(self) -> list[int]:
        """Up to ``k`` tokens that followed an earlier occurrence of the context's suffix."""
        if self.k <= 0:
            return []
        size = len(self.tokens)
        for n in range(self.n_max, self.n_min - 1, -1):
            if size < n:
                continue
            end = self._index[n].get(tuple(self.tokens[size - n :]))
            if end is not None and end < size:
                return self.tokens[end : min(end + self.k, size)]
        return []

    def feedback(self, drafted: int, accepted: int) -> None:
        """Grow the draft after full acceptance, shrink it to what was accepted (+1) otherwise."""
        if drafted == 0:
            return
        if accepted == drafted:
            self.k = min(self.max_draft, self.k + 2)
        else:
            self.k = max(1, accepted + 1)
