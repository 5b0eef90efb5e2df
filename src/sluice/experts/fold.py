"""A MoE layer's rows grouped by routed expert, and the expert outputs summed in ascending expert order.

Both expert interfaces use these, and only these: ``ExpertProvider.moe`` (this process) and
``RayExperts.moe`` (the Ray driver; its workers compute the outputs). Their logits are
bit-identical because they group the rows and sum the outputs with the same operations in the
same order: each expert's output is ``w * expert(x[rows])`` (``Groups.work`` gives the rows and
weights, ``weigh`` applies several rows' weights), and the outputs are added into a zero tensor
in ascending expert order, ``acc += y`` for one row, ``acc.index_add_(0, rows, y)`` for more
(``Fold``), whatever order they were computed in and wherever.

Shape legend: T tokens, H hidden, K experts per token, n_e rows routed to expert e.
"""

from __future__ import annotations

import torch


class Groups:
    """The rows of one MoE layer (ids/weights [T, K]) grouped by routed expert. ``experts``: the
    distinct experts the rows routed to, ascending; ``one_row``: T == 1 (decode), grouped in
    Python (a handful of tensor ops fewer per layer), its weights as floats."""

    __slots__ = ("one_row", "experts", "_weights", "_wrow", "_first", "_groups")

    def __init__(self, ids: torch.Tensor, weights: torch.Tensor):
        self.one_row = ids.shape[0] == 1
        if self.one_row:
            self._wrow = weights[0].tolist()
            first: dict[int, int] = {}  # expert -> its (first) column
            for col, e in enumerate(ids[0].tolist()):
                first.setdefault(e, col)
            self._first = first
            self.experts = sorted(first)
        else:
            self._weights = weights
            flat = ids.reshape(-1)
            order = torch.argsort(flat, stable=True)
            sorted_ids = flat[order].tolist()
            rows = (order // ids.shape[1]).tolist()
            cols = (order % ids.shape[1]).tolist()
            groups: dict[int, tuple[list[int], list[int]]] = {}  # expert -> (rows, columns), rows ascending
            for e, r, c in zip(sorted_ids, rows, cols):
                g = groups.setdefault(e, ([], []))
                g[0].append(r)
                g[1].append(c)
            self._groups = groups
            self.experts = sorted(groups)

    def rows(self, e: int) -> list[int]:
        """The rows routed to expert ``e``, ascending."""
        return [0] if self.one_row else self._groups[e][0]

    def count(self, e: int) -> int:
        """n_e: how many rows expert ``e`` computes."""
        return 1 if self.one_row else len(self._groups[e][0])

    def work(self, e: int) -> tuple[torch.Tensor | None, object]:
        """What expert ``e`` computes: ``(None, w)`` for one row (``w`` a float: the output is
        ``compute.expert_output(..., x, w)``), else ``(rows, w)``: rows [n_e] int64 indexing x, w
        [n_e] their weights (the output is ``weigh(expert_forward(..., x[rows]), w)``)."""
        if self.one_row:
            return None, self._wrow[self._first[e]]
        rows, cols = self._groups[e]
        idx = torch.tensor(rows)
        return idx, self._weights[idx, torch.tensor(cols)]


def weigh(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """An expert's output for several rows, y [n_e, H], times the rows' weights w [n_e]."""
    return y * w.to(y.dtype)[:, None]


class Fold:
    """Sums the experts' outputs into a zero tensor like ``x`` in the order of ``experts``
    (ascending), whatever order they are added in: an output is held until those of all the
    experts before it are in. ``next``: how many experts are summed so far."""

    __slots__ = ("acc", "experts", "next", "_held")

    def __init__(self, x: torch.Tensor, experts: list[int]):
        self.acc = torch.zeros_like(x)
        self.experts = experts
        self.next = 0
        self._held: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}

    @property
    def done(self) -> bool:
        return self.next >= len(self.experts)

    def add(self, e: int, rows: torch.Tensor | None, y: torch.Tensor) -> None:
        """Expert ``e``'s output ``y``: [1, H] for one row (``rows`` None), else [n_e, H] for
        ``rows`` (as ``Groups.work`` gives them)."""
        self._held[e] = (rows, y)
        experts, acc = self.experts, self.acc
        while self.next < len(experts) and experts[self.next] in self._held:
            rows_, y_ = self._held.pop(experts[self.next])
            if rows_ is None:
                acc += y_
            else:
                acc.index_add_(0, rows_, y_)
            self.next += 1

    def result(self) -> torch.Tensor:
        """The sum [T, H], once every expert's output is in."""
        if not self.done:
            missing = [e for e in self.experts[self.next:] if e not in self._held]
            raise RuntimeError(f"expert outputs missing from the fold: experts {missing}")
        return self.acc
