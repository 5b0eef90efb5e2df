"""The true memory floor: one step of one layer's experts (top-k + the lookahead's reads in
flight) beside the spine and the buffers; between it and one token's working set the engine
runs, exactly, with a cache that keeps no expert across tokens and a prefill chunk shrunk
until its union fits; below it, a refusal that names the floor."""

from __future__ import annotations

import gc
import shutil
import warnings

import pytest
import torch

import sluice
from sluice.engine import ModelInfo, Options
from sluice.errors import BudgetError
from sluice.plan import budget_for, chunk_for, make_plan, margin_for, step_slots

MiB = 1 << 20


def _acts(chunk: int) -> int:
    return 4 * MiB + chunk * 64 * 1024  # buffers that grow with the prefill chunk


def _plan(budget, **kw):
    # 8 MoE layers x 16 experts of 4 MiB, top-2: working set 16 experts (64 MiB)
    args = dict(budget=budget, baseline=100 * MiB, spine_global=20 * MiB, spine_layers={i: 2 * MiB for i in range(8)},
                stream_buffer=2 * MiB, state_bytes=8 * MiB, activations=_acts(512), activations_for=_acts,
                slot_bytes=4 * MiB, working_set=16, total_experts=128, layer_experts=16, top_k=2,
                lookahead_slots=2, max_context=1024, prefill_chunk=512)
    args.update(kw)
    return make_plan(**args)


def test_step_slots_and_chunk_for():
    assert step_slots(2, 2, 16) == 4  # top-k + the lookahead's top-k in flight
    assert step_slots(2, 0, 16) == 2  # no prefetch: top-k
    assert step_slots(8, 8, 8) == 8  # never more than one token's working set (one MoE layer)
    fit = dict(chunk=512, top_k=2, layer_experts=16, lookahead_slots=2, working_set=16)
    assert chunk_for(4, **fit) == 1  # 2 slots beside the lookahead: one token's top-2
    assert chunk_for(9, **fit) == 3  # 7 slots: 3 tokens route to at most 6 experts
    assert chunk_for(15, **fit) == 6
    assert chunk_for(16, **fit) == 512  # the working set: the chunk stays (its union streams through)
    assert chunk_for(10, **dict(fit, layer_experts=8)) == 512  # a layer's 8 experts all fit beside the lookahead
    assert chunk_for(9, **dict(fit, chunk=2)) == 2  # never more than asked


def test_floor_math():
    p = _plan(1 << 40)
    assert p.floor_slots == 4
    # the floor: baseline + KV + one-token chunk's buffers + resident global spine + 2 streamed layers' buffers
    # + 4 slots, streaming every layer (2 MiB per layer resident costs more than the 4 MiB of buffers)
    fixed = 100 * MiB + 8 * MiB + _acts(1) + 20 * MiB + 2 * 2 * MiB
    assert p.floor == budget_for(fixed, 4 * 4 * MiB)
    assert p.floor_resident == budget_for(100 * MiB + 8 * MiB + _acts(1) + 36 * MiB, 4 * 4 * MiB)
    # one token's working set keeps the whole chunk's buffers and 16 slots (streaming every layer)
    assert p.working_set_budget == budget_for(100 * MiB + 8 * MiB + _acts(512) + 20 * MiB + 4 * MiB, 16 * 4 * MiB)
    at = _plan(p.floor)
    assert at.cache_slots == 4 and at.prefill_chunk == 1 and at.below_working_set and at.reduced
    assert at.activation_bytes == _acts(1)  # the shrunk chunk frees its buffers
    assert at.fixed_bytes + margin_for(at.budget) + at.cache_bytes <= at.budget
    ws = _plan(p.working_set_budget)
    assert ws.cache_slots >= 16 and not ws.below_working_set and ws.prefill_chunk == 512


def test_between_floor_and_working_set():
    p = _plan(1 << 40)
    last = None
    for budget in range(p.floor, p.working_set_budget, 3 * MiB):
        q = _plan(budget)
        assert 4 <= q.cache_slots < 16 and q.below_working_set
        # the chunk is the largest whose union fits beside the lookahead, and everything fits the budget
        assert q.prefill_chunk == chunk_for(q.cache_slots, chunk=512, top_k=2, layer_experts=16, lookahead_slots=2,
                                            working_set=16)
        assert q.prefill_chunk * 2 <= q.cache_slots - 2
        assert q.fixed_bytes + q.margin_bytes + q.cache_bytes <= budget
        if last is not None:  # more memory: never fewer slots nor a smaller chunk
            assert q.cache_slots >= last.cache_slots and q.prefill_chunk >= last.prefill_chunk
        last = q
    assert last is not None and last.cache_slots > 4
    # the default runs one sequence there (more would each shrink the cache further)
    assert _plan(p.floor + 12 * MiB, parallel=None).parallel == 1


def test_refused_below_the_floor_naming_it():
    p = _plan(1 << 40)
    with pytest.raises(BudgetError) as e:
        _plan(p.floor - 1)
    msg = str(e.value)
    assert f"is below the floor {sluice.units.format_size(p.floor)}" in msg
    assert "one step of one layer's experts (top-2 + 2 lookahead reads = 4 x 4.00 MiB" in msg
    assert "prefill chunk 1 of 512 tokens" in msg and "keeps one token's working set of 16 experts" in msg


# -- the engine ------------------------------------------------------------------------------

CONFIG = {  # 6 MoE layers x 8 experts of 3 MiB (bf16), top-2: working set 12 experts, floor 4
    "model_type": "qwen3_moe", "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512,
    "moe_intermediate_size": 2048, "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 64, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True, "hidden_act": "silu",
    "rms_norm_eps": 1e-6, "max_position_embeddings": 1024,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}
PROMPT = list(range(3, 43))
GEN = dict(max_new_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def floor_model(tmp_path_factory):
    from sluice.synthetic import write_model

    root = tmp_path_factory.mktemp("floor")
    path = write_model(root / "model", CONFIG, std=0.2, progress=False, tokenizer=True)
    yield path
    shutil.rmtree(root, ignore_errors=True)


def _budgets(path) -> tuple[int, int]:
    info = ModelInfo(path)
    try:
        p = info.plan(1 << 40, Options(max_context=256, parallel=1))
        return p.floor, p.working_set_budget
    finally:
        info.close()


def test_engine_between_floor_and_working_set_is_exact(floor_model):
    with sluice.load(floor_model, memory="4GiB", max_context=256, parallel=1, progress=False) as full:
        assert full.plan.cache_slots == 48
        want = full.generate(PROMPT, **GEN).token_ids
        want_logits = full.forward(torch.tensor(PROMPT))
    floor, ws = _budgets(floor_model)
    assert ws - floor > 20 * MiB  # 8 slots of 3 MiB between them: room for this process's RSS to move
    budget = (floor + ws) // 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eng = sluice.load(floor_model, memory=budget, max_context=256, parallel=1, progress=False)
    with eng:
        notes = [str(w.message) for w in caught if "working set" in str(w.message)]
        assert len(notes) == 1 and "cannot keep experts across tokens" in notes[0]
        p = eng.plan
        assert p.floor_slots <= p.cache_slots < p.working_set == 12  # smaller than one token's working set
        assert p.prefill_chunk < 512 and p.prefill_chunk * 2 <= p.cache_slots - 2  # the chunk shrank to fit
        r = eng.generate(PROMPT, **GEN)
        assert r.token_ids == want
        assert r.stats["expert_misses"] > 0 and r.stats["cache_slots"] == p.cache_slots
        logits = eng.forward(torch.tensor(PROMPT))  # prefilled in chunks of p.prefill_chunk
        assert (logits - want_logits).abs().max().item() < 1e-3
        assert torch.equal(logits.argmax(-1), want_logits.argmax(-1))
        assert eng.cache.capacity == p.cache_slots and len(eng.cache) <= p.cache_slots


def test_engine_at_the_floor_and_below(floor_model):
    floor, _ = _budgets(floor_model)
    # a little above the floor (this process's RSS moves between planning and loading)
    with pytest.warns(UserWarning, match="less than one token's working set"):
        eng = sluice.load(floor_model, memory=floor + 2 * MiB, max_context=256, parallel=1, progress=False)
    with eng:
        assert eng.plan.cache_slots < 12 and eng.plan.prefill_chunk <= (eng.plan.cache_slots - 2) // 2
        with sluice.load(floor_model, memory="4GiB", max_context=256, parallel=1, progress=False) as full:
            want = full.generate(PROMPT, **GEN).token_ids
        assert eng.generate(PROMPT, **GEN).token_ids == want
    # the floor holds this process's RSS, which fell when the two engines closed: measure it again
    gc.collect()
    floor, _ = _budgets(floor_model)
    with pytest.raises(BudgetError, match=r"is below the floor .* one step of one layer's experts \(top-2 \+ 2 "
                                          r"lookahead reads = 4 x 3\.00 MiB"):
        sluice.load(floor_model, memory=floor - 8 * MiB, max_context=256, parallel=1, progress=False)


def _cli(*args):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "sluice.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def test_cli_inspect_run_and_refusal(floor_model):
    import json

    r = _cli("inspect", floor_model, "--max-context", 256, "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["floor_slots"] == 4 and rep["working_set_experts"] == 12
    assert rep["floor_bytes"] < rep["working_set_budget_bytes"]
    between = [b for b in rep["budgets"] if b["ok"] and b["below_working_set"]]
    assert between and all(b["prefill_chunk"] < 512 for b in between)
    text = _cli("inspect", floor_model, "--max-context", 256).stdout
    assert "memory floor" in text and "working set" in text and "keeps one token's experts (12)" in text
    mid = (rep["floor_bytes"] + rep["working_set_budget_bytes"]) // 2
    r = _cli("run", floor_model, "--memory", f"{mid}B", "--max-context", 256, "--parallel", 1, "-p", "hello",
             "--max-new-tokens", 4, "--ignore-eos", "--no-progress", "--json")
    assert r.returncode == 0, r.stderr
    notes = [line for line in r.stderr.splitlines() if "working set" in line]
    assert len(notes) == 1 and notes[0].startswith("sluice: warning: ")  # once, on stderr
    assert json.loads(r.stdout)["stats"]["generated_tokens"] == 4
    low = rep["floor_bytes"] - 16 * MiB
    r = _cli("run", floor_model, "--memory", f"{low}B", "--max-context", 256, "-p", "hello", "--no-progress")
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sluice: error: memory budget") and "below the floor" in lines[0]
    assert "Traceback" not in r.stderr


def test_batch_below_the_working_set_streams_through_the_cache(floor_model):
    """Two sequences at once (an explicit --parallel) below the working set: their union in a
    layer can exceed the cache; it streams through (each expert released once computed) and
    each sequence gets the tokens it gets alone in an unconstrained engine."""
    prompts = [PROMPT, list(range(50, 75))]
    with sluice.load(floor_model, memory="4GiB", max_context=256, parallel=1, progress=False) as full:
        want = [full.generate(p, **GEN).token_ids for p in prompts]
    floor, ws = _budgets(floor_model)
    with pytest.warns(UserWarning, match="less than one token's working set"):
        eng = sluice.load(floor_model, memory=(floor + ws) // 2 + 4 * MiB, max_context=256, parallel=2,
                          progress=False)
    with eng:
        assert eng.plan.parallel == 2 and eng.plan.below_working_set
        got = eng.generate(prompts, **GEN)
        assert [r.token_ids for r in got] == want
        assert eng.scheduler.stats().max_batch_size == 2
