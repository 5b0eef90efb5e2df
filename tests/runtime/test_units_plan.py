"""Sizes, the planner's arithmetic, and the kernels against a float64 reference."""

from __future__ import annotations

import pytest
import torch

from sluice import kernels
from sluice.errors import BudgetError
from sluice.plan import make_plan
from sluice.quant import linear
from sluice.units import format_size, parse_size


def test_parse_size():
    assert parse_size("8GiB") == 8 << 30
    assert parse_size("8GB") == 8 * 10**9
    assert parse_size("1.5 GiB") == 3 << 29
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("100B") == 100
    assert parse_size(1234) == 1234
    for bad in ("eight", "8XB", "-1GB", ""):
        with pytest.raises(ValueError, match="cannot parse size"):
            parse_size(bad)
    with pytest.raises(ValueError, match="has no unit"):
        parse_size("100")  # a string needs a unit: 100 what?
    assert format_size(3 << 29) == "1.50 GiB"


def _plan(budget, **kw):
    args = dict(budget=budget, baseline=200 << 20, spine_global=20 << 20, spine_layers={i: 10 << 20 for i in range(8)},
                stream_buffer=10 << 20, state_bytes=10 << 20,
                activations=20 << 20, slot_bytes=1 << 20, working_set=16, total_experts=256, top_k=2,
                max_context=1024, prefill_chunk=512)
    args.update(kw)
    return make_plan(**args)


def test_plan_floor_and_slots():
    full = _plan(1 << 40)
    floor = full.floor
    assert floor < full.floor_resident  # streaming the spine lowers the floor
    ws = full.working_set_budget  # the smallest budget keeping one token's working set
    assert floor < ws
    p = _plan(ws)
    assert p.cache_slots >= 16 and not p.below_working_set  # one token's working set
    assert p.streamed_layers  # ... streaming the spine layers that do not fit
    resident = _plan(full.floor_resident)
    assert not resident.streamed_layers and resident.cache_slots >= 2  # the floor's slots, spine resident
    with pytest.raises(BudgetError, match=r"below the floor .*: baseline 200\.00 MiB \+ spine 20\.00 MiB resident"):
        _plan(floor - (1 << 20))
    big = _plan(10 << 30)
    assert big.cache_slots == 256  # never more slots than experts
    p = _plan(1 << 30)
    assert p.fixed_bytes + p.margin_bytes + p.cache_bytes <= p.budget
    assert p.slots_for(p.budget) == p.cache_slots
    assert p.budget_for_slots(p.cache_slots) <= p.budget


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("t,n,k", [(1, 1, 1), (1, 37, 45), (3, 64, 128), (8, 300, 1000), (1, 2048, 512)])
def test_dense_kernel_matches_reference(dtype, t, n, k):
    g = torch.Generator().manual_seed(n * k + t)
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(t, k, generator=g)
    b = torch.randn(n, generator=g)
    ref = (x.double() @ w.double().T + b.double()).float()
    out = linear(x, w, b)
    assert out.dtype == torch.float32 and out.shape == (t, n)
    assert torch.allclose(out, ref, atol=1e-4 * k**0.5, rtol=1e-5)
    if kernels.available():
        direct = kernels.dense(x, w, b)
        assert torch.allclose(direct, ref, atol=1e-4 * k**0.5, rtol=1e-5)


def test_dense_kernel_deterministic_across_threads():
    if not kernels.available():
        pytest.skip("C kernels not built on this machine (torch fallback in use)")
    w = torch.randn(1000, 777).to(torch.bfloat16)
    x = torch.randn(2, 777)
    before = kernels.info()["threads"]
    try:
        kernels.set_threads(1)
        a = kernels.dense(x, w)
        kernels.set_threads(2)
        b = kernels.dense(x, w)
    finally:
        kernels.set_threads(before)
    assert torch.equal(a, b)


def test_large_batch_uses_bounded_upcast():
    w = torch.randn(5000, 1024).to(torch.bfloat16)
    x = torch.randn(40, 1024)
    assert torch.allclose(linear(x, w), x @ w.float().T, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_swiglu_expert_matches_reference(dtype):
    if not kernels.available():
        pytest.skip("C kernels not built on this machine (torch fallback in use)")
    g = torch.Generator().manual_seed(3)
    h, i = 96, 40
    gate, up = torch.randn(i, h, generator=g).to(dtype), torch.randn(i, h, generator=g).to(dtype)
    down = torch.randn(h, i, generator=g).to(dtype)
    x = torch.randn(1, h, generator=g)
    act = torch.nn.functional.silu(x.double() @ gate.double().T) * (x.double() @ up.double().T)
    ref = 0.3 * act @ down.double().T
    out = kernels.swiglu(x, gate, up, down, 0.3)
    assert torch.allclose(out.double(), ref, atol=1e-3, rtol=1e-4)
