"""The planner's second memory pool: bytes a device offers for expert weights (docs/architecture.md,
"Backends"). A fake pool of a given size stands for the device: the plan places up to that many
bytes of expert slots there, reports them, and leaves the host plan as it was; on CPU (0 bytes)
nothing changes."""

from __future__ import annotations

import pytest

from sluice.errors import InvalidArgumentError
from sluice.plan import make_plan

SLOT = 1 << 20
TOTAL = 256


def _plan(budget, **kw):
    args = dict(budget=budget, baseline=200 << 20, spine_global=20 << 20, spine_layers={i: 10 << 20 for i in range(8)},
                stream_buffer=10 << 20, state_bytes=10 << 20, activations=20 << 20, slot_bytes=SLOT, working_set=16,
                total_experts=TOTAL, top_k=2, max_context=1024, prefill_chunk=512)
    args.update(kw)
    return make_plan(**args)


def _host(plan) -> dict:
    d = plan.to_dict()
    for key in ("device_bytes", "device_slots", "device_cache_bytes"):
        d.pop(key)
    return d


@pytest.mark.parametrize("budget", [1 << 30, 400 << 20, 1 << 40])  # room to spare, spine streamed, everything
@pytest.mark.parametrize("parallel", [1, None])
def test_device_pool_holds_up_to_its_bytes_and_changes_nothing_on_the_host(budget, parallel):
    cpu = _plan(budget, parallel=parallel)
    assert (cpu.device_bytes, cpu.device_slots, cpu.device_cache_bytes) == (0, 0, 0)  # on CPU: no pool
    for pool in (1, SLOT - 1, SLOT, 40 * SLOT + SLOT // 2, TOTAL * SLOT, 4 * TOTAL * SLOT):
        p = _plan(budget, parallel=parallel, device_bytes=pool)
        assert _host(p) == _host(cpu), pool  # the host plan is the CPU plan
        assert p.device_bytes == pool
        assert p.device_slots == min(TOTAL, pool // SLOT)
        assert p.device_cache_bytes == p.device_slots * SLOT <= pool
        assert p.to_dict()["device_cache_bytes"] == p.device_cache_bytes


def test_device_pool_with_a_fixed_host_cache():
    p = _plan(1 << 30, cache_experts=32, device_bytes=100 * SLOT)
    assert (p.cache_slots, p.device_slots) == (32, 100)


def test_negative_device_pool_is_refused():
    with pytest.raises(InvalidArgumentError, match="device memory for experts"):
        _plan(1 << 30, device_bytes=-1)
