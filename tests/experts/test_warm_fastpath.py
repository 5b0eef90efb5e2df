"""The warm fast path (``ExpertProvider._run_ready``: every routed expert READY) and the skipped
lookahead (the cache holds every expert) give the read path's bits and counters."""

from __future__ import annotations

import dataclasses

import torch

import sluice
from conftest import prompt_ids
from sluice.experts.cache import READY

_TIMES = ("read_wait_s", "compute_s")


def _counts(engine) -> dict:
    return {k: v for k, v in dataclasses.asdict(engine.experts.counters).items() if k not in _TIMES}


def _run(engine, ids: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """A prefill forward (several rows per layer) and a greedy generation (one row per layer)."""
    logits = engine.forward(ids)
    return logits, engine.generate(ids.tolist(), max_new_tokens=6).token_ids


def test_fast_path_equals_read_path_bits_and_counters(model_dir):
    path = model_dir("qwen3_moe")
    ids = prompt_ids(n=10, seed=4)
    fast = sluice.load(path, memory="2GiB", progress=False)
    slow = sluice.load(path, memory="2GiB", progress=False)
    small = sluice.load(path, memory="2GiB", cache_experts=2, progress=False)  # one layer's top-k
    try:
        for e in (fast, slow):  # every expert read
            for layer in e.desc.moe_layers:
                e.experts.prefetch(layer, list(range(e.desc.n_experts)))
            e.experts.drain()
        for e in (fast, slow, small):
            _run(e, ids)
        assert fast.cache.ready_count == len(fast.cache) == fast.desc.total_experts
        assert small.cache.ready_count == len(small.cache) == 2
        # the general loop on the same warm cache: no fast path, and the lookahead on in both
        used, calls = [], []
        real, run = fast.experts._run_ready, fast.experts.run_experts
        fast.experts._run_ready = lambda *a: (used.append(a[0]), real(*a))
        fast.experts.run_experts = lambda *a, **k: (calls.append(a[0]), run(*a, **k))
        slow.cache.ready_slots = lambda keys: None
        for e in (fast, slow):
            e.lookahead._holds_all = lambda: False
        before = {e: _counts(e) for e in (fast, slow, small)}
        got = {e: _run(e, ids) for e in (fast, slow, small)}
        assert used and used == calls  # every MoE call took the fast path
        assert torch.equal(got[fast][0], got[slow][0]) and got[fast][1] == got[slow][1]
        assert torch.equal(got[fast][0], got[small][0]) and got[fast][1] == got[small][1]
        delta = {e: {k: v - before[e][k] for k, v in _counts(e).items()} for e in (fast, slow, small)}
        assert delta[fast] == delta[slow]
        assert delta[fast]["predicted"] > 0 and delta[fast]["hits"] == delta[fast]["lookups"] > 0
        assert delta[fast]["demand_reads"] == delta[fast]["prefetch_reads"] == 0
        # a cache of one layer's working set reads on every layer: the same lookups, other hits
        assert delta[small]["demand_reads"] > 0 and delta[small]["misses"] > 0
        for k in ("lookups", "prefill_lookups", "union", "seq_union", "compute_calls"):
            assert delta[small][k] == delta[fast][k], k
        # the lookahead skipped while the cache holds every expert: the same bits, no predictions
        del fast.lookahead._holds_all
        assert fast.lookahead._holds_all() and not small.lookahead._holds_all()
        c0 = _counts(fast)
        again = _run(fast, ids)
        assert torch.equal(again[0], got[fast][0]) and again[1] == got[fast][1]
        c1 = _counts(fast)
        assert c1["predicted"] == c0["predicted"] and c1["lookups"] - c0["lookups"] == delta[fast]["lookups"]
    finally:
        for e in (fast, slow, small):
            e.close()


def test_fast_path_keeps_policy_events_in_a_partial_cache(model_dir):
    """A cache of 6 of the 16 experts (demand reads only: deterministic): layers whose experts are
    all READY take the fast path, the others read; the policy hears the same events either way, so
    the same victims are evicted, the same reads happen, the same bits come out."""
    path = model_dir("qwen3_moe")
    ids = prompt_ids(n=10, seed=4)
    fast = sluice.load(path, memory="2GiB", cache_experts=6, prefetch=False, progress=False)
    slow = sluice.load(path, memory="2GiB", cache_experts=6, prefetch=False, progress=False)
    try:
        used = []
        real = fast.experts._run_ready
        fast.experts._run_ready = lambda *a: (used.append(a[0]), real(*a))
        slow.cache.ready_slots = lambda keys: None
        got = {e: _run(e, ids) for e in (fast, slow)}
        assert used and not fast.experts.holds_all()
        assert torch.equal(got[fast][0], got[slow][0]) and got[fast][1] == got[slow][1]
        assert _counts(fast) == _counts(slow) and fast.experts.evictions == slow.experts.evictions > 0
        assert sorted(fast.cache.keys()) == sorted(slow.cache.keys())
        # ready_count follows reads and evictions
        assert fast.cache.ready_count == sum(fast.cache.lookup(k).state == READY for k in fast.cache.keys()) == 6
    finally:
        fast.close()
        slow.close()


def test_swiglu_many_equals_one_call_per_expert():
    from sluice import kernels
    from sluice.experts.compute import expert_output, expert_outputs
    from sluice.experts.spec import ExpertSpec
    from sluice.quant import assemble_views

    if not kernels.available():
        return
    g = torch.Generator().manual_seed(0)
    spec = ExpertSpec(hidden=64, intermediate=32)
    x = torch.randn(1, 64, generator=g)
    ws = []
    for dtype, inter in ((torch.bfloat16, 32), (torch.float32, 48), (torch.float16, 16)):
        views = {"gate": torch.randn(inter, 64, generator=g).to(dtype),
                 "up": torch.randn(inter, 64, generator=g).to(dtype),
                 "down": torch.randn(64, inter, generator=g).to(dtype)}
        ws.append(assemble_views(views))
    ws.append(assemble_views({**ws[0].named, "down_bias": torch.randn(64, generator=g)}))
    assert ws[-1].swiglu_args is None  # a bias: no one-call kernel, the general products
    scales = [0.5, 1.25, -0.75, 2.0]
    many = expert_outputs(spec, ws, x, scales)
    one = [expert_output(spec, w, x, s) for w, s in zip(ws, scales)]
    assert all(torch.equal(a, b) for a, b in zip(many, one))
    many = expert_outputs(spec, ws[:3], x, scales[:3])  # all through kernels.swiglu_many
    assert all(torch.equal(a, b) for a, b in zip(many, one[:3]))
