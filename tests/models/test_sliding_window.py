"""Sliding-window layers keep only their window plus a speculative draft (``WindowKVCache``).

Against the full KV cache (what every layer kept before) the logits are bit-identical for
contexts far longer than the window: prefill in one chunk, in chunks of 7 and token by token,
decoding with and without n-gram speculation (drafts rejected and rolled back), and prefix
reuse that reaches back past what is kept (the state says so and the prompt is prefilled
again). Against transformers within fp32 rounding. The planner counts the smaller caches
byte for byte, and for GPT-OSS's released shape they are about half of the full ones.
"""

from __future__ import annotations

import pytest
import torch

import sluice
from conftest import prompt_ids
from sluice import kernels
from sluice.layers import attention
from sluice.layers.attention import MAX_DRAFT, Attention, KVCache, WindowKVCache
from sluice.models import gpt_oss
from sluice.speculative import NgramDrafter

# sliding window 4 (layers 0 and 2), 8 (every layer) and 5 (layers 1 and 2, value heads narrower than the keys)
FAMILIES = ["gpt_oss", "mixtral", "mimo_v2_flash"]


def _prompt() -> list[int]:
    """41 tokens (longer than every buffer: 30 and 38 positions) that repeat a 12-token phrase,
    so the n-gram drafter proposes drafts, most of which a random model rejects."""
    phrase = prompt_ids(12, seed=3).tolist()
    return phrase * 3 + phrase[:5]


@pytest.fixture(scope="module")
def full_cache():
    """Load engines whose attention layers keep the whole context, as before ``WindowKVCache``."""

    def load(path, **opts):
        mp = pytest.MonkeyPatch()
        mp.setattr(Attention, "new_cache",
                   lambda self, max_ctx: KVCache(self.n_kv, max_ctx, self.head_dim, self.v_head_dim))
        try:
            return sluice.load(path, memory="4GiB", progress=False, **opts)
        finally:
            mp.undo()

    return load


@pytest.fixture(scope="module")
def full_runs(family_models, full_cache):
    """``full_runs(family)``: the full cache's logits on ``_prompt()`` and its generations (with
    and without speculation) in one prefill chunk, run once; the kernels are batch-invariant,
    so every prefill chunk gives these bits (the fidelity matrix's stepwise axis)."""
    runs = {}

    def run(family):
        if family not in runs:
            ids = _prompt()
            full = full_cache(family_models.hf(family))
            assert not _windowed(full)
            runs[family] = dict(logits=full.forward(torch.tensor(ids)), gen={
                speculate: full.generate(ids, max_new_tokens=40, ignore_eos=True, speculate=speculate, logprobs=0)
                for speculate in (True, False)}, length=full.state.length)
        return runs[family]

    return run


def _load(path, **opts):
    return sluice.load(path, memory="4GiB", progress=False, **opts)


def _windowed(eng) -> list[WindowKVCache]:
    return [s for s in eng.state.layers if isinstance(s, WindowKVCache)]


@pytest.mark.skipif(not kernels.batch_invariant(), reason="C kernels not built")
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("chunk", [512, 7, 1])
def test_bit_identical_to_full_cache(family_models, full_runs, family, chunk):
    path = family_models.hf(family)
    ids = _prompt()
    win, full = _load(path, prefill_chunk=chunk), full_runs(family)
    assert _windowed(win)
    assert torch.equal(win.forward(torch.tensor(ids)), full["logits"])
    for speculate in (True, False):
        a = win.generate(ids, max_new_tokens=40, ignore_eos=True, speculate=speculate, logprobs=0)
        b = full["gen"][speculate]
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs  # every generated row bitwise
        if speculate:
            assert a.stats["drafted"] > a.stats["accepted"]  # drafts rejected and rolled back
    # the buffers stayed small while the context grew past them
    assert all(c.cap == WindowKVCache.positions(c.window) < len(ids) + 40 for c in _windowed(win))
    assert win.state.length == full["length"] > min(c.base for c in _windowed(win)) > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_against_transformers_past_the_window(family_models, family):
    path = family_models.hf(family)
    ids = torch.tensor(_prompt() * 2)  # 82 positions: the buffers moved and the long chunk was joined
    with torch.no_grad():
        ref = family_models.transformers(family)(ids[None]).logits[0]
    logits = _load(path).forward(ids)
    diff = (logits - ref).abs().max().item()
    assert diff <= 1e-4 * max(1.0, ref.abs().max().item())
    assert torch.equal(_load(path, prefill_chunk=1).forward(ids), logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_reuse_prefills_again_past_the_window(family_models, full_cache, family):
    """A rewind inside the kept positions resumes; one that reaches further back is refused by
    the cache (the largest restorable length is 0) and the prompt is prefilled again."""
    path = family_models.hf(family)
    p1 = _prompt()
    win, full = _load(path), full_cache(path)
    gen = dict(max_new_tokens=12, ignore_eos=True, reuse_prefix=True, logprobs=0)
    g1 = win.generate(p1, **gen)
    assert g1.token_ids == full.generate(p1, **gen).token_ids
    assert win.state.tokens[: win.state.length] == p1 + g1.token_ids[:-1]  # the last token is not forwarded
    cases = [lambda held: (held + [5, 6], len(held)),  # continued conversation: everything reused
             lambda held: (held[:-3] + [7, 8], len(held) - 3),  # back 3 positions: still held
             lambda held: (p1[:10] + [9] + p1[11:], 0)]  # diverges 40+ positions back: the window is gone
    for case in cases:
        prompt, reused = case(win.state.tokens[: win.state.length])
        a, b = win.generate(prompt, **gen), full.generate(prompt, **gen)
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
        assert a.stats["reused_prefix_tokens"] == reused
        assert b.stats["reused_prefix_tokens"] > 0  # the full cache could reuse, the window cannot


def test_state_rewind_reports_what_it_can_restore(family_models):
    eng = _load(family_models.hf("gpt_oss"), prefill_chunk=1)
    ids = _prompt()
    eng.forward(torch.tensor(ids))
    n = len(ids)
    caches = _windowed(eng)
    keep = caches[0].keep
    assert keep == 4 - 1 + MAX_DRAFT
    assert all(c.restorable(n - MAX_DRAFT - 1) == n - MAX_DRAFT - 1 for c in caches)  # a rejected draft
    far = min(c.base for c in caches) + 4 - 2  # its window starts before the first kept position
    assert all(c.restorable(far) == 0 for c in caches)
    assert eng.state.rewind(n - 5) == n - 5
    assert eng.state.rewind(far) == 0 and eng.state.length == 0 and all(c.base == 0 for c in caches)


def test_drafts_fit_the_kept_positions():
    assert NgramDrafter([]).max_draft <= MAX_DRAFT


@pytest.mark.skipif(not kernels.batch_invariant(), reason="C kernels not built")
def test_cache_schedule_against_full_cache():
    """The cache alone: chunks of every size (1 to longer than the buffer), rewinds within and
    past what is kept, attention over each step's keys bitwise equal to the full cache's."""
    g = torch.Generator().manual_seed(0)
    hkv, hq, d, window, max_ctx = 2, 4, 8, 5, 400
    win, full = WindowKVCache(hkv, max_ctx, d, window), KVCache(hkv, max_ctx, d)
    sinks = torch.randn(hq, generator=g)
    length, steps = 0, 0
    sizes = [1, 1, 3, 40, 1, 7, 1, 1, 13, 2, 70, 1, 1, 1, 5]
    while steps < 120:
        t = sizes[steps % len(sizes)]
        if length + t > max_ctx:
            break
        k, v, q = (torch.randn(t, hkv, d, generator=g), torch.randn(t, hkv, d, generator=g),
                   torch.randn(t, hq, d, generator=g))
        keys, values, q0 = win.update(length, k, v)
        fk, fv, fq0 = full.update(length, k, v)
        assert keys.shape[1] <= window - 1 + t
        expect = kernels.attend(q, fk, fv, fq0, 0.3, window, sinks)
        assert torch.equal(kernels.attend(q, keys, values, q0, 0.3, window, sinks), expect)
        prev = kernels.set_batch_invariant(False)  # the torch path (benchmarks): same keys, fp32 rounding
        try:
            torch.testing.assert_close(attention.attend(q, keys, values, q0, 0.3, window, sinks), expect)
        finally:
            kernels.set_batch_invariant(prev)
        length += t
        steps += 1
        if steps % 4 == 0:  # roll back a draft's worth (always restorable), or a random way
            back = min(length, MAX_DRAFT if steps % 8 else int(torch.randint(0, 40, (1,), generator=g)))
            n = win.restorable(length - back)
            assert n in (length - back, 0)
            assert n == length - back or length - back - window + 1 < win.base
            win.rewind(n)
            length = n
    assert win.cap == 2 * (window - 1 + MAX_DRAFT) and full.k.shape[1] == max_ctx
    assert win.base > 0  # the schedule moved the buffer


def test_planner_counts_the_buffers(family_models):
    for family in FAMILIES:
        for max_context in (20, 512):  # shorter than a buffer (it shrinks), and longer
            eng = _load(family_models.hf(family), max_context=max_context)
            held = sum(c.k.nbytes + c.v.nbytes for c in eng.state.layers)
            assert eng.plan.seq_state_bytes == eng.info.desc.state_bytes(max_context) == held
            assert eng.plan.state_bytes == eng.plan.parallel * held
    from sluice.model_report import inspect_model, render_inspect

    r = inspect_model(family_models.hf("gpt_oss"))
    assert "each sliding-window layer keeps at most 30 positions" in render_inspect(r)


def test_released_gpt_oss_keeps_about_half():
    """GPT-OSS-20B's shape: 12 of 24 layers slide over 128 positions."""
    raw = {"model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880,
           "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
           "num_local_experts": 32, "num_experts_per_tok": 4, "sliding_window": 128,
           "max_position_embeddings": 131072, "layer_types": ["sliding_attention", "full_attention"] * 12}
    desc = gpt_oss.describe(gpt_oss.parse_config(raw))
    per_layer_token = 4 * 8 * 2 * 64
    for ctx, lo, hi in ((4096, 0.53, 0.54), (131072, 0.500, 0.502)):
        full = 24 * per_layer_token * ctx
        assert lo <= desc.state_bytes(ctx) / full <= hi
    assert desc.state_bytes(4096) == 12 * per_layer_token * (4096 + 2 * (127 + MAX_DRAFT))


def test_rollback_past_the_kept_positions_recomputes(family_models, full_cache):
    """Caches that keep no room for a draft: a rejected draft's rollback reaches past what is
    kept, the state falls back to 0 and the generator prefills the accepted tokens again."""
    path = family_models.hf("gpt_oss")
    ids = _prompt()
    mp = pytest.MonkeyPatch()
    mp.setattr(Attention, "new_cache", lambda self, max_ctx: WindowKVCache(self.n_kv, max_ctx, self.head_dim,
                                                                           self.window, rollback=0)
               if self.window else KVCache(self.n_kv, max_ctx, self.head_dim))
    try:
        tight = _load(path, prefill_chunk=1)
    finally:
        mp.undo()
    calls = []
    rewind = type(tight.state).rewind
    mp.setattr(type(tight.state), "rewind", lambda self, n: calls.append((n, rewind(self, n))) or calls[-1][1])
    try:
        a = tight.generate(ids, max_new_tokens=30, ignore_eos=True, logprobs=0)
    finally:
        mp.undo()
    b = full_cache(path).generate(ids, max_new_tokens=30, ignore_eos=True, logprobs=0)
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    assert any(n > 0 and got == 0 for n, got in calls[1:])  # a rollback the cache could not make
