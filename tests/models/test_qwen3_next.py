"""Qwen3-Next (Gated DeltaNet + gated full attention) against transformers, plus what the
recurrent layer state adds: chunked vs stepwise agreement, prefix reuse, rewind to a mark."""

from __future__ import annotations

import pytest
import torch

import sluice
from conftest import (check_chunked_vs_stepwise, check_exact, check_prefix_reuse, expected_outputs, prompt_ids,
                      reference, save_tiny)
from sluice.convert import convert
from sluice.errors import UnsupportedModelError
from sluice.model_report import inspect_model, render_inspect
from sluice.layers.gated_delta import SNAPSHOTS, LinearState
from sluice.models import qwen3_next

N_NEW = 32
# linear, full, linear attention; GQA in both kinds; layer 2 dense; partial rotary (default 0.25)
CONFIG = dict(layer_types=["linear_attention", "full_attention", "linear_attention"], linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
              shared_expert_intermediate_size=48, mlp_only_layers=[2])
TOTAL_EXPERTS = 16  # 8 experts x 2 MoE layers
SEED = 2  # decisive logits and router choices at every compared position (assert_decisive)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_next")
    f32 = save_tiny(root / "f32", "qwen3_next", seed=SEED, **CONFIG)
    return {
        "f32": f32,
        "bf16": save_tiny(root / "bf16", "qwen3_next", seed=SEED, dtype=torch.bfloat16, **CONFIG),
        "container": convert(f32, root / "f32.sluice", progress=False),
    }


@pytest.fixture(scope="module")
def ref(models):
    return reference(models["f32"])


def _load(path, **opts):
    opts.setdefault("progress", False)
    return sluice.load(path, memory="2GiB", **opts)


@pytest.fixture(scope="module")
def expected(ref):
    return expected_outputs(ref, prompt_ids(), N_NEW)


@pytest.mark.parametrize("source", ["f32", "container"])
def test_fp32_exact_with_evictions(models, expected, source):
    eng = _load(models[source], cache_experts=4)
    assert eng.plan.cache_slots < TOTAL_EXPERTS / 3
    _, result = check_exact(expected, eng, prompt_ids(), N_NEW)
    s = result.stats
    assert s["evictions"] > 0 and s["expert_misses"] > 0
    assert s["lookahead_predictions"] > 0  # router lookahead ran on the hybrid stack
    assert eng.info.is_container == (source == "container")


def test_container_bit_identical_to_hf(models):
    ids = prompt_ids(seed=3)
    outs = []
    for src in ("f32", "container"):
        eng = _load(models[src], cache_experts=4)
        outs.append((eng.forward(ids), eng.generate(ids.tolist(), max_new_tokens=12).token_ids))
    assert torch.equal(outs[0][0], outs[1][0]) and outs[0][1] == outs[1][1]


def test_bf16_against_upcast_reference(models):
    path = models["bf16"]
    ids = prompt_ids()
    exp = expected_outputs(reference(path), ids, N_NEW)
    check_exact(exp, _load(path), ids, N_NEW, tol=1e-4 * max(1.0, exp[0].abs().max().item()))


def test_prompt_longer_than_a_prefill_chunk(models, ref):
    """150 tokens in prefill chunks of 64: several delta-rule chunks, chunk boundaries in the
    conv window. Over 150 positions fp32 rounding grows: transformers' own fp32 logits are
    ~2.6e-4 from its fp64 ones here, so the bound scales with the logits (as for bf16)."""
    ids = prompt_ids(150, seed=7)
    exp = expected_outputs(ref, ids, 8)
    eng = _load(models["f32"], prefill_chunk=64)
    assert eng.plan.prefill_chunk == 64
    check_exact(exp, eng, ids, 8, tol=1e-4 * max(1.0, exp[0].abs().max().item()))


def test_chunked_vs_stepwise(models):
    """One prefill chunk, chunks of 7, token by token: logits agree within fp32 rounding, tokens identical."""
    check_chunked_vs_stepwise(_load, models["f32"], prompt_ids(40, seed=11), {})


def test_prefix_reuse_matches_fresh_runs(models):
    eng = _load(models["f32"], cache_experts=6)
    fresh = _load(models["f32"], cache_experts=6)
    check_prefix_reuse(eng, fresh, prompt_ids(20, seed=21).tolist(), dict(max_new_tokens=10))


def test_rewind_to_mark_gives_identical_logits(models):
    eng = _load(models["f32"])
    ids = prompt_ids(24, seed=31).tolist()
    cont = prompt_ids(6, seed=32).tolist()
    other = prompt_ids(9, seed=33).tolist()
    with torch.inference_mode():
        eng.state.rewind(0)
        eng._run(ids, 0, last_n=0)
        eng.state.mark()
        first = eng._run(cont, len(ids), last_n=len(cont))
        assert eng.state.rewind(len(ids)) == len(ids)
        eng._run(other, len(ids), last_n=1)  # a different continuation in between
        assert eng.state.rewind(len(ids) + 3) == len(ids)  # no snapshot there: back to the mark
        again = eng._run(cont, len(ids), last_n=len(cont))
        # a token-by-token replay from the mark agrees with the chunk to fp32 rounding
        eng.state.rewind(len(ids))
        steps = torch.cat([eng._run([t], len(ids) + i, last_n=1) for i, t in enumerate(cont)])
    assert torch.equal(first, again)
    assert (steps - first).abs().max().item() < 2e-5


def test_state_snapshots_are_references():
    s = LinearState()
    a = (torch.zeros(2, 3), torch.zeros(1, 2, 2))
    for pos in (5, 9, 12):
        s.advance(s.pos, *a, pos - s.pos)
        s.mark(pos)
        assert s.snaps[pos][1] is s.rec  # a reference, not a copy
    assert list(s.snaps) == [9, 12][-SNAPSHOTS:]  # only the most recent marks
    assert s.restorable(11) == 9 and s.restorable(8) == 0 and s.restorable(12) == 12
    s.rewind(9)
    assert s.pos == 9 and list(s.snaps) == [9]
    with pytest.raises(ValueError):
        s.rewind(4)


def test_description_and_inspect(models):
    cfg = qwen3_next.parse_config(_load(models["f32"]).raw_config)
    desc = qwen3_next.describe(cfg)
    assert cfg.rope["partial_rotary_factor"] == 0.25
    assert desc.moe_layers == [0, 1]
    assert desc.state_bytes_per_token == 4 * 2 * 2 * 16  # one full-attention layer: K and V, 2 heads x 16
    one = 4 * ((2 * 2 * 16 + 4 * 16) * 3 + 4 * 16 * 16)  # conv window (K-1 = 3) + recurrent state
    assert desc.state_bytes_fixed == one * 2 * (1 + SNAPSHOTS) + 4 * one
    report = inspect_model(models["f32"], memory=1 << 30)
    assert report["model_type"] == "qwen3_next" and report["moe_layers"] == 2
    assert report["kv_state_bytes"] == desc.state_bytes_per_token * report["max_context"] + desc.state_bytes_fixed
    assert "Gated DeltaNet" in render_inspect(report)


BASE = dict(model_type="qwen3_next", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16)


@pytest.mark.parametrize("edit,message", [
    (dict(layer_types=["linear_attention", "mamba", "linear_attention", "full_attention"]), "'mamba'"),
    (dict(layer_types=["full_attention"]), "must list 4 layer types"),
    (dict(num_experts=0), "num_experts=0"),
    (dict(linear_num_key_heads=3, linear_num_value_heads=4), "multiple of linear_num_key_heads"),
    (dict(shared_expert_intermediate_size=0), "shared_expert_intermediate_size=0"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), "'longrope'"),
    (dict(hidden_act="mish"), "'mish'"),
    (dict(full_attention_interval=0), "full_attention_interval=0"),
    (dict(quantization_config={"quant_method": "fp8"}), "weight_block_size=None"),
    (dict(quantization_config={"quant_method": "awq"}), "quant_method='awq'"),
    (dict(decoder_sparse_step=0), "decoder_sparse_step=0"),
    (dict(mlp_only_layers=[0, 1, 2, 3]), "no MoE layer"),
])
def test_refused_options(edit, message):
    with pytest.raises(UnsupportedModelError, match=message):
        qwen3_next.parse_config({**BASE, **edit})


def test_full_attention_interval_and_defaults():
    cfg = qwen3_next.parse_config({**BASE, "full_attention_interval": 2})
    assert cfg.layer_types == ["linear_attention", "full_attention"] * 2
    assert cfg.norm_topk_prob is True and cfg.rope["partial_rotary_factor"] == 0.25


@pytest.mark.parametrize("per_channel", [False, True])
def test_delta_rule_chunked_equals_recurrence(per_channel):
    """The chunked form is the recurrence rearranged: equal in fp64 for any chunk length,
    with strong decays (exp of large cumulative sums must not overflow) and a start state."""
    from sluice.layers.gated_delta import delta_rule_chunked, delta_rule_step, l2norm

    gen = torch.Generator().manual_seed(0)
    h, t, dk, dv = 3, 29, 8, 5
    q = l2norm(torch.randn(h, t, dk, generator=gen, dtype=torch.float64))
    k = l2norm(torch.randn(h, t, dk, generator=gen, dtype=torch.float64))
    v = torch.randn(h, t, dv, generator=gen, dtype=torch.float64)
    g = -torch.rand(*((h, t, dk) if per_channel else (h, t)), generator=gen, dtype=torch.float64) * 60
    beta = torch.rand(h, t, generator=gen, dtype=torch.float64)
    s0 = torch.randn(h, dk, dv, generator=gen, dtype=torch.float64)
    outs, s = [], s0
    for i in range(t):
        o, s = delta_rule_step(q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i], s)
        outs.append(o)
    want = torch.stack(outs, dim=1)
    for chunk in (1, 4, 16, 64):
        got, s_end = delta_rule_chunked(q, k, v, g, beta, s0, chunk=chunk)
        assert torch.isfinite(got).all()
        assert (got - want).abs().max().item() < 1e-10, chunk
        assert (s_end - s).abs().max().item() < 1e-10, chunk
