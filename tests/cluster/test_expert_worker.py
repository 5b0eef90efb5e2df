"""The Ray expert worker's class in this process, without Ray (``cluster/worker.py``).

A worker holds an ``ExpertProvider`` and runs its grouping-free entry (``run_experts``) on the
rows and weights the driver grouped; its outputs, folded as the driver folds them, are
``ExpertProvider.moe``'s bits, with a cache of a few slots that must read and evict while it
computes. A read that fails names its expert, layer and the request's rows, which the driver
renames the layer's rows (``layer_rows``); the worker computes the next request as if nothing had
happened. Its cache is sized by the planner a local run uses (``plan.make_plan``): one expert is
its floor, the margin is the planner's.
(The Ray tests, tests/cluster/test_ray_experts.py, run the same class as actors on a local cluster.)
"""

from __future__ import annotations

import pytest
import torch

from sluice.layers.context import ForwardContext
from sluice.cluster.model import open_experts
from sluice.cluster.provider import layer_rows
from sluice.cluster.worker import ExpertWorker, cache_slots
from sluice.errors import BudgetError, ExpertReadError
from sluice.experts.cache import ExpertCache
from sluice.experts.fold import Fold, Groups
from sluice.experts.policy_spec import make_policy
from sluice.experts.provider import ExpertProvider
from sluice.plan import budget_for, margin_for
from sluice.storage.faults import FaultPlan, inject_faults

MiB = 1 << 20


def routing(n_experts: int, rows: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(n_experts, generator=g)[:k] for _ in range(rows)])
    weights = torch.softmax(torch.randn(rows, k, generator=g), dim=-1)
    return ids, weights


def requests(groups: Groups, halves: int = 2):
    """The layer's experts split into ``halves`` requests as the driver builds them: per request the
    rows it sends (``used``, None for one row), and ``(expert, local rows, weight)`` per expert."""
    out = []
    for part in range(halves):
        es = groups.experts[part::halves]
        if groups.one_row:
            out.append((None, [(e, None, groups.work(e)[1]) for e in es]))
            continue
        used = sorted({r for e in es for r in groups.rows(e)})
        local = {r: i for i, r in enumerate(used)}
        out.append((used, [(e, torch.tensor([local[r] for r in groups.rows(e)]), groups.work(e)[1]) for e in es]))
    return out


def run_layer(worker: ExpertWorker, layer: int, x: torch.Tensor, ids, weights, decode: bool = True):
    """What RayExperts.moe does with one worker taking every request: the folded sum, the deltas."""
    groups = Groups(ids, weights)
    fold = Fold(x, groups.experts)
    deltas = []
    for used, items in requests(groups):
        xs = x if used is None else x[torch.tensor(used)]
        outs, d = worker.compute(layer, groups.one_row, xs, items, None, decode, torch.get_num_threads(),
                                 [e for e, _, _ in items] if decode else [])
        deltas.append(d)
        for (e, _, _), y in zip(items, outs):
            fold.add(e, groups.work(e)[0], y)
    return fold.result(), deltas


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_worker_outputs_folded_are_one_process_bits(family, family_models):
    path = str(family_models.hf(family))
    m = open_experts(path)
    local = ExpertProvider(m.source, ExpertCache(64, m.source.slot_bytes, make_policy("lfru")), m.spec, m.n_experts)
    worker = ExpertWorker(0, path, {"cache_experts": 3, "reader_threads": 2, "threads": 1})
    try:
        assert worker.cache.capacity == 3
        k = 4
        g = torch.Generator().manual_seed(1)
        for layer in m.moe_layers:
            for rows in (7, 1):  # a prefill chunk (expert_forward, then the weights), one decode row
                x = torch.randn(rows, m.spec.hidden, generator=g)
                ids, weights = routing(m.n_experts, rows, k, seed=layer * 10 + rows)
                want = local.moe(layer, x, ids, weights, ForwardContext.single(torch.zeros(rows, dtype=torch.long)))
                got, deltas = run_layer(worker, layer, x, ids, weights, decode=rows == 1)
                assert torch.equal(got, want), (family, layer, rows)
                n = len(Groups(ids, weights).experts)
                lookups, hits, prefill, demand = (sum(d[i] for d in deltas) for i in range(4))
                assert (lookups, prefill) == ((n, 0) if rows == 1 else (0, n))
                assert demand + hits >= (n if rows == 1 else 0) and demand > 0  # 3 slots: it had to read
                times = [d[5] + d[6] for d in deltas]  # read waits and compute time: the driver's while decoding
                assert all(t > 0 for t in times) if rows == 1 else all(t == 0.0 for t in times)
        st = worker.stats_now()
        assert st["calls"] == 4 * len(m.moe_layers) and st["evictions"] > 0 and st["bytes_read"] > 0
        assert st["slots"] == 3 and st["demand_reads"] > 0 and st["compute_s"] > 0
    finally:
        worker.close()
        local.close()


def test_a_failed_read_names_the_layers_rows_and_the_worker_goes_on(family_models):
    path = str(family_models.hf("mixtral"))
    worker = ExpertWorker(0, path, {"cache_experts": 4, "reader_threads": 1, "threads": 1})
    m = worker.opened
    local = ExpertProvider(m.source, ExpertCache(64, m.source.slot_bytes, make_policy("lfru")), m.spec, m.n_experts)
    try:
        layer = m.moe_layers[0]
        x = torch.randn(9, m.spec.hidden, generator=torch.Generator().manual_seed(3))
        ids, weights = routing(m.n_experts, 9, 2, seed=5)
        groups = Groups(ids, weights)
        e = min(groups.experts, key=groups.count)  # a request of one expert, some of the layer's rows
        used = groups.rows(e)
        assert used != list(range(len(used)))
        items = [(e, torch.arange(len(used)), groups.work(e)[1])]
        inject_faults(m.checkpoint, FaultPlan(fail_at=1))  # the first expert read fails
        with pytest.raises(ExpertReadError) as info:
            worker.compute(layer, False, x[torch.tensor(used)], items, None, False, torch.get_num_threads(), [])
        err = layer_rows(info.value, used)
        assert (err.layer, err.expert, err.rows) == (layer, e, used)
        assert not worker.cache.loading()  # every read in flight settled or dropped
        got, _ = run_layer(worker, layer, x, ids, weights, decode=False)  # the fault was one read
        ctx = ForwardContext.single(torch.zeros(9, dtype=torch.long))
        assert torch.equal(got, local.moe(layer, x, ids, weights, ctx))
    finally:
        worker.close()
        local.close()


def test_cache_sized_by_the_planner():
    """A worker is planned as a process with no spine and no sequence state: the planner's margin,
    one expert as its floor; a fixed --cache-experts must fit the budget as in a local run."""
    base, slot, transient, total = 300 * MiB, 3 * MiB, 5 * MiB, 1000
    budget = 1024 * MiB
    slots = cache_slots(0, budget, base, slot, total, transient, None)
    assert slots == (budget - margin_for(budget) - base - transient) // slot
    assert cache_slots(0, 10 * 1024 * MiB, base, slot, total, transient, None) == total  # never more than exist
    assert cache_slots(0, budget, base, slot, total, transient, 7) == 7
    floor = budget_for(base + transient, slot)
    assert cache_slots(0, floor, base, slot, total, transient, None) == 1
    with pytest.raises(BudgetError, match=r"expert worker 2: --worker-memory .* holds no expert \(3\.00 MiB each\) "
                                          r"beside this process's 300\.00 MiB: that needs .*raise --worker-memory$"):
        cache_slots(2, floor - 1, base, slot, total, transient, None)
    with pytest.raises(BudgetError, match=r"cannot hold a cache of 500 experts \(--cache-experts\)"
                                          r".*lower --cache-experts"):
        cache_slots(0, budget, base, slot, total, transient, 500)
