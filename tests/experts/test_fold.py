"""experts/fold.py, the grouping and the ascending-expert sum both expert providers use."""

import random

import pytest
import torch

from sluice.experts.fold import Fold, Groups, weigh


@pytest.mark.parametrize("t", [1, 7])
def test_groups_and_fold_in_any_order_give_the_same_bits(t):
    g = torch.Generator().manual_seed(t)
    e_count, k, h = 8, 3, 16
    ids = torch.stack([torch.randperm(e_count, generator=g)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=g)
    x = torch.randn(t, h, generator=g)
    groups = Groups(ids, weights)
    assert groups.experts == sorted(set(ids.reshape(-1).tolist()))
    outputs = {}
    for e in groups.experts:
        want_rows = [r for r in range(t) if e in ids[r].tolist()]
        assert groups.rows(e) == want_rows and groups.count(e) == len(want_rows)
        idx, w = groups.work(e)
        col = [ids[r].tolist().index(e) for r in want_rows]
        if t == 1:
            assert idx is None and w == weights[0, col[0]].item()
            y = x * w
        else:
            assert idx.tolist() == want_rows and torch.equal(w, weights[want_rows, col])
            y = weigh(x[idx] * (e + 1), w)
        outputs[e] = (idx, y)
    in_order = Fold(x, groups.experts)
    for e in groups.experts:
        in_order.add(e, *outputs[e])
    shuffled = Fold(x, groups.experts)
    late = list(groups.experts)
    random.Random(t).shuffle(late)
    for i, e in enumerate(late):
        assert not shuffled.done
        shuffled.add(e, *outputs[e])
        assert shuffled.next == next((j for j, f in enumerate(groups.experts) if f not in late[:i + 1]),
                                     len(groups.experts))  # summed up to the first expert not yet in
    assert torch.equal(shuffled.result(), in_order.result())
    want = torch.zeros(t, h, dtype=torch.float64)
    for idx, y in outputs.values():
        want[[0] if idx is None else idx] += y.double()
    assert torch.allclose(in_order.result().double(), want, atol=1e-5)


def test_fold_missing_an_expert_says_which():
    x = torch.zeros(1, 4)
    fold = Fold(x, [2, 5, 9])
    fold.add(5, None, torch.ones(1, 4))
    with pytest.raises(RuntimeError, match=r"experts \[2, 9\]"):
        fold.result()
