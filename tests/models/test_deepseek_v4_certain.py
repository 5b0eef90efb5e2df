"""Certain reads (``experts/certain.py``): the experts of DeepSeek-V4's hash layers are read from
the step's token ids before their layer runs. The provider's rules on a weightless cache (read
at demand priority, or, ``staggered``, a later hash layer's behind every demand read until the
layer before it has run; pinned until their layer runs and found there by ``moe``; the pins
bounded by the room the running layer needs; the next chunk's read at prefetch priority as the
current forward leaves each layer and raised when its forward begins), then the tiny V4 end to
end: every hash layer finds all its experts in memory or in flight on entry, nothing is read
twice, and tokens and logits are bit-identical with the reads on and off (greedy, chunked
prefill, speculative drafts); a family without hash layers asks for nothing; the synthetic
writer's valid hash tables."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch

import sluice
from conftest import prompt_ids
from families import PROMPT
from sluice.experts.cache import READY, ExpertCache
from sluice.experts.policy_spec import make_policy
from sluice.experts.provider import ExpertProvider
from sluice.experts.spec import ExpertSpec
from sluice.layers.context import ForwardContext
from sluice.replay.sim import WeightlessExperts
from sluice.storage.priority import DEMAND, PREFETCH


class _Pool:
    """Reads complete at submit; every submission is kept (layer, expert, its ticket) in order."""

    def __init__(self):
        self.reads: list[tuple[int, int, object]] = []

    def submit(self, fn, *args, priority=DEMAND, ticket=None):
        self.reads.append((args[1], args[2], ticket))
        f = Future()
        f.set_running_or_notify_cancel()
        f.set_result(fn(*args))
        return f

    def shutdown(self):
        pass


def _provider(slots: int):
    cache = ExpertCache(slots, 1, make_policy("lfru"))
    pool = _Pool()
    p = ExpertProvider(
        WeightlessExperts(),
        cache,
        ExpertSpec(hidden=1, intermediate=1),
        16,
        pool=pool,
        compute=(lambda spec, w, x, s: x, lambda spec, w, x: x),
    )
    return p, pool


def _decode(certain: dict) -> ForwardContext:
    ctx = ForwardContext.single(torch.zeros(1, dtype=torch.long), decoding=True)
    ctx.certain = certain
    return ctx


def _moe(p, layer, experts, ctx):
    ids = torch.tensor([experts])
    return p.moe(layer, torch.zeros(1, 1), ids, torch.ones(ids.shape), ctx)


@pytest.mark.parametrize("staggered", [False, True])
def test_read_at_demand_pinned_then_found_by_the_layer(staggered):
    p, pool = _provider(slots=16)
    p.certain.staggered = staggered
    certain = {1: torch.tensor([[5, 2]]), 2: torch.tensor([[7, 2]])}
    ctx = _decode(certain)
    p.begin(ctx)
    p.read_certain(certain, rows=1)
    later = PREFETCH if staggered else DEMAND  # staggered: the later hash layer's behind every demand read ...
    assert [(lay, e, t.priority) for lay, e, t in pool.reads] == [
        (1, 2, DEMAND),
        (1, 5, DEMAND),
        (2, 2, later),
        (2, 7, later),
    ]
    assert all(p.cache.lookup((lay, e)).pins == 1 for lay, e, _ in pool.reads)
    c = p.counters
    assert (c.certain_reads, c.demand_reads, c.certain_bytes) == (4, 4, 4 * WeightlessExperts().layout(1, 2).read_bytes)
    _moe(p, 1, [5, 2], ctx)
    assert [t.priority for _, _, t in pool.reads[2:]] == [DEMAND, DEMAND]  # ... until the layer before has run
    _moe(p, 2, [7, 2], ctx)
    assert len(pool.reads) == 4 and c.demand_reads == 4  # the layers found them: nothing read twice
    assert (c.hash_lookups, c.hash_misses) == (4, 0)
    assert all(p.cache.lookup((lay, e)).pins == 0 for lay, e, _ in pool.reads)  # released by their layer


def test_pins_leave_the_room_the_running_layer_needs():
    """8 slots, one row of top-2: the certain pins keep 2 slots free (6 pinned at most); the
    first three layers' experts are read, the fourth's is read by its layer on demand."""
    p, pool = _provider(slots=8)
    certain = {lay: torch.tensor([[2 * lay, 2 * lay + 1]]) for lay in range(4)}
    ctx = _decode(certain)
    p.begin(ctx)
    p.read_certain(certain, rows=1)
    assert sorted({lay for lay, *_ in pool.reads}) == [0, 1, 2] and p.counters.certain_reads == 6
    _moe(p, 9, [14, 15], ctx)  # a router layer between them still finds its two slots
    for lay in range(4):
        _moe(p, lay, [2 * lay, 2 * lay + 1], ctx)
    assert p.counters.demand_reads == 6 + 2 + 2
    # a forward that fails before reaching its layers leaves nothing pinned at the next begin
    p.read_certain({5: torch.tensor([[1, 3]])}, rows=1)
    assert p.cache.lookup((5, 1)).pins == 1
    p.begin(_decode({}))
    assert p.cache.lookup((5, 1)).pins == 0


def test_the_next_chunk_is_read_as_this_forward_leaves_each_layer():
    p, pool = _provider(slots=16)
    now, nxt = {1: torch.tensor([[1, 2]])}, {1: torch.tensor([[3, 4]])}
    ctx = _decode(now)
    p.begin(ctx)
    p.read_certain(now, rows=1)
    p.read_certain(nxt, rows=1, ahead=True)
    assert len(pool.reads) == 2  # the next forward's wait for this one to leave layer 1
    _moe(p, 1, [1, 2], ctx)
    ahead = [(lay, e, t) for lay, e, t in pool.reads[2:]]
    assert [(lay, e, t.priority) for lay, e, t in ahead] == [(1, 3, PREFETCH), (1, 4, PREFETCH)]
    ctx2 = _decode(nxt)
    p.begin(ctx2)  # the next forward: its reads are raised to demand
    assert all(t.priority == DEMAND for _, _, t in ahead)
    p.read_certain(nxt, rows=1)  # asked again at its own begin: already read and pinned
    assert len(pool.reads) == 4 and p.cache.lookup((1, 3)).pins == 1
    _moe(p, 1, [3, 4], ctx2)
    assert p.counters.demand_reads == 4 and p.cache.lookup((1, 3)).state == READY
    assert p.cache.lookup((1, 3)).pins == 0


def _entry_check(eng, hash_layers):
    """Wrap the provider: on entry of a hash layer, which of its experts were not yet in the cache
    (neither READY nor being read); and every read of a hash layer's expert (key -> count)."""
    provider, absent, reads = eng.experts, [], {}
    run, read = provider.run_experts, provider._read

    def checked(layer, x, work, *a, **kw):
        if layer in hash_layers:
            absent.extend((layer, e) for e in work.experts if provider.cache.lookup((layer, e)) is None)
        return run(layer, x, work, *a, **kw)

    def counted(base, layer, expert):
        if layer in hash_layers:
            reads[layer, expert] = reads.get((layer, expert), 0) + 1  # one reader thread per read: no race on a key
        return read(base, layer, expert)

    provider.run_experts, provider._read = checked, counted
    return absent, reads


def test_tiny_v4_bit_identical_on_and_off_and_read_before_their_layer(family_models):
    path = family_models.hf("deepseek_v4", "f32")
    ids = PROMPT  # 8 tokens twice: n-gram speculation drafts
    runs = {}
    for on in (True, False):
        for chunk in (512, 5):
            with sluice.load(path, memory="4GiB", progress=False, prefill_chunk=chunk, certain_reads=on) as eng:
                hash_layers = set(eng.model.certain_experts(ids[:1]))
                assert hash_layers == {1, 2}
                absent, reads = _entry_check(eng, hash_layers)
                logits = eng.forward(ids)
                plain = eng.generate(ids.tolist(), max_new_tokens=10, ignore_eos=True, speculate=False, logprobs=0)
                spec = eng.generate(ids.tolist(), max_new_tokens=10, ignore_eos=True, logprobs=0)
                c = eng.runner.counters()
                assert spec.stats["drafted"] > 0
                # the cache holds the model: nothing is evicted, a hash layer's expert is read once
                assert c.evictions == 0 and reads and set(reads.values()) == {1}
                runs[on, chunk] = (logits, plain.token_ids, plain.logprobs, spec.token_ids, spec.logprobs)
                if on:
                    assert not absent and c.certain_reads > 0 and c.hash_misses <= c.hash_lookups
                else:
                    assert absent and c.certain_reads == 0  # the check can fail: off, layers read their own
    want = runs[True, 512]
    assert want[1] == want[3] and want[2] == want[4]
    for key, got in runs.items():
        assert torch.equal(got[0], want[0]), key
        assert got[1:] == want[1:], key


def test_a_family_without_hash_layers_asks_for_nothing(family_models):
    with sluice.load(family_models.hf("qwen3_moe", "f32"), memory="4GiB", progress=False) as eng:
        assert eng.model.certain_experts(prompt_ids(4)) == {}
        calls = []
        eng.experts.read_certain = lambda *a, **kw: calls.append(a)
        eng.generate(prompt_ids(8).tolist(), max_new_tokens=3, ignore_eos=True)
        assert calls == [] and eng.runner.counters().certain_reads == 0


def test_synthetic_v4_writes_valid_hash_tables(tmp_path):
    """``sluice demo --synthetic --family deepseek_v4``'s writer: the hash tables are int64 rows
    of distinct experts in range (random bf16 would be refused), and the model runs."""
    from safetensors import safe_open

    from sluice.synthetic import DEEPSEEK_V4_CONFIG, model_tables, write_model

    cfg = dict(
        DEEPSEEK_V4_CONFIG,
        vocab_size=512,
        hidden_size=64,
        moe_intermediate_size=32,
        head_dim=32,
        qk_rope_head_dim=8,
        q_lora_rank=32,
        o_lora_rank=16,
        index_head_dim=16,
        n_routed_experts=8,
        num_hidden_layers=4,
        layer_types=DEEPSEEK_V4_CONFIG["layer_types"][:4],
        mlp_layer_types=["hash_moe"] * 3 + ["moe"],
    )
    tables = model_tables(cfg)
    assert sorted(tables) == [f"layers.{i}.ffn.gate.tid2eid" for i in range(3)]
    path = write_model(tmp_path / "v4", cfg, progress=False, tokenizer=False)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for name in tables:
            t = f.get_tensor(name)
            assert t.dtype == torch.int64 and t.shape == (512, 6)
            assert int(t.min()) >= 0 and int(t.max()) < 8
            assert all(len(set(row)) == 6 for row in t.tolist())
    with sluice.load(path, memory="2GiB", progress=False) as eng:
        assert torch.isfinite(eng.forward(prompt_ids(6))).all()


def test_lookahead_predicts_hash_layers_with_certainty(family_models):
    """With certain reads the lookahead's prediction for a hash layer is its routing (the table's
    experts); without, it has no guess for it."""
    from sluice.runner import SeqWork

    for on in (True, False):
        with sluice.load(
            family_models.hf("deepseek_v4", "f32"), memory="4GiB", progress=False, certain_reads=on
        ) as eng:
            ids = PROMPT[:6].tolist()
            seq = eng.runner.slots[0]
            res = eng.runner.step([SeqWork(seq, ids, 0, 1, decoding=True, record_routing=True)])[0]
            for layer in (1, 2):
                if on:
                    got = [sorted(r) for r in res.predicted[layer].tolist()]
                    assert got == [sorted(r) for r in res.routing[layer].tolist()]
                else:
                    assert layer not in res.predicted
            assert 3 in res.predicted  # a router layer is guessed either way
