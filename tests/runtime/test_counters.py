"""One counter vocabulary: ``EngineCounters`` is collected from the sources its fields declare
(``ExpertCounters``, ``SpineStats``, ``ReadStats``), and ``GenerationStats`` and
``SchedulerStats`` are built from it by the ``dataclasses`` helpers; a counter added in one
place and forgotten in another fails here."""

from __future__ import annotations

import dataclasses

import pytest

import sluice
from conftest import prompt_ids
from sluice.experts.counters import ExpertCounters
from sluice.rows import RowStats
from sluice.scheduler import SchedulerStats
from sluice.spine import SpineStats
from sluice.stats import NOT_PER_GENERATION, STATS_KEYS, EngineCounters, EngineInfo, GenerationStats
from sluice.storage.source import ReadStats

SOURCES = {"experts": ExpertCounters, "spine": SpineStats, "io": ReadStats, "rows": RowStats}
# the expert provider's own counters the engine does not report (tests/experts checks them)
EXPERT_ONLY = {"prefetch_aborted", "predicted_far", "predicted_far_hits"}


def distinct(cls, scale: int = 1, **fixed):
    """An instance of the dataclass ``cls`` whose every counter field holds a value of its own."""
    values = {}
    for i, f in enumerate(dataclasses.fields(cls)):
        if f.name.startswith("_") or f.name in fixed:
            continue
        values[f.name] = (i + 1) * scale + (0.5 if f.type == "float" else 0)
    return cls(**values, **fixed)


def names(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_every_engine_counter_is_a_generation_stat_or_declared_not():
    counters = names(EngineCounters)
    assert set(NOT_PER_GENERATION) <= counters, "NOT_PER_GENERATION names a field EngineCounters does not have"
    assert not set(NOT_PER_GENERATION) & set(STATS_KEYS), "a counter both declared absent and a stats key"
    missing = counters - set(STATS_KEYS) - set(NOT_PER_GENERATION)
    assert not missing, f"EngineCounters fields neither in GenerationStats nor in NOT_PER_GENERATION: {missing}"
    assert names(EngineInfo) <= set(STATS_KEYS)


def test_every_collected_counter_names_a_real_source_field():
    collected = {}
    for f in dataclasses.fields(EngineCounters):
        if "from" in f.metadata:
            source, name = f.metadata["from"]
            assert name in names(SOURCES[source]), f"EngineCounters.{f.name} reads {source}.{name}: no such field"
            collected.setdefault(source, set()).add(name)
    assert not collected["experts"] & EXPERT_ONLY
    left = names(ExpertCounters) - collected["experts"] - EXPERT_ONLY
    assert not left, f"ExpertCounters fields the engine neither reports nor declares its own: {left}"


def test_collect_reads_each_source_field_and_needs_the_rest():
    experts, spine, io = distinct(ExpertCounters), distinct(SpineStats, 100), distinct(ReadStats, 1000)
    rows = distinct(RowStats, 10000)
    own = dict(evictions=7, bytes_read=8, forwards=9, tokens_forwarded=10)
    c = EngineCounters.collect({"experts": experts, "spine": spine, "io": io, "rows": rows}, **own)
    for f in dataclasses.fields(EngineCounters):
        if "from" in f.metadata:
            source, name = f.metadata["from"]
            obj = {"experts": experts, "spine": spine, "io": io, "rows": rows}[source]
            assert getattr(c, f.name) == getattr(obj, name), f.name
        else:
            assert getattr(c, f.name) == own[f.name], f.name
    # an absent source counts nothing; a field with no source must be given
    none = EngineCounters.collect({"experts": experts, "spine": None, "io": io, "rows": None}, **own)
    assert (none.spine_bytes_read, none.spine_read_wait_s, none.rows_read) == (0, 0.0, 0)
    with pytest.raises(TypeError, match="forwards"):
        EngineCounters.collect({"experts": experts, "spine": None, "io": io}, evictions=1, bytes_read=2,
                               tokens_forwarded=3)


def test_generation_stats_carry_every_counter_and_the_engine_info():
    delta = distinct(EngineCounters)
    info = EngineInfo(budget_bytes=1 << 30, cache_slots=12, total_experts=96, direct_io=True, load_s=1.25,
                      lossy={"spine": "int8"}, spine_resident_bytes=5, spine_streamed_layers=2)
    s = GenerationStats.from_run(prompt_tokens=20, generated=5, reused=4, t_prefill=0.5, total_s=2.0,
                                 forwards=[(1, 0.1), (2, 0.2), (2, 0.2)], drafted=3, accepted=2, delta=delta,
                                 info=info, peak_rss_bytes=99)
    for name in names(EngineCounters) - set(NOT_PER_GENERATION):
        assert s[name] == getattr(delta, name), name
    for f in dataclasses.fields(EngineInfo):
        assert s[f.name] == getattr(info, f.name), f.name
    assert s["lossy"] is not info.lossy  # a copy
    assert s["hit_rate"] == delta.expert_hits / delta.expert_lookups
    assert s["lookahead_recall"] == delta.lookahead_hits / delta.lookahead_predictions
    assert (s["decode_forwards"], s["tokens_per_forward"], s["prefill_tok_s"]) == (3, 5 / 3, 16 / 0.5)
    assert list(s) == list(STATS_KEYS)


def test_scheduler_stats_take_their_declared_counters():
    declared = [f for f in dataclasses.fields(SchedulerStats) if {"last", "sums"} & f.metadata.keys()]
    assert {f.name for f in declared} == {"union_last", "union_total", "seq_union_total"}
    for f in declared:
        assert (f.metadata.get("last") or f.metadata.get("sums")) in names(EngineCounters), f.name
    st = SchedulerStats()
    a, b = distinct(EngineCounters), distinct(EngineCounters, 10)
    st.charge(a)
    st.charge(b)
    assert st.union_last == b.expert_union
    assert st.union_total == a.expert_union + b.expert_union
    assert st.seq_union_total == a.expert_seq_union + b.expert_seq_union


def test_a_generation_reports_what_the_engine_counted(text_model):
    with sluice.load(text_model, memory="2GiB", cache_experts=6, progress=False) as eng:
        before = eng.totals()
        r = eng.generate(prompt_ids(10, seed=4).tolist(), max_new_tokens=5, ignore_eos=True, speculate=False)
        d = eng.totals() - before
    assert d.expert_lookups > 0 and d.bytes_read > 0
    for name in names(EngineCounters) - set(NOT_PER_GENERATION):
        assert r.stats[name] == pytest.approx(getattr(d, name)), name
