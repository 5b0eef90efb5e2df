"""Token selection: greedy, temperature, top-k, top-p; log-probabilities."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """``temperature == 0`` means greedy (argmax, first index on ties)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """Draws tokens from logits with its own seeded generator (no global RNG state)."""

    def __init__(self, params: SamplingParams):
        self.params = params
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self.generator = torch.Generator().manual_seed(seed)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution tokens are drawn from (after temperature, top-k, top-p). logits: [V]."""
        p = self.params
        scores = logits.float() / p.temperature
        if p.top_k and p.top_k < scores.shape[-1]:
            kth = torch.topk(scores, p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, descending=False)
            cum = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
            remove = cum <= (1 - p.top_p)
            remove[-1] = False  # always keep the most likely token
            scores = scores.masked_fill(remove.scatter(0, order, remove), float("-inf"))
        return torch.softmax(scores, dim=-1)

    def __call__(self, logits: torch.Tensor) -> int:
        if self.params.greedy:
            return int(torch.argmax(logits))
        return int(torch.multinomial(self.probs(logits), 1, generator=self.generator))


def logprobs(logits: torch.Tensor, token: int, top_n: int = 0) -> tuple[float, list[tuple[int, float]]]:
    """The model's log-probability of ``token`` and its ``top_n`` most likely tokens."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    top: list[tuple[int, float]] = []
    if top_n:
        vals, ids = torch.topk(lp, min(top_n, lp.shape[-1]))
        top = [(int(i), float(v)) for i, v in zip(ids, vals)]
    return float(lp[token]), top
