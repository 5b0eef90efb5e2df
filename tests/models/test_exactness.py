"""Sluice vs transformers: logits at every position and greedy tokens, for every family."""

from __future__ import annotations

import pytest
import torch

import sluice
from conftest import FAMILIES, assert_decisive, prompt_ids, reference

N_NEW = 32


def _compare(path, cache_experts=None, tol_scale=False):
    ref = reference(path)
    ids = prompt_ids()
    eng = sluice.load(path, memory="4GiB", cache_experts=cache_experts, progress=False)
    with torch.no_grad():
        ref_logits = ref(ids[None]).logits[0]
    logits = eng.forward(ids)
    tol = 1e-4 * max(1.0, ref_logits.abs().max().item()) if tol_scale else 1e-4
    diff = (logits - ref_logits).abs().max().item()
    assert diff <= tol, f"max |logit diff| {diff:.3e} > {tol:.1e}"

    # a repetitive prompt, so that n-gram speculation drafts (and sometimes rolls back)
    rep = torch.cat([ids[:8], ids[:8]])
    with torch.no_grad():
        ref_out = ref.generate(rep[None], max_new_tokens=N_NEW, do_sample=False)[0]
    assert_decisive(ref, ref_out, len(rep) - 1, eng.desc.top_k)
    expected = ref_out[len(rep):].tolist()
    plain = eng.generate(rep.tolist(), max_new_tokens=N_NEW, speculate=False)
    assert plain.token_ids == expected
    assert plain.finish_reason == "length" and plain.stats["drafted"] == 0
    result = eng.generate(rep.tolist(), max_new_tokens=N_NEW)  # speculation is on by default for greedy
    assert result.token_ids == expected
    assert result.stats["drafted"] > 0
    return eng, result


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_exact(model_dir, family):
    _compare(model_dir(family))


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_exact_small_cache(model_dir, family):
    path = model_dir(family)
    total = 8 * (3 if family != "qwen3_moe" else 2)
    eng, result = _compare(path, cache_experts=total // 3 - 1)
    assert eng.plan.cache_slots < total / 3
    assert result.stats["evictions"] > 0
    assert result.stats["expert_misses"] > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_against_upcast_reference(model_dir, family):
    _compare(model_dir(family, dtype="bfloat16"), tol_scale=True)


def test_cache_size_is_bit_identical(model_dir):
    """Logits and tokens do not depend on how much of the model is cached."""
    path = model_dir("qwen3_moe")
    ids = prompt_ids()
    outs = []
    for cache in (2, 16):
        eng = sluice.load(path, memory="4GiB", cache_experts=cache, progress=False)
        outs.append((eng.forward(ids), eng.generate(ids.tolist(), max_new_tokens=8)))
    assert torch.equal(outs[0][0], outs[1][0])
    assert outs[0][1].token_ids == outs[1][1].token_ids
