"""``/metrics`` carries every engine counter it declares (``sluice.server.metrics``): each
``EngineCounters`` field is read by a metric or declared not exported, and the values a
metric shows are the ones its declared source holds, rendered and over live HTTP."""

from __future__ import annotations

import dataclasses

import httpx
import pytest

import sluice
from live_server import ENGINE_KW, MODEL, LiveServer, parse_metrics
from sluice.scheduler import SchedulerStats
from sluice.server.metrics import BATCH_METRICS, ENGINE_METRICS, GENERATION_SUMS, NOT_EXPORTED, Metrics
from sluice.stats import STATS_KEYS, EngineCounters, EngineInfo, GenerationStats

COUNTERS = {f.name for f in dataclasses.fields(EngineCounters)}


def exported() -> dict[str, set[str]]:
    """EngineCounters field -> the metrics that carry it."""
    out: dict[str, set[str]] = {}
    for name, key, _ in GENERATION_SUMS:
        out.setdefault(key, set()).add(name)
    for name, _, samples in ENGINE_METRICS:
        for _, key in samples:
            out.setdefault(key, set()).add(name)
    batch = {f.name: f.metadata.get("last") or f.metadata.get("sums") for f in dataclasses.fields(SchedulerStats)}
    for name, _, key, _ in BATCH_METRICS:
        if batch[key]:
            out.setdefault(batch[key], set()).add(name)
    return out


def test_every_engine_counter_is_a_metric_or_declared_not():
    carried = exported()
    assert set(NOT_EXPORTED) <= COUNTERS, "NOT_EXPORTED names a field EngineCounters does not have"
    assert not set(NOT_EXPORTED) & carried.keys(), "a counter both exported and declared not"
    missing = COUNTERS - carried.keys() - set(NOT_EXPORTED)
    assert not missing, f"EngineCounters fields no metric carries nor NOT_EXPORTED declares: {missing}"
    assert {key for _, key, _ in GENERATION_SUMS} <= set(STATS_KEYS)
    assert {key for _, _, samples in ENGINE_METRICS for _, key in samples} <= COUNTERS
    assert {key for _, _, key, _ in BATCH_METRICS} <= {f.name for f in dataclasses.fields(SchedulerStats)}


def test_the_rendered_metrics_hold_their_sources_values():
    delta = EngineCounters(**{name: 10 * (i + 1) for i, name in enumerate(sorted(COUNTERS))})
    totals = delta + delta + delta  # the engine since load: other values than the generation's
    info = EngineInfo(budget_bytes=1, cache_slots=2, total_experts=3, direct_io=False, load_s=0.5, lossy={},
                      spine_resident_bytes=4, spine_streamed_layers=0)
    stats = GenerationStats.from_run(prompt_tokens=9, generated=3, reused=2, t_prefill=0.25, total_s=1.0,
                                     forwards=[(1, 0.1), (1, 0.1)], drafted=0, accepted=0, delta=delta, info=info,
                                     peak_rss_bytes=0)
    batch = SchedulerStats(steps=5, stepped_sequences=8, last_batch_size=2)
    batch.charge(delta)
    batch.charge(totals)
    m = Metrics("m")
    m.finished("completed", 9, 3, stats)
    m.finished("completed", 9, 3, stats)  # summed over generations
    got = parse_metrics(m.render(0, 0, 1, batch=batch, totals=totals))
    for name, key, _ in GENERATION_SUMS:
        assert got[name] == 2 * stats[key], name
    for name, _, samples in ENGINE_METRICS:
        for labels, key in samples:
            lab = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
            assert got[name + lab] == getattr(totals, key), name + lab
    for name, _, key, _ in BATCH_METRICS:
        assert got[name] == getattr(batch, key), name
    assert got["sluice_expert_union_size"] == totals.expert_union
    assert got["sluice_expert_union_total"] == delta.expert_union + totals.expert_union
    # not known: every counter metric is there, at 0
    empty = parse_metrics(Metrics("m").render(0, 0, 1))
    assert all(empty[n] == 0 for n, _, _ in GENERATION_SUMS)
    assert empty['sluice_engine_expert_reads_total{kind="prefetch"}'] == 0


@pytest.fixture(scope="module")
def srv(chat_model):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    s = LiveServer(sluice.load(chat_model, **ENGINE_KW))
    yield s
    s.stop()


def test_live_metrics_show_the_engine_and_the_generation_counters(srv):
    eng = srv.engine
    before = srv.metrics()
    resp = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "def f(x):", "max_tokens": 6,
                                                         "temperature": 0, "ignore_eos": True}, timeout=60)
    assert resp.status_code == 200, resp.text
    stats, totals, after = eng.last_stats, eng.totals(), srv.metrics()
    assert stats["expert_lookups"] > 0 and stats["bytes_read"] > 0
    for name, key, _ in GENERATION_SUMS:
        assert after[name] - before[name] == stats[key], name
    for name, _, samples in ENGINE_METRICS:
        for labels, key in samples:
            lab = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
            assert after[name + lab] == getattr(totals, key), name + lab
    assert after["sluice_expert_union_total"] - before["sluice_expert_union_total"] > 0
