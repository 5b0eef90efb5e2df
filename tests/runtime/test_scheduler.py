"""The scheduler (scheduler.py): several generations at once on the engine's state slots.

Each generation of a batch gets the tokens (and log-probabilities, bit for bit) it gets alone:
from threads, from ``Engine.generate([...])``, with sampling, with a long prompt prefilled in
pieces between other sequences' decode steps; cancelled ones leave the batch; idle slots keep
their conversations for prefix reuse and the least recently used one is evicted.
"""

from __future__ import annotations

import threading

import pytest

import sluice
from conftest import prompt_ids
from sluice.errors import BudgetError, GenerationCancelled, InvalidArgumentError
from sluice.plan import make_plan, max_parallel

FAMILIES = ["qwen3_moe", "qwen3_next", "deepseek_v3"]  # plain attention, a hybrid with linear attention, MLA
N_NEW = 10
GREEDY = dict(max_new_tokens=N_NEW, ignore_eos=True, logprobs=2)
SAMPLED = dict(max_new_tokens=N_NEW, ignore_eos=True, logprobs=2, temperature=0.9, top_k=20)


def _prompts(n: int = 4) -> list[list[int]]:
    return [prompt_ids(5 + 4 * i, seed=40 + i).tolist() for i in range(n)]


def _same(a, b) -> None:
    assert a.token_ids == b.token_ids
    assert a.logprobs == b.logprobs  # floats compared exactly: the same logits bit for bit
    assert a.finish_reason == b.finish_reason


@pytest.fixture(scope="module")
def engines(family_models):
    out = {}
    for family in FAMILIES:
        out[family] = sluice.load(family_models.hf(family), memory="2GiB", cache_experts=6, parallel=4,
                                  progress=False)
    yield out
    for eng in out.values():
        eng.close()


def _solo(eng, prompts, **gen):
    return [eng.generate(p, **gen) for p in prompts]


@pytest.mark.parametrize("family", FAMILIES)
def test_concurrent_streams_from_threads_equal_their_solo_runs(engines, family):
    eng = engines[family]
    prompts = _prompts()
    for gen in (GREEDY, SAMPLED):
        kw = [dict(gen, seed=7 + i) if "temperature" in gen else gen for i in range(len(prompts))]
        want = [eng.generate(p, **k) for p, k in zip(prompts, kw)]
        got: list = [None] * len(prompts)
        errors: list = []
        go = threading.Barrier(len(prompts))

        def worker(i):
            try:
                go.wait()
                got[i] = eng.generate(prompts[i], **kw[i])
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors
        for a, b in zip(got, want):
            _same(a, b)
    assert eng.scheduler.stats().running == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_a_list_runs_them_together_and_equals_solo(engines, family):
    eng = engines[family]
    prompts = _prompts(6)  # more than --parallel 4: two wait for a slot
    want = _solo(eng, prompts, **GREEDY)
    before = eng.scheduler.stats()
    got = eng.generate(prompts, **GREEDY)
    assert isinstance(got, list) and len(got) == len(prompts)
    for a, b in zip(got, want):
        _same(a, b)
    after = eng.scheduler.stats()
    assert after.max_batch_size == 4  # never more than the slots
    steps = after.steps - before.steps
    # six generations of 10 tokens (one prefill + 9 decode forwards each, speculation aside) in
    # fewer steps than one after another: they shared steps
    assert steps < sum(1 + r.stats["decode_forwards"] for r in got)
    # a shared step's reads count in full for each sequence that took part in it
    assert all(r.stats["expert_lookups"] >= w.stats["expert_lookups"] for r, w in zip(got, want))


def test_generate_list_of_text_prompts_and_seeded_sampling(family_models):
    eng = sluice.load(family_models.hf("qwen3_moe"), memory="2GiB", parallel=2, progress=False)
    try:
        ids = _prompts(3)
        want = [eng.generate(p, seed=3, **SAMPLED) for p in ids]
        got = eng.generate(ids, seed=3, **SAMPLED)
        for a, b in zip(got, want):
            _same(a, b)
        assert eng.generate([ids[0]], **GREEDY)[0].token_ids == eng.generate(ids[0], **GREEDY).token_ids
        with pytest.raises(InvalidArgumentError, match="token id"):
            eng.generate([ids[0], [1, 99999]], **GREEDY)  # every prompt is checked before any runs
        with pytest.raises(InvalidArgumentError, match="unknown argument"):
            eng.generate(ids, max_tokens=3)
    finally:
        eng.close()


def test_cancelled_and_closed_streams_leave_the_batch(engines):
    eng = engines["qwen3_next"]
    prompts = _prompts(3)
    long = dict(max_new_tokens=40, ignore_eos=True, speculate=False)
    want = _solo(eng, prompts, **long)
    ev = threading.Event()
    streams = [eng.stream(prompts[0], cancel=ev, **long), eng.stream(prompts[1], **long),
               eng.stream(prompts[2], **long)]
    firsts = [next(s) for s in streams]  # all three joined the batch
    assert [f.token_id for f in firsts] == [w.token_ids[0] for w in want]
    ev.set()
    with pytest.raises(GenerationCancelled):
        next(streams[0])
    for _ in range(3):
        next(streams[1])
    streams[1].close()  # the reader goes away: its sequence leaves too
    rest = [s.token_id for s in streams[2]]
    assert [firsts[2].token_id] + rest == want[2].token_ids
    assert eng.scheduler.stats().running == 0
    # their slots are free again: four fit at once
    got = eng.generate(_prompts(4), max_new_tokens=3, ignore_eos=True)
    assert len(got) == 4


def test_a_long_prefill_is_cut_between_decode_steps_and_stays_exact(family_models):
    """With a step budget of 8 tokens, a 60-token prompt joins a decoding sequence in pieces of
    at most 7 tokens (the decode token goes first, every step); its tokens and log-probabilities
    equal its solo run (one chunk of 8 at a time), bit for bit."""
    eng = sluice.load(family_models.hf("qwen3_next"), memory="2GiB", parallel=2, prefill_chunk=8, progress=False)
    try:
        short, long_prompt = prompt_ids(4, seed=51).tolist(), prompt_ids(60, seed=52).tolist()
        want_short = eng.generate(short, max_new_tokens=30, ignore_eos=True, logprobs=1)
        want_long = eng.generate(long_prompt, **GREEDY)
        steps: list[list[tuple[int, int, bool]]] = []
        real = eng.runner.step

        def recording(work):
            steps.append([(w.seq.slot, len(w.tokens), w.decoding) for w in work])
            return real(work)

        eng.runner.step = recording
        try:
            s = eng.stream(short, max_new_tokens=30, ignore_eos=True, logprobs=1)
            first = next(s)
            got_long = eng.generate(long_prompt, **GREEDY)
            rest = list(s)
        finally:
            del eng.runner.step
        _same(got_long, want_long)
        assert [first.token_id] + [x.token_id for x in rest] == want_short.token_ids
        assert [first.logprob] + [x.logprob for x in rest] == want_short.logprobs
        assert all(sum(n for _, n, _ in st) <= 8 for st in steps)
        mixed = [st for st in steps if len(st) == 2]
        assert len(mixed) >= 60 // 7  # the long prompt's pieces, each beside a decode token
        assert all(any(d for _, _, d in st) for st in mixed)
    finally:
        eng.close()


def test_idle_slots_keep_conversations_and_the_least_recently_used_is_evicted(family_models):
    eng = sluice.load(family_models.hf("qwen3_moe"), memory="2GiB", parallel=2, progress=False)
    fresh = sluice.load(family_models.hf("qwen3_moe"), memory="2GiB", parallel=1, progress=False)
    gen = dict(max_new_tokens=6, ignore_eos=True, speculate=False)
    try:
        a, b, c = (prompt_ids(12, seed=s).tolist() for s in (61, 62, 63))

        def turn(prompt):
            r = eng.generate(prompt, reuse_prefix=True, **gen)
            assert r.token_ids == fresh.generate(prompt, **gen).token_ids
            return r

        ra, rb = turn(a), turn(b)
        assert ra.stats["reused_prefix_tokens"] == rb.stats["reused_prefix_tokens"] == 0
        a2 = a + ra.token_ids + [7, 8]
        assert turn(a2).stats["reused_prefix_tokens"] == len(a) + len(ra.token_ids) - 1  # a's slot was kept
        b2 = b + rb.token_ids + [9]
        rb2 = turn(b2)
        assert rb2.stats["reused_prefix_tokens"] == len(b) + len(rb.token_ids) - 1  # and b's
        turn(c)  # a new conversation evicts the least recently used idle slot: a's
        b3 = b2 + rb2.token_ids + [6]
        assert turn(b3).stats["reused_prefix_tokens"] == len(b2) + len(rb2.token_ids) - 1  # b's survived
        assert turn(a2 + [5]).stats["reused_prefix_tokens"] == 0
    finally:
        eng.close()
        fresh.close()


def test_forward_runs_between_steps_of_running_generations(engines):
    eng = engines["qwen3_moe"]
    ids = prompt_ids(9, seed=71).tolist()
    alone = eng.forward(ids)
    s = eng.stream(_prompts(1)[0], max_new_tokens=20, ignore_eos=True)
    next(s)
    assert (eng.forward(ids) == alone).all()
    assert len(list(s)) == 19


def test_parallel_reserves_state_for_each_sequence_and_inspect_says_what_fits():
    args = dict(budget=1 << 30, baseline=100 << 20, spine_global=50 << 20, spine_layers={0: 10 << 20, 1: 10 << 20},
                stream_buffer=10 << 20, state_bytes=40 << 20, activations=20 << 20, slot_bytes=1 << 20,
                working_set=8, total_experts=4096, top_k=2, max_context=1024, prefill_chunk=512)
    one, three = make_plan(parallel=1, **args), make_plan(parallel=3, **args)
    assert (one.parallel, three.parallel) == (1, 3)
    assert three.state_bytes == 3 * one.state_bytes == 3 * (40 << 20) and three.seq_state_bytes == 40 << 20
    assert one.cache_slots - three.cache_slots == 80  # two more states: 80 MiB less expert cache
    assert make_plan(parallel=None, **args).parallel == 4  # the default: 4 when they fit
    n = max_parallel(**args)
    assert make_plan(parallel=n, **args).parallel == n
    with pytest.raises(BudgetError, match="--parallel"):
        make_plan(parallel=n + 1, **args)
    tight = dict(args, budget=make_plan(parallel=2, **args).budget_for_slots(8) + (1 << 20))
    assert make_plan(parallel=None, **tight).parallel == 2  # only two states fit beside the working set
    assert max_parallel(**tight) == 2
    with pytest.raises(InvalidArgumentError, match="parallel"):
        make_plan(parallel=0, **args)


def test_inspect_and_load_report_parallel(family_models):
    from sluice.model_report import inspect_model, render_inspect

    path = family_models.hf("qwen3_moe")
    r = inspect_model(path, memory=2 << 30)
    assert r["plan"]["parallel"] == 4
    assert all(b["parallel_max"] >= b["parallel"] >= 1 for b in r["budgets"] if b["ok"])
    assert all(b["parallel"] == 0 for b in r["budgets"] if not b["ok"])
    assert "parallel" in render_inspect(r)
    r2 = inspect_model(path, memory=2 << 30, parallel=2)
    assert r2["plan"]["parallel"] == 2
    assert r2["plan"]["state_bytes"] == 2 * r2["kv_state_bytes"]
    eng = sluice.load(path, memory="2GiB", parallel=3, progress=False)
    try:
        assert eng.parallel == 3 == len(eng.runner.slots)
    finally:
        eng.close()
    with pytest.raises(InvalidArgumentError, match="parallel"):
        sluice.load(path, parallel=0)


def test_an_item_the_runner_failed_fails_only_its_generation(engines):
    """The batched runner answers an item whose expert read failed with ``SeqResult.error`` (the
    others are re-run): that generation raises it, the others go on as alone."""
    from sluice.errors import ExpertReadError
    from sluice.runner import SeqResult

    eng = engines["qwen3_moe"]
    prompts = _prompts(3)
    want = _solo(eng, prompts, **GREEDY)
    real, calls = eng.runner.step, []

    def failing(work):
        results = real(work)
        calls.append(len(work))
        if len(calls) == 4:  # the fourth step: the item of the sequence on the middle prompt fails
            for i, w in enumerate(work):
                if w.seq.tokens[: len(prompts[1])] == prompts[1]:
                    results[i] = SeqResult(None)
                    results[i].error = ExpertReadError("layer 1 expert 3: read failed (test)")
        return results

    eng.runner.step = failing
    try:
        seqs = [eng.stream(p, **GREEDY) for p in prompts]
        firsts = [next(s) for s in seqs]
        with pytest.raises(ExpertReadError, match="read failed"):
            list(seqs[1])
        rest = [[firsts[i].token_id] + [s.token_id for s in seqs[i]] for i in (0, 2)]
    finally:
        del eng.runner.step
    assert rest == [want[0].token_ids, want[2].token_ids]
    assert eng.generate(prompts[1], **GREEDY).token_ids == want[1].token_ids  # its slot is clean again


def test_closing_the_engine_ends_its_generations(family_models):
    from sluice.scheduler import EngineClosed

    eng = sluice.load(family_models.hf("qwen3_moe"), memory="2GiB", parallel=1, progress=False)
    running = eng.stream(_prompts(1)[0], max_new_tokens=200, ignore_eos=True)
    next(running)
    waiting = eng.stream(_prompts(2)[1], max_new_tokens=5)
    eng.close()
    with pytest.raises(EngineClosed):
        list(running)
    with pytest.raises(EngineClosed):
        next(waiting)


def test_parallel_on_the_command_line(family_models, capsys):
    import json

    from sluice.cli import build_parser, main

    parser = build_parser()
    assert parser.parse_args(["serve", "m"]).parallel is None  # serve: what the budget allows
    assert parser.parse_args(["run", "m"]).parallel == 1  # one sequence: no state slots to spare
    assert parser.parse_args(["run", "m", "--parallel", "3"]).parallel == 3
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "m", "--parallel", "0"])
    assert main(["inspect", str(family_models.hf("qwen3_moe")), "--memory", "2GiB", "--parallel", "2",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["plan"]["parallel"] == 2 and all(b["parallel"] in (0, 2) for b in report["budgets"])


def test_an_engine_dropped_without_close_is_freed(family_models, monkeypatch):
    """The scheduler's thread ends when it has nothing to do: it does not keep a dropped engine
    (its model, caches and state slots) alive; a new generation starts a new thread."""
    import gc
    import weakref

    from serve_process import wait_for
    from sluice import scheduler

    monkeypatch.setattr(scheduler, "IDLE_EXIT_S", 0.05)
    eng = sluice.load(family_models.hf("qwen3_moe"), memory="2GiB", parallel=2, progress=False)
    first = eng.generate(_prompts(1)[0], max_new_tokens=3).token_ids
    wait_for(lambda s=eng.scheduler: s._thread is None, timeout=10, what="the idle scheduler thread to end")
    assert eng.generate(_prompts(1)[0], max_new_tokens=3).token_ids == first  # a new thread runs it
    ref = weakref.ref(eng)
    del eng
    wait_for(lambda: gc.collect() is not None and ref() is None, timeout=10, what="the engine to be freed")
