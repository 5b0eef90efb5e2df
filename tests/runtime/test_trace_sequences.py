"""Routing traces of several sequences (--trace-routing under --parallel): rows name their
sequence and engine step, the replay looks each step's rows up together as the engine did,
and the router probabilities recorded per row are the engine's own."""

from __future__ import annotations

import json
import random

import pytest

from sluice.cli import main
from sluice.replay import replay
from sluice.replay.policies import access_order
from sluice.trace import Trace, TraceFormatError, TraceWriter, read_trace, write_trace


def _union(trace: Trace) -> Trace:
    """One row per engine step holding the union of its rows' experts per layer."""
    steps = [[sorted({e for t in g for e in trace.steps[t][layer]}) for layer in range(trace.layers)]
             for g in trace.groups()]
    return Trace(steps, list(range(len(steps))), "union")


def _interleaved(rng: random.Random, steps: int, layers: int = 3, experts: int = 10, k: int = 2) -> Trace:
    """Two sequences decoding side by side, a third joining half-way, rows of a step interleaved."""
    rows, toks, seqs, stepno = [], [], [], []
    for s in range(steps):
        for seq in (0, 1) + ((2,) if s >= steps // 2 else ()):
            rows.append([sorted(rng.sample(range(experts), k)) for _ in range(layers)])
            toks.append(s if seq < 2 else s - steps // 2)
            seqs.append(seq)
            stepno.append(s)
    return Trace(rows, toks, "interleaved", seq=seqs, step=stepno)


def test_replay_of_steps_equals_replay_of_their_unions():
    """The replay looks a step's rows up in one moe call per layer: the same hits and lookups as a
    trace with one row per step holding their union, for every policy and Belady (whose next
    uses follow the same step order)."""
    rng = random.Random(3)
    trace = _interleaved(rng, 24)
    union = _union(trace)
    assert access_order(trace) == access_order(union)
    for spec in ("lru", "lfru", "belady"):
        for cap in (6, 9):
            a, b = replay(trace, spec, cap, "global"), replay(union, spec, cap, "global")
            assert (a.hits, a.lookups, a.evictions) == (b.hits, b.lookups, b.evictions), (spec, cap)
    assert replay(trace, "belady", 6, "global").hits >= replay(trace, "lfru", 6, "global").hits
    # per sequence: only its rows, one step each
    one = trace.of_sequence(2)
    assert one.tokens == 12 and one.seq == [2] * 12 and len(one.groups()) == 12
    assert replay(one, "lru", 4, "global").lookups == one.lookups


def test_sequence_fields_round_trip_and_errors(tmp_path):
    path = tmp_path / "t.jsonl"
    with TraceWriter(path) as w:
        w.write(4, [[1, 0], [2, 3]], probs=[[0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.4, 0.4]], seq=1, step=7)
        w.write(9, [[0, 2], [3, 1]], probs=[[0.5, 0.1, 0.4, 0.0], [0.1, 0.5, 0.0, 0.4]], seq=0, step=7)
        with pytest.raises(TraceFormatError, match="seq, step given for some records but not for others"):
            w.write(5, [[1, 0], [2, 3]], probs=[[0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.4, 0.4]])
    t = read_trace(path)
    assert t.seq == [1, 0] and t.step == [7, 7] and t.groups() == [[0, 1]] and t.sequences() == [0, 1]
    assert t.probs[1][1] == [0.1, 0.5, 0.0, 0.4] and t.of_sequence(0).tok == [9]
    again = tmp_path / "again.jsonl"
    write_trace(again, t)
    assert again.read_text() == path.read_text()
    bad = tmp_path / "bad.jsonl"
    first = '{"tok": 1, "seq": 0, "step": 0, "layers": [[1, 2], [3, 0]], "probs": [[0, 1, 0, 0], [0, 0, 1, 0]]}\n'
    for line, message in [
        ('{"tok": 2, "seq": -1, "step": 1, "layers": [[1, 2], [3, 0]], "probs": [[0, 1, 0, 0], [0, 0, 1, 0]]}',
         '"seq" must be a non-negative integer'),
        ('{"tok": 2, "seq": 0, "step": "x", "layers": [[1, 2], [3, 0]], "probs": [[0, 1, 0, 0], [0, 0, 1, 0]]}',
         '"step" must be a non-negative integer'),
        ('{"tok": 2, "seq": 0, "step": 1, "layers": [[1, 2], [3, 0]], "probs": [[0, 1, 0], [0, 0, 1, 0]]}',
         "probs of layer 1: 4 numbers, but the layers have 3 experts"),
        ('{"tok": 2, "seq": 0, "step": 1, "layers": [[1, 2], [3, 0]], "probs": [[0, 1], [0, 0]]}',
         "expert 2 is routed"),
        ('{"tok": 2, "seq": 0, "step": 1, "layers": [[1, 2], [3, 0]], "probs": [[0, 1, 0, "n"], [0, 0, 1, 0]]}',
         "not a finite number"),
        ('{"tok": 2, "step": 1, "layers": [[1, 2], [3, 0]], "probs": [[0, 1, 0, 0], [0, 0, 1, 0]]}',
         "seq on some lines but not on others"),
    ]:
        bad.write_text(first + line + "\n")
        with pytest.raises(TraceFormatError, match=rf"bad\.jsonl:2: .*{message}"):
            read_trace(bad)


def test_cli_replays_steps_together_or_one_sequence(tmp_path, capsys):
    path = tmp_path / "multi.jsonl"
    trace = _interleaved(random.Random(5), 10)
    write_trace(path, trace)
    assert main(["trace-replay", str(path), "--capacity", "6", "--scope", "global"]) == 0
    out = capsys.readouterr().out
    assert "3 sequences in 10 engine steps" in out
    assert main(["trace-replay", str(path), "--capacity", "6", "--scope", "global", "--sequence", "1", "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["trace"]["tokens"] == 10 and obj["trace"]["sequences"] == 1
    assert {r["lookups"] for r in obj["results"]} == {trace.of_sequence(1).lookups}
    assert main(["trace-replay", str(path), "--sequence", "7"]) == 2
    assert "--sequence 7" in capsys.readouterr().err


def test_engine_trace_under_concurrency(model_dir, tmp_path):
    """Two sequences generating in one batch: every row names its sequence (state slot) and engine
    step, the rows of a sequence are its positions in order, some steps hold both, and the
    replay, looking each step's rows up together, counts exactly the engine's decode lookups.
    The recorded router probabilities are the engine's: their top-k is the routed set."""
    import sluice

    path = model_dir("qwen3_moe")
    f = tmp_path / "trace.jsonl"
    prompts = [list(range(3, 15)), list(range(40, 49))]
    with sluice.load(path, memory="2GiB", progress=False, trace_routing=str(f), parallel=2) as eng:
        results = eng.generate(prompts, max_new_tokens=7, speculate=False, ignore_eos=True)
        lookups = eng.experts.counters.lookups
    assert [len(r.token_ids) for r in results] == [7, 7]
    t = read_trace(f)
    assert t.sequences() == [0, 1] and t.tokens == 12  # 6 decode forwards each
    for seq, prompt in zip((0, 1), prompts):
        assert t.of_sequence(seq).tok == list(range(len(prompt), len(prompt) + 6))
    groups = t.groups()
    assert any(len({t.seq[i] for i in g}) == 2 for g in groups)
    assert all(len({t.seq[i] for i in g}) == len(g) for g in groups)  # no speculation: one row per sequence
    assert replay(t, "lru", 8, "global").lookups == lookups == _union(t).lookups
    for row, probs in zip(t.steps, t.probs):
        for ids, p in zip(row, probs):
            assert abs(sum(p) - 1) < 1e-4
            top = sorted(range(len(p)), key=lambda e: -p[e])[: len(ids)]
            assert sorted(top) == ids


def test_router_guesses_gain_on_the_demo_models_own_routing(tmp_path):
    """End to end on the trained demo model: --trace-routing records the router's probabilities,
    the replay hands them to the policy through the provider, and the default ``lfru`` (router
    guesses) gets more hits than without them, and than LRU, at 1.5x and 2x the working set
    (docs/cache-policy.md: 300-token traces of four prompts; this is one at 150 tokens)."""
    import sluice
    from sluice.demo import SHIPPED_MODEL

    f = tmp_path / "demo.jsonl"
    with sluice.load(SHIPPED_MODEL, memory="4GiB", trace_routing=str(f), progress=False) as engine:
        engine.generate("def quicksort(items):\n    if len(items) <= 1:\n        return items\n",
                        max_new_tokens=150, temperature=0.7, seed=0, ignore_eos=True)
    t = read_trace(f)
    assert t.probs is not None and t.sequences() == [0] and t.tokens == 149
    for multiple in (1.5, 2):
        cap = round(multiple * t.top_k)
        hits = {s: replay(t, s, cap, "global").hits for s in ("lru", "lfru:router=0", "lfru")}
        assert hits["lfru"] > hits["lfru:router=0"] > hits["lru"], (multiple, hits)
