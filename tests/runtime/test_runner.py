"""The model runner's contract (runner.py), the typed stats (stats.py), and that the generator
reaches the model only through the runner (a static check of generation.py)."""

from __future__ import annotations

import ast
import copy
import dataclasses
import json
import pickle
import re
from pathlib import Path

import pytest
import torch

import sluice
from conftest import prompt_ids, save_tiny
from sluice import generation
from sluice.layers.sampling import SamplingParams
from sluice.runner import ModelRunner, SeqState, SeqWork
from sluice.stats import STATS_KEYS, EngineCounters, GenerationStats

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "sluice"
N_NEW = 8
# the hybrid family of test_qwen3_next.py (linear, full, linear attention; layer 2 dense), whose
# prompt_ids() continuation is proven decisive there: chunk boundaries cannot flip a token
HYBRID = dict(layer_types=["linear_attention", "full_attention", "linear_attention"], linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
              shared_expert_intermediate_size=48, mlp_only_layers=[2])


@pytest.fixture(scope="module")
def engines(text_model, tmp_path_factory):
    hybrid = save_tiny(tmp_path_factory.mktemp("runner") / "qwen3_next", "qwen3_next", seed=2, **HYBRID)
    out = {"qwen3_moe": sluice.load(text_model, memory="2GiB", cache_experts=6, progress=False),
           "qwen3_next": sluice.load(hybrid, memory="2GiB", cache_experts=6, progress=False)}
    yield out
    for eng in out.values():
        eng.close()


def _greedy(runner: ModelRunner, seq: SeqState, ids: list[int], chunks: list[int], n_new: int):
    """Prefill ``ids`` as the given chunks (one step each), then decode greedily token by token;
    returns (the prefill's last logits, the generated tokens)."""
    assert sum(chunks) == len(ids)
    seq.rewind(0)
    pos = 0
    for i, n in enumerate(chunks):
        last = runner.run(seq, ids[pos : pos + n], pos, last_n=1 if i == len(chunks) - 1 else 0)
        pos += n
    first, tokens = last[-1], []
    for _ in range(n_new):
        tokens.append(int(last[-1].argmax()))
        last = runner.run(seq, tokens[-1:], pos, decoding=True)
        pos += 1
    return first, tokens


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
def test_chunks_through_the_runner_give_the_generators_tokens(engines, family):
    eng = engines[family]
    ids = prompt_ids().tolist()
    want = eng.generate(ids, max_new_tokens=N_NEW, ignore_eos=True, speculate=False).token_ids
    assert want == eng.generate(ids, max_new_tokens=N_NEW, ignore_eos=True).token_ids  # speculation: the same
    at_once, tokens = _greedy(eng.runner, eng.slot, ids, [len(ids)], N_NEW)
    assert tokens == want
    # forward() computes the head for every position (a [T, V] product, not [1, V]): fp32 rounding
    assert (at_once - eng.forward(ids)[-1]).abs().max().item() < 1e-4
    for chunks in ([5, 5, 5, 1], [1] * len(ids)):
        logits, tokens = _greedy(eng.runner, eng.slot, ids, chunks, N_NEW)
        assert tokens == want, f"chunks {chunks}"
        assert (logits - at_once).abs().max().item() < 1e-4  # other chunk boundaries: fp32 rounding


def test_the_generator_runs_on_a_runner_and_a_state_slot(engines):
    eng = engines["qwen3_next"]
    ids = prompt_ids().tolist()
    req = generation.Request(ids, SamplingParams(), N_NEW, [], set(), True, None, False, None, True)
    steps = list(generation.run(eng.runner, eng.slot, req))
    assert [s.token_id for s in steps] == eng.generate(ids, max_new_tokens=N_NEW, ignore_eos=True).token_ids
    assert isinstance(steps[-1].stats, GenerationStats) and steps[-1].finish_reason == "length"


def test_two_state_slots_in_one_step_equal_their_solo_runs(engines):
    """Each item of a step runs on its own state: two sequences stepped together (prefill
    chunks and decode tokens interleaved) get their solo logits bit for bit. Recurrent
    layers included: nothing of one sequence's state leaks into the other's."""
    eng = engines["qwen3_next"]
    runner = ModelRunner(eng.model, eng.experts, eng.checkpoint, eng.spine, max_context=64,
                         prefill_chunk=eng.plan.prefill_chunk, threads=eng.threads, tokenizer=eng.tokenizer,
                         eos_token_ids=eng.eos_token_ids, moe_layers=eng.desc.moe_layers, info=eng._info, slots=2,
                         lookahead=eng.lookahead)
    a, b = runner.slots
    pa, pb = prompt_ids(13, seed=5).tolist(), prompt_ids(6, seed=6).tolist()

    def solo(seq, prompt, cut):  # the prompt as two steps, cut at ``cut`` (the same chunks as below)
        rows = [runner.run(seq, prompt[:cut], 0, last_n=cut)] if cut else []
        rows.append(runner.run(seq, prompt[cut:], cut, last_n=len(prompt) - cut))
        tok = int(rows[-1][-1].argmax())
        for i in range(5):
            rows.append(runner.run(seq, [tok], len(prompt) + i, decoding=True))
            tok = int(rows[-1][-1].argmax())
        return torch.cat(rows)

    want_a, want_b = solo(a, pa, 7), solo(b, pb, 0)
    a.rewind(0)
    b.rewind(0)
    # step 1: a's first prefill chunk; step 2: a's second chunk with all of b's prompt
    r = runner.step([SeqWork(a, pa[:7], 0, last_n=7)])
    got_a = [r[0].logits]
    r = runner.step([SeqWork(a, pa[7:], 7, last_n=6), SeqWork(b, pb, 0, last_n=len(pb))])
    got_a.append(r[0].logits)
    got_b = [r[1].logits]
    ta, tb = int(got_a[-1][-1].argmax()), int(got_b[-1][-1].argmax())
    for i in range(5):  # decode both in each step, b first
        r = runner.step([SeqWork(b, [tb], len(pb) + i, decoding=True), SeqWork(a, [ta], len(pa) + i, decoding=True)])
        got_b.append(r[0].logits)
        got_a.append(r[1].logits)
        ta, tb = int(got_a[-1][-1].argmax()), int(got_b[-1][-1].argmax())
    assert torch.equal(torch.cat(got_a), want_a)
    assert torch.equal(torch.cat(got_b), want_b)
    assert a.tokens[: len(pa)] == pa and b.tokens[: len(pb)] == pb


def test_step_refuses_work_that_does_not_continue_its_state(engines):
    eng = engines["qwen3_moe"]
    runner, seq = eng.runner, eng.slot
    seq.rewind(0)
    runner.run(seq, [5, 6, 7], 0, last_n=0)
    with pytest.raises(ValueError, match="holds 3 positions"):
        runner.run(seq, [8], 2)  # a gap or an overlap would leave stale positions in the cache
    with pytest.raises(ValueError, match="appears twice"):
        runner.step([SeqWork(seq, [8], 3), SeqWork(seq, [9], 4)])
    with pytest.raises(ValueError, match="last_n"):
        runner.run(seq, [8], 3, last_n=2)
    with pytest.raises(ValueError, match="max_context"):
        runner.run(seq, [8] * seq.max_context, 3)
    assert seq.length == 3 and seq.tokens == [5, 6, 7]  # a refused step runs nothing


def test_routing_is_returned_per_item_across_prefill_chunks(engines):
    eng = engines["qwen3_moe"]
    seq = eng.slot
    seq.rewind(0)
    ids = prompt_ids(10, seed=7).tolist()
    whole = eng.runner.step([SeqWork(seq, ids, 0, last_n=0, record_routing=True)])[0].routing
    assert sorted(whole) == eng.runner.moe_layers
    seq.rewind(0)
    parts = [eng.runner.step([SeqWork(seq, ids[i : i + 4], i, last_n=0, record_routing=True)])[0].routing
             for i in range(0, 10, 4)]
    for layer, r in whole.items():
        assert r.shape[0] == len(ids)
        assert torch.equal(r, torch.cat([p[layer] for p in parts]))


def _readme_stats_keys() -> list[str]:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    para = readme[readme.index("Stats keys (also in `--json`)") :].split("\n\n")[0]
    return re.findall(r"`(\w+)`", para.split(":", 1)[1])


def test_stats_are_a_typed_dataclass_and_a_mapping_with_the_documented_keys(engines):
    r = engines["qwen3_moe"].generate("def f(x):", max_new_tokens=4, ignore_eos=True)
    s = r.stats
    assert isinstance(s, GenerationStats) and dataclasses.is_dataclass(s)
    assert list(s) == list(STATS_KEYS) == _readme_stats_keys()  # same keys, same order as --json prints
    assert len(s) == len(STATS_KEYS) and set(s.keys()) == set(STATS_KEYS)
    assert s["generated_tokens"] == s.generated_tokens == 4
    assert s.get("decode_tok_s") == s.decode_tok_s and s.get("no_such_key", 3) == 3
    assert "hit_rate" in s and "no_such_key" not in s
    plain = dict(s)
    assert type(plain) is dict and plain == {k: getattr(s, k) for k in STATS_KEYS} and s == plain
    assert json.loads(json.dumps(s)) == json.loads(json.dumps(plain))
    assert list(json.loads(json.dumps({"stats": s}))["stats"]) == list(STATS_KEYS)
    for clone in (copy.deepcopy(s), pickle.loads(pickle.dumps(s)), copy.copy(s)):
        assert isinstance(clone, GenerationStats) and clone == s and list(clone) == list(STATS_KEYS)
    s.evictions = 41  # attribute and item stay one value
    assert s["evictions"] == 41
    s["evictions"] = 42
    assert s.evictions == 42
    s.update(drafted=7)
    assert s.drafted == 7 == s["drafted"]
    with pytest.raises(KeyError, match="not a generation stats key"):
        s["no_such_key"] = 1
    with pytest.raises(TypeError):
        del s["evictions"]
    with pytest.raises(TypeError):
        s.pop("evictions")
    assert list(s) == list(STATS_KEYS)


def test_engine_totals_count_since_load(engines):
    eng = engines["qwen3_moe"]
    before = eng.totals()
    r = eng.generate(prompt_ids(12, seed=9).tolist(), max_new_tokens=6, ignore_eos=True, speculate=False)
    d = eng.totals() - before
    assert isinstance(d, EngineCounters)
    s = r.stats
    assert (d.expert_lookups, d.expert_hits, d.expert_misses) == (s["expert_lookups"], s["expert_hits"],
                                                                   s["expert_misses"])
    assert (d.demand_reads, d.prefetch_reads, d.bytes_read, d.evictions) == (s["demand_reads"], s["prefetch_reads"],
                                                                            s["bytes_read"], s["evictions"])
    assert d.bytes_read > 0 or eng.totals().bytes_read > 0
    # the prompt (less what was reused) once, then every generated token but the last
    assert d.tokens_forwarded == 12 - s["reused_prefix_tokens"] + 6 - 1
    assert d.forwards == 1 + s["decode_forwards"]
    assert eng.totals().to_dict()["forwards"] >= d.forwards


# -- the generator touches no engine internals -------------------------------------------------

ENGINE_ATTRS = {"_run", "cache", "checkpoint", "desc", "experts", "experts_source", "last_stats", "load_s",
                "lossy", "plan", "spine", "state", "trace", "model", "options", "_lock"}


@pytest.mark.parametrize("module", ["generation.py", "scheduler.py", "speculative.py"])
def test_generator_reaches_the_model_only_through_the_runner(module):
    tree = ast.parse((SRC / module).read_text(encoding="utf-8"))
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == "engine":
            bad.append(f"line {node.lineno}: a name 'engine'")
        elif isinstance(node, ast.arg) and node.arg == "engine":
            bad.append(f"line {node.lineno}: a parameter 'engine'")
        elif isinstance(node, ast.Attribute):
            on_self = isinstance(node.value, ast.Name) and node.value.id == "self"
            if node.attr in ENGINE_ATTRS:
                bad.append(f"line {node.lineno}: .{node.attr} (an engine attribute)")
            elif node.attr.startswith("_") and not node.attr.startswith("__") and not on_self:
                bad.append(f"line {node.lineno}: .{node.attr} (private, of another object)")
    assert not bad, f"{module} reaches past the runner: {bad}"


def test_the_engine_hands_the_generator_its_runner():
    """The engine gives the scheduler its runner; the scheduler starts each generation on it."""
    tree = ast.parse((SRC / "engine.py").read_text(encoding="utf-8"))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
             and n.func.id == "Scheduler"]
    assert len(calls) == 1
    args = [ast.unparse(a) for a in calls[0].args]
    assert args == ["self.runner"]
    tree = ast.parse((SRC / "scheduler.py").read_text(encoding="utf-8"))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr == "sequence" and isinstance(n.func.value, ast.Name) and n.func.value.id == "generation"]
    assert len(calls) == 1
    assert ast.unparse(calls[0].args[0]) == "self.runner"


def _result(runner, coroutine):
    """What a generation coroutine returns, run alone."""
    gen = generation.drive(runner, coroutine)
    try:
        while True:
            next(gen)
    except StopIteration as stop:
        return stop.value


def test_a_verify_step_returns_the_routing_of_every_row_on_a_recurrent_model(engines):
    """On a recurrent model a draft is verified as two forwards (the pending token, then the draft
    after a snapshot): the routing trace needs both, one row per position, in order."""
    eng = engines["qwen3_next"]
    runner, seq = eng.runner, eng.slot
    ids, draft = prompt_ids(9, seed=11).tolist(), [17, 18, 19]
    seq.rewind(0)
    runner.run(seq, ids[:-1], 0, last_n=0)
    r = _result(runner, generation._verify(seq, ids[-1:], draft, len(ids) - 1, True, True))
    assert r.logits.shape[0] == 1 + len(draft)
    seq.rewind(0)
    runner.run(seq, ids[:-1], 0, last_n=0)
    one = runner.step([SeqWork(seq, ids[-1:], len(ids) - 1, record_routing=True)])[0].routing
    rest = runner.step([SeqWork(seq, draft, len(ids), last_n=len(draft), record_routing=True)])[0].routing
    for layer in runner.moe_layers:
        assert torch.equal(r.routing[layer], torch.cat([one[layer], rest[layer]]))
