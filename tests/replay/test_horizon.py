"""``HorizonBelady`` (replay/policies.py): the bound docs/cache-policy.md uses to measure how much
knowledge of the future Belady's lead over the online policies is made of."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from sluice.experts.policy_spec import make_policy
from sluice.replay import HorizonBelady, access_order, access_steps, replay
from sluice.trace import Trace, read_trace

OLMOE_TRACE = Path(__file__).resolve().parents[1] / "data" / "olmoe-1b-7b_299tok.jsonl"


@pytest.fixture(scope="module")
def olmoe() -> Trace:
    return read_trace(OLMOE_TRACE)


def random_trace(seed: int, tokens: int = 40, layers: int = 3, experts: int = 12, k: int = 3,
                 grouped: bool = False) -> Trace:
    rng = random.Random(seed)
    steps = [[sorted(rng.sample(range(experts), k)) for _ in range(layers)] for _ in range(tokens)]
    if not grouped:
        return Trace(steps, list(range(tokens)), "random")
    step = [t // 2 for t in range(tokens)]  # two sequences' rows per engine step
    return Trace(steps, list(range(tokens)), "random", seq=[t % 2 for t in range(tokens)], step=step)


def bound(trace, horizon, spec="lfru", recall=1.0, cap=None):
    cap = cap or round(1.5 * trace.step_width)
    return replay(trace, lambda: HorizonBelady(trace, horizon, make_policy(spec), recall=recall), cap, "global").hits


@pytest.mark.parametrize("grouped", [False, True])
def test_steps_follow_the_access_order(grouped):
    trace = random_trace(0, grouped=grouped)
    steps = access_steps(trace)
    assert len(steps) == len(access_order(trace))
    assert steps == sorted(steps) and steps[-1] == len(trace.groups()) - 1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_horizon_past_the_end_is_belady_and_no_recall_is_the_online_policy(seed):
    trace = random_trace(seed)
    for cap in (3, 5, 8):
        belady = replay(trace, "belady", cap, "global").hits
        assert bound(trace, trace.tokens, cap=cap) == belady
        for spec in ("lru", "lfru"):
            online = replay(trace, spec, cap, "global").hits
            assert bound(trace, 1, spec, recall=0.0, cap=cap) == online
            assert online <= bound(trace, 2, spec, cap=cap) <= belady


def test_olmoe_bounds(olmoe):
    """The figures docs/cache-policy.md quotes, global cache at 1.5x (192 slots): the rest of the
    token known exactly (horizon 0; the same figure as the doc's perfect lookahead), then the
    next token, then the whole trace (Belady)."""
    lfru = replay(olmoe, "lfru:cross=0", 12, "global").hits
    h0, h1 = bound(olmoe, 0, "lfru:cross=0"), bound(olmoe, 1, "lfru:cross=0")
    belady = replay(olmoe, "belady", 12, "global").hits
    assert (lfru, h0, h1, belady) == (20801, 21115, 22951, 26736)
    half = bound(olmoe, 1, "lfru:cross=0", recall=0.5)
    assert h0 < half < h1


def test_bad_parameters(olmoe):
    with pytest.raises(ValueError, match="horizon must be >= 0"):
        HorizonBelady(olmoe, -1, make_policy("lfru"))
    with pytest.raises(ValueError, match="recall must be within"):
        HorizonBelady(olmoe, 1, make_policy("lfru"), recall=1.5)
