"""Kimi Linear (KDA + NoPE MLA, grouped sigmoid routing) against transformers, plus the
recurrent-state behaviour: chunked vs stepwise, prefix reuse, rewind to a mark."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import sluice
from conftest import (LOGIT_MARGIN, ROUTER_MARGIN, check_chunked_vs_stepwise, check_exact, check_prefix_reuse,
                      expected_outputs, prompt_ids, reference, tiny_config)
from sluice.convert import convert
from sluice.errors import UnsupportedModelError
from sluice.model_report import inspect_model, render_inspect
from sluice.layers.gated_delta import SNAPSHOTS
from sluice.models import kimi_linear

N_NEW = 32
# KDA, MLA, KDA (transformers needs a full-attention layer); layer 0 dense (first_k_dense_replace
# defaults to 1); 2 expert groups, 1 kept; no GQA in MLA
CONFIG = dict(layer_types=["linear_attention", "full_attention", "linear_attention"], linear_num_heads=4,
              linear_head_dim=16, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
              n_group=2, topk_group=1, num_key_value_heads=4, routed_scaling_factor=2.446)
TOTAL_EXPERTS = 16  # 8 experts x 2 MoE layers
SEED = 0


def save_kimi(path, dtype=torch.float32, seed=SEED):
    """A tiny checkpoint with a non-zero ``e_score_correction_bias`` (it selects, never weighs)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config("kimi_linear", **CONFIG)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.e_score_correction_bias.copy_(torch.randn(gate.e_score_correction_bias.shape) * 0.3)
    model.to(dtype).save_pretrained(path)
    return path


def to_original_layout(src, dst):
    """The same weights in the layout of the released checkpoints: ``linear_attn_config``,
    ``first_k_dense_replace``, dense MLP tensors under ``mlp.`` instead of ``block_sparse_moe.``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    types = cfg.pop("layer_types")
    cfg.pop("mlp_layer_types")
    cfg["linear_attn_config"] = {
        "full_attn_layers": [i + 1 for i, t in enumerate(types) if t == "full_attention"],
        "kda_layers": [i + 1 for i, t in enumerate(types) if t == "linear_attention"],
        "head_dim": cfg.pop("linear_head_dim"), "num_heads": cfg.pop("linear_num_heads"),
        "short_conv_kernel_size": cfg.pop("linear_conv_kernel_dim"),
    }
    cfg.update(first_k_dense_replace=1, moe_layer_freq=1, moe_router_activation_func="sigmoid", mla_use_nope=True,
               use_grouped_topk=True)
    (dst / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(dst / "model.safetensors")
    renamed = {k.replace("layers.0.block_sparse_moe.", "layers.0.mlp."): v for k, v in tensors.items()}
    assert renamed.keys() != tensors.keys()
    save_file(renamed, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("kimi_linear")
    f32 = save_kimi(root / "f32")
    return {
        "f32": f32,
        "bf16": save_kimi(root / "bf16", dtype=torch.bfloat16),
        "container": convert(f32, root / "f32.sluice", progress=False),
        "original": to_original_layout(f32, root / "original"),
    }


@pytest.fixture(scope="module")
def ref(models):
    return reference(models["f32"])


def assert_decisive_grouped(ref, ids, first):
    """Clear top-1 logits from ``first`` on; at every position clear group choices and clear
    expert choices among the eligible groups, on the biased sigmoid scores transformers selects by."""
    cfg = ref.config
    with torch.no_grad():
        out = ref(ids[None], output_router_logits=True)
    top = out.logits[0, first:].topk(2, dim=-1).values
    margin = (top[:, 0] - top[:, 1]).min().item()
    assert margin > LOGIT_MARGIN, f"top-1/top-2 logit margin {margin:.2e} is a near-tie: pick another seed"
    gates = [layer.mlp.gate for layer in ref.model.layers if hasattr(layer.mlp, "gate")]
    assert len(gates) == len(out.router_logits)
    g, tg, k = cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok
    for layer, (rl, gate) in enumerate(zip(out.router_logits, gates)):
        s = torch.sigmoid(rl.float().reshape(-1, rl.shape[-1])) + gate.e_score_correction_bias.float()
        t, e = s.shape
        gs = s.view(t, g, e // g).topk(2, dim=-1).values.sum(-1)
        top_g = gs.topk(min(tg + 1, g), dim=-1)
        if tg < g:
            gm = (top_g.values[:, tg - 1] - top_g.values[:, tg]).min().item()
            assert gm > ROUTER_MARGIN, f"group margin {gm:.2e} in MoE layer {layer}: pick another seed"
        keep = torch.zeros(t, g, dtype=torch.bool).scatter_(1, top_g.indices[:, :tg], True)
        eligible = s.masked_fill(~keep[:, :, None].expand(t, g, e // g).reshape(t, e), float("-inf"))
        v = eligible.topk(k + 1, dim=-1).values
        em = (v[:, k - 1] - v[:, k]).min().item()
        assert em > ROUTER_MARGIN, f"expert margin {em:.2e} in MoE layer {layer}: pick another seed"


def _expected(ref, ids, n_new):
    return expected_outputs(ref, ids, n_new, decisive=assert_decisive_grouped)


def _load(path, **opts):
    opts.setdefault("progress", False)
    return sluice.load(path, memory="2GiB", **opts)


@pytest.fixture(scope="module")
def expected(ref):
    return _expected(ref, prompt_ids(), N_NEW)


@pytest.mark.parametrize("source", ["f32", "container", "original"])
def test_fp32_exact_with_evictions(models, expected, source):
    eng = _load(models[source], cache_experts=4)
    assert eng.plan.cache_slots < TOTAL_EXPERTS / 3
    _, result = check_exact(expected, eng, prompt_ids(), N_NEW)
    s = result.stats
    assert s["evictions"] > 0 and s["expert_misses"] > 0
    assert s["lookahead_predictions"] > 0  # router lookahead ran on the hybrid stack
    assert eng.info.is_container == (source == "container")


def test_container_and_original_layout_bit_identical_to_hf(models):
    ids = prompt_ids(seed=3)
    outs = []
    for src in ("f32", "container", "original"):
        eng = _load(models[src], cache_experts=4)
        outs.append((eng.forward(ids), eng.generate(ids.tolist(), max_new_tokens=12, ignore_eos=True).token_ids))
    for logits, tokens in outs[1:]:
        assert torch.equal(outs[0][0], logits) and outs[0][1] == tokens


def test_bf16_against_upcast_reference(models):
    path = models["bf16"]
    ids = prompt_ids()
    exp = _expected(reference(path), ids, N_NEW)
    check_exact(exp, _load(path), ids, N_NEW, tol=1e-4 * max(1.0, exp[0].abs().max().item()))


def test_prompt_longer_than_a_prefill_chunk(models, ref):
    """150 tokens in prefill chunks of 64 (fp32 rounding grows with length: the bound scales
    with the logits, as for bf16)."""
    ids = prompt_ids(150, seed=7)
    exp = _expected(ref, ids, 8)
    eng = _load(models["f32"], prefill_chunk=64)
    check_exact(exp, eng, ids, 8, tol=1e-4 * max(1.0, exp[0].abs().max().item()))


def test_chunked_vs_stepwise(models):
    """One prefill chunk, chunks of 7, token by token: logits agree within fp32 rounding, tokens identical."""
    check_chunked_vs_stepwise(_load, models["f32"], prompt_ids(40, seed=11), dict(ignore_eos=True))


def test_prefix_reuse_matches_fresh_runs(models):
    eng = _load(models["f32"], cache_experts=6)
    fresh = _load(models["f32"], cache_experts=6)
    check_prefix_reuse(eng, fresh, prompt_ids(20, seed=21).tolist(), dict(max_new_tokens=10, ignore_eos=True))


def test_rewind_to_mark_gives_identical_logits(models):
    eng = _load(models["f32"])
    ids = prompt_ids(24, seed=31).tolist()
    cont = prompt_ids(6, seed=32).tolist()
    with torch.inference_mode():
        eng.state.rewind(0)
        eng._run(ids, 0, last_n=0)
        eng.state.mark()
        first = eng._run(cont, len(ids), last_n=len(cont))
        assert eng.state.rewind(len(ids)) == len(ids)
        eng._run(prompt_ids(9, seed=33).tolist(), len(ids), last_n=1)
        assert eng.state.rewind(len(ids) + 3) == len(ids)
        again = eng._run(cont, len(ids), last_n=len(cont))
        eng.state.rewind(len(ids))
        steps = torch.cat([eng._run([t], len(ids) + i, last_n=1) for i, t in enumerate(cont)])
    assert torch.equal(first, again)
    assert (steps - first).abs().max().item() < 2e-5


def test_description_and_inspect(models):
    eng = _load(models["f32"])
    cfg = kimi_linear.parse_config(eng.raw_config)
    desc = eng.desc
    assert cfg.layer_types == CONFIG["layer_types"] and cfg.mlp_layer_types == ["dense", "sparse", "sparse"]
    assert desc.moe_layers == [1, 2] and desc.max_position_embeddings == 512
    assert desc.state_bytes_per_token == 4 * (32 + 8)  # one MLA layer: latent + rope key
    one = 4 * (3 * 64 * 3 + 4 * 16 * 16)  # conv window (K-1 = 3) over q/k/v + recurrent state
    decay = 3 * 4 * 4 * 64 * 64 * 16
    assert desc.state_bytes_fixed == one * 2 * (1 + SNAPSHOTS) + 4 * one + decay
    assert kimi_linear.parse_config(json.loads((models["original"] / "config.json").read_text())).layer_types == \
        cfg.layer_types
    report = inspect_model(models["f32"], memory=1 << 30)
    assert report["model_type"] == "kimi_linear" and report["moe_layers"] == 2
    assert report["kv_state_bytes"] == desc.state_bytes_per_token * report["max_context"] + desc.state_bytes_fixed
    assert "Kimi Delta Attention" in render_inspect(report)


BASE = dict(model_type="kimi_linear", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
            num_attention_heads=2, num_experts=8, num_experts_per_token=2)


@pytest.mark.parametrize("edit,message", [
    (dict(moe_router_activation_func="softmax"), "moe_router_activation_func='softmax'"),
    (dict(mla_use_nope=False), "mla_use_nope=False"),
    (dict(moe_layer_freq=2), "moe_layer_freq=2"),
    (dict(mla_use_output_gate=True), "mla_use_output_gate"),
    (dict(linear_attn_config={"gate_lower_bound": -5.0}), "gate_lower_bound"),
    (dict(linear_attn_config={"use_full_rank_gate": True}), "use_full_rank_gate"),
    (dict(num_key_value_heads=1), "num_key_value_heads=1"),
    (dict(num_expert_group=3), "8 experts cannot be routed in 3 groups"),
    (dict(num_expert_group=4, topk_group=2, use_grouped_topk=False), "use_grouped_topk=false"),
    (dict(num_shared_experts=0), "num_shared_experts=0"),
    (dict(first_k_dense_replace=4), "no MoE layer"),
    (dict(layer_types=["linear_attention", "mamba", "full_attention", "linear_attention"]), "'mamba'"),
    (dict(hidden_act="mish"), "'mish'"),
    (dict(quantization_config={"quant_method": "compressed-tensors"}), "quantization_config.format=None"),
    (dict(quantization_config={"quant_method": "gptq"}), "quant_method='gptq'"),
])
def test_refused_options(edit, message):
    with pytest.raises(UnsupportedModelError, match=message):
        kimi_linear.parse_config({**BASE, **edit})
