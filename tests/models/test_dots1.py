"""dots.llm1: the checkpoint tensor names Sluice relies on (the released per-expert layout),
config.json shapes against transformers (the released shape with a top-level ``rope_theta``
and no ``layer_types``; biases, tied embeddings, no dense layer, one group, no renormalisation,
explicit ``layer_types``, a ``head_dim`` other than hidden / heads), and the config fields it reads.

(Exactness on every axis runs in the fidelity matrix through the registry entry.)"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import sluice
from conftest import prompt_ids
from families import assert_decisive_model, reference, save_family
from sluice.errors import UnsupportedModelError
from sluice.models import get_family

d1 = get_family("dots1")
N_NEW = 32

# The released dots.llm1.base / dots.llm1.inst config.json (the keys its architecture reads:
# 62 layers, MHA with 32 heads of 128, 128 routed experts top-6 plus 2 shared, layer 0 dense,
# sigmoid routing in one group, renormalised and scaled by 2.5, RoPE theta 1e7, 32K context).
DOTS1_CONFIG = dict(
    architectures=["Dots1ForCausalLM"], model_type="dots1", vocab_size=152064, hidden_size=4096,
    intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=62, num_attention_heads=32,
    num_key_value_heads=32, hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-5,
    rope_theta=10000000, rope_scaling=None, first_k_dense_replace=1, n_routed_experts=128, n_shared_experts=2,
    num_experts_per_tok=6, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
    scoring_func="sigmoid", attention_bias=False, tie_word_embeddings=False, sliding_window=None,
    max_window_layers=62, use_sliding_window=False, eos_token_id=151649,
)


def test_checkpoint_tensor_names():
    """The names of a dense and an MoE layer as dots.llm1's model.safetensors.index.json lays
    them out (transformers' conversion mapping reads dots1 as qwen2_moe: per-expert
    ``mlp.experts.<e>.gate_proj/up_proj/down_proj`` merged at load, written back per expert on
    save), the gate with its ``e_score_correction_bias``, the fused shared experts
    (``mlp.shared_experts``, 2 x 1408 wide) and the per-head ``q_norm`` / ``k_norm``."""
    desc = d1.describe(d1.parse_config(DOTS1_CONFIG))
    p0, p = "model.layers.0.", "model.layers.7."

    def attn(q):
        return {q + "input_layernorm.weight": (4096,), q + "post_attention_layernorm.weight": (4096,),
                q + "self_attn.q_proj.weight": (4096, 4096), q + "self_attn.k_proj.weight": (4096, 4096),
                q + "self_attn.v_proj.weight": (4096, 4096), q + "self_attn.o_proj.weight": (4096, 4096),
                q + "self_attn.q_norm.weight": (128,), q + "self_attn.k_norm.weight": (128,)}  # per head

    assert {k: v for k, v in desc.spine.items() if k.startswith(p0)} == {
        **attn(p0), p0 + "mlp.gate_proj.weight": (10944, 4096), p0 + "mlp.up_proj.weight": (10944, 4096),
        p0 + "mlp.down_proj.weight": (4096, 10944)}
    assert {k: v for k, v in desc.spine.items() if k.startswith(p)} == {
        **attn(p), p + "mlp.gate.weight": (128, 4096), p + "mlp.gate.e_score_correction_bias": (128,),
        p + "mlp.shared_experts.gate_proj.weight": (2816, 4096),
        p + "mlp.shared_experts.up_proj.weight": (2816, 4096),
        p + "mlp.shared_experts.down_proj.weight": (4096, 2816)}
    assert {k: v for k, v in desc.spine.items() if not k.startswith("model.layers.")} == {
        "model.embed_tokens.weight": (152064, 4096), "model.norm.weight": (4096,),
        "lm_head.weight": (152064, 4096)}
    refs = {role: (r.name, tuple(r.shape)) for role, r in desc.expert_tensors(7, 127).items()}
    e = p + "mlp.experts.127."
    assert refs == {"gate": (e + "gate_proj.weight", (1408, 4096)),
                    "up": (e + "up_proj.weight", (1408, 4096)),
                    "down": (e + "down_proj.weight", (4096, 1408))}
    assert desc.moe_layers == list(range(1, 62)) and desc.top_k == 6 and desc.n_experts == 128
    assert desc.window_bytes_per_token == 0  # no sliding layer on the released models


def test_names_match_what_transformers_saves(family_models):
    """Every tensor transformers writes for the tiny model is a declared spine tensor or an expert tensor."""
    from safetensors import safe_open

    path = family_models.hf("dots1", "f32")
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    assert {"model.layers.1.mlp.experts.15.down_proj.weight",
            "model.layers.2.mlp.gate.e_score_correction_bias",
            "model.layers.1.mlp.shared_experts.up_proj.weight",
            "model.layers.0.mlp.gate_proj.weight"} <= saved
    desc = d1.describe(d1.parse_config(json.loads((path / "config.json").read_text())))
    experts = {r.name for layer in desc.moe_layers for e in range(desc.n_experts)
               for r in desc.expert_tensors(layer, e).values()}
    assert saved == set(desc.spine) | experts


def _against_transformers(path):
    ref = reference(path)
    ids = prompt_ids()
    with torch.no_grad():
        ref_logits = ref(ids[None]).logits[0]
        ref_out = ref.generate(ids[None], max_new_tokens=N_NEW, do_sample=False)[0]
    assert_decisive_model(ref, ref_out, 0)
    with sluice.load(path, memory="4GiB", progress=False) as eng:
        diff = (eng.forward(ids) - ref_logits).abs().max().item()
        out = eng.generate(ids.tolist(), max_new_tokens=N_NEW, ignore_eos=True, speculate=False)
    assert diff <= 1e-4, diff
    assert out.token_ids == ref_out[len(ids):].tolist()


def test_released_config_shape_against_transformers(family_models, tmp_path):
    """The released config.json shape: a top-level ``rope_theta``, no ``rope_parameters``, no
    ``layer_types`` (transformers derives them from ``sliding_window`` / ``max_window_layers``:
    here layer 1 on is sliding, window 4)."""
    src = family_models.hf("dots1", "f32")
    dst = tmp_path / "released"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    theta = cfg.pop("rope_parameters")["rope_theta"]
    del cfg["layer_types"]
    cfg.update(rope_theta=theta, rope_scaling=None, sliding_window=4, max_window_layers=1,
               scoring_func="sigmoid", use_sliding_window=False)
    (dst / "config.json").write_text(json.dumps(cfg))
    parsed = d1.parse_config(cfg)
    assert parsed.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    assert reference(dst).config.layer_types == parsed.layer_types
    _against_transformers(dst)


# config-shape variants of the registry entry: overrides and a seed whose model is decisive
VARIANTS = {
    # q/k/v/o biases, tied embeddings, every layer MoE, no renormalisation, one group
    "biases_tied_no_dense": (dict(attention_bias=True, tie_word_embeddings=True, first_k_dense_replace=0,
                                  norm_topk_prob=False, n_group=1, topk_group=1,
                                  routed_scaling_factor=1.0), 0),
    # explicit layer_types (sliding, full, sliding; window 4); head_dim 8, not hidden / heads
    "layer_types_head_dim": (dict(layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                  sliding_window=4, head_dim=8), 0),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_config_variants_against_transformers(variant, tmp_path):
    over, seed = VARIANTS[variant]
    path = save_family(tmp_path / variant, "dots1", seed=seed, **over)
    if over.get("attention_bias"):  # transformers initializes biases to zero: make them count
        from safetensors.torch import load_file, save_file

        tensors = load_file(path / "model.safetensors")
        gen = torch.Generator().manual_seed(seed)
        biases = [k for k in tensors if k.endswith("_proj.bias")]
        assert len(biases) == 12  # q, k, v, o in each of the 3 layers
        for k in biases:
            tensors[k] = 0.3 * torch.randn(tensors[k].shape, generator=gen)
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    _against_transformers(path)


def test_config_fields():
    cfg = d1.parse_config(DOTS1_CONFIG)
    assert (cfg.head_dim, cfg.rope["rope_theta"], cfg.n_shared_experts) == (128, 1e7, 2)
    assert cfg.routed_scaling_factor == 2.5
    assert cfg.layer_types == ["full_attention"] * 62 and cfg.sliding_window is None
    assert (cfg.n_group, cfg.topk_group, cfg.norm_topk_prob, cfg.moe_layers[0]) == (1, 1, True, 1)
    # null groups (as some converted configs have; transformers would fail on them) are one group
    assert d1.parse_config(dict(DOTS1_CONFIG, n_group=None, topk_group=None)).n_group == 1
    # sliding_window absent is transformers' 4096, from max_window_layers on
    absent = {k: v for k, v in DOTS1_CONFIG.items() if k != "sliding_window"}
    assert d1.parse_config(absent).layer_types == ["full_attention"] * 62
    late = d1.parse_config(dict(absent, max_window_layers=60))
    assert late.sliding_window == 4096
    assert late.layer_types[59:] == ["full_attention"] + ["sliding_attention"] * 2
    assert d1.parse_config(dict(DOTS1_CONFIG, first_k_dense_replace=62)).moe_layers == []
    with pytest.raises(UnsupportedModelError, match="quantization_config"):
        d1.parse_config(dict(DOTS1_CONFIG, quantization_config={"quant_method": "compressed-tensors"}))
