"""Which worker computes which expert: a deterministic home map, replicas of hot experts.

Every (layer, expert) has a home worker: ``(expert + position of the layer among the MoE
layers) % workers``, so each layer's experts are spread over all workers and expert 0 is not
always on worker 0. With ``replicate_hot = R``, the R most-routed experts of each layer (routing
counts measured since load, re-chosen every ``REBALANCE_EVERY`` forwards; DeepSeek's EPLB idea)
may also run on the next worker; per layer each such expert goes to whichever of its workers has
the fewest rows so far (ties: home first), or, for a layer of decoding rows, to one the layer calls
anyway (fewer round trips; the rows are few). A replica reads the expert into its own cache the first
time it computes it. Every worker computes with the same kernels (the driver checks the
signature), so the choice never changes a bit of the output.
"""

from __future__ import annotations

import torch

REBALANCE_EVERY = 16  # forwards between re-choosing the hot experts


class Placement:
    def __init__(self, moe_layers: list[int], n_experts: int, workers: int, replicate_hot: int = 0):
        if workers < 1:
            raise ValueError("at least one expert worker")
        self.workers, self.n_experts = workers, n_experts
        self.replicate_hot = min(max(0, replicate_hot), n_experts) if workers > 1 else 0
        self._pos = {layer: i for i, layer in enumerate(moe_layers)}
        self.counts = torch.zeros(len(moe_layers), n_experts, dtype=torch.long)
        self._hot: dict[int, set[int]] = {layer: set(range(self.replicate_hot)) for layer in moe_layers}
        self._forwards = 0

    def home(self, layer: int, expert: int) -> int:
        return (expert + self._pos[layer]) % self.workers

    def candidates(self, layer: int, expert: int) -> list[int]:
        """Workers that may compute ``expert`` of ``layer``, home first."""
        h = self.home(layer, expert)
        if expert in self._hot.get(layer, ()):
            return [h, (h + 1) % self.workers]
        return [h]

    def assign(self, layer: int, rows: dict[int, int], exclude: set[int] = frozenset(),
               count: bool = True, pack: bool = False) -> dict[int, int]:
        """expert -> worker for one layer's call, ``rows``: expert -> its row count (ascending
        experts); never a worker in ``exclude`` if another candidate is left (None-free: a fully
        excluded expert keeps its home). Replicated experts go to whichever candidate has the fewest
        rows so far (ties: home first), or with ``pack`` (decoding: a few rows, where each worker
        called costs a round trip) to a candidate the layer calls anyway when there is one."""
        load = [0] * self.workers
        out: dict[int, int] = {}
        pos = self._pos[layer]
        cands = {e: [w for w in self.candidates(layer, e) if w not in exclude] or [self.home(layer, e)] for e in rows}
        called = self._cover(cands) if pack else set()
        for e, n in rows.items():
            if count:
                self.counts[pos, e] += n
            choice = [w for w in cands[e] if w in called] or cands[e]
            w = min(choice, key=lambda c: load[c])
            load[w] += n
            out[e] = w
        return out

    @staticmethod
    def _cover(cands: dict[int, list[int]]) -> set[int]:
        """Few workers that hold a candidate of every expert: the homes of the experts with one
        candidate, then greedily the worker that covers most of the rest (ties: the lowest)."""
        called = {c[0] for c in cands.values() if len(c) == 1}
        left = [c for c in cands.values() if not called.intersection(c)]
        while left:
            counts: dict[int, int] = {}
            for c in left:
                for w in c:
                    counts[w] = counts.get(w, 0) + 1
            best = min(counts, key=lambda w: (-counts[w], w))
            called.add(best)
            left = [c for c in left if best not in c]
        return called

    @staticmethod
    def calls(assign: dict[int, int]) -> int:
        """Workers an assignment calls."""
        return len(set(assign.values()))

    def tick(self) -> None:
        """A forward begins: every ``REBALANCE_EVERY`` forwards, re-choose the hot experts."""
        self._forwards += 1
        if self.replicate_hot and self._forwards % REBALANCE_EVERY == 0:
            top = self.counts.topk(self.replicate_hot, dim=1).indices
            for layer, pos in self._pos.items():
                self._hot[layer] = set(top[pos].tolist())

    def hot(self, layer: int) -> list[int]:
        return sorted(self._hot.get(layer, ()))
