"""Hy3: the checkpoint tensor names Sluice relies on, the published config.json shape (the keys
of Tencent's own code that transformers ignores) against transformers, config-shape variants
(no shared width multiple, every layer MoE, tied head), block-FP8 linears kept in FP8 against
the dequantized twin, and the config fields it reads.

(Exactness on every axis runs in the fidelity matrix through the registry entry.)"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import sluice
from conftest import prompt_ids
from families import PROMPT, reference, save_family
from sluice.errors import UnsupportedModelError
from sluice.models import get_family
from sluice.quant.fp8 import BlockFP8

hy = get_family("hy_v3")
N_NEW = 32

# The published Hy3 / Hy3-preview config.json (the keys its architecture reads; the two are
# field-for-field the same). transformers reads the HYV3Config keys and ignores the others.
HY3_CONFIG = dict(
    architectures=["HYV3ForCausalLM"], model_type="hy_v3", vocab_size=120832, hidden_size=4096,
    intermediate_size=13312, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
    hidden_act="silu", max_position_embeddings=262144, rms_norm_eps=1e-5,
    rope_parameters={"rope_theta": 11158840.0, "rope_type": "default"}, num_experts=192, num_experts_per_tok=8,
    num_shared_experts=1, moe_intermediate_size=1536, expert_hidden_dim=1536, first_k_dense_replace=1,
    router_scaling_factor=2.826, moe_router_use_sigmoid=True, moe_router_enable_expert_bias=True, route_norm=True,
    qk_norm=True, num_nextn_predict_layers=1, enable_lm_head_fp32=True, enable_attention_fp32_softmax=False,
    enable_moe_fp32_combine=False, output_router_logits=True, tie_word_embeddings=False,
)
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
       "modules_to_not_convert": ["mlp.router.gate", "mlp.expert_bias", "lm_head"]}


def test_checkpoint_tensor_names():
    """The names as Hy3's model.safetensors.index.json lays them out (transformers' conversion
    mapping for hy_v3: qwen2_moe's per-expert ``experts.<e>.{gate,up,down}_proj`` merge plus
    ``mlp.router.gate.weight`` -> ``mlp.gate.weight``, ``mlp.expert_bias`` ->
    ``mlp.e_score_correction_bias``, ``mlp.shared_mlp.`` -> ``mlp.shared_experts.``): a dense
    layer 0, MoE layers 1..79, the MTP layer 80 not read."""
    desc = hy.describe(hy.parse_config(HY3_CONFIG))
    attn = {
        "self_attn.q_proj.weight": (8192, 4096), "self_attn.k_proj.weight": (1024, 4096),
        "self_attn.v_proj.weight": (1024, 4096), "self_attn.o_proj.weight": (4096, 8192),
        "self_attn.q_norm.weight": (128,), "self_attn.k_norm.weight": (128,),  # per head
        "input_layernorm.weight": (4096,), "post_attention_layernorm.weight": (4096,),
    }
    p = "model.layers.0."
    assert {k: v for k, v in desc.spine.items() if k.startswith(p)} == {p + k: v for k, v in {
        **attn, "mlp.gate_proj.weight": (13312, 4096), "mlp.up_proj.weight": (13312, 4096),
        "mlp.down_proj.weight": (4096, 13312)}.items()}
    p = "model.layers.79."
    assert {k: v for k, v in desc.spine.items() if k.startswith(p)} == {p + k: v for k, v in {
        **attn, "mlp.router.gate.weight": (192, 4096), "mlp.expert_bias": (192,),
        "mlp.shared_mlp.gate_proj.weight": (1536, 4096), "mlp.shared_mlp.up_proj.weight": (1536, 4096),
        "mlp.shared_mlp.down_proj.weight": (4096, 1536)}.items()}
    assert not any(k.startswith("model.layers.80.") for k in desc.spine)  # the MTP layer
    assert {k: v for k, v in desc.spine.items() if not k.startswith("model.layers.")} == {
        "model.embed_tokens.weight": (120832, 4096), "model.norm.weight": (4096,),
        "lm_head.weight": (120832, 4096)}
    refs = {role: (r.name, tuple(r.shape)) for role, r in desc.expert_tensors(79, 191).items()}
    e = "model.layers.79.mlp.experts.191."
    assert refs == {"gate": (e + "gate_proj.weight", (1536, 4096)), "up": (e + "up_proj.weight", (1536, 4096)),
                    "down": (e + "down_proj.weight", (4096, 1536))}
    assert desc.moe_layers == list(range(1, 80)) and desc.top_k == 8 and desc.n_experts == 192
    assert any("model.layers.80.*) are not used" in n for n in desc.notes)


def test_fp8_tensor_names():
    """Block-FP8 linears (``weight_scale_inv`` [ceil(N/128), ceil(K/128)]); the router and the
    bias named in ``modules_to_not_convert`` stay plain."""
    desc = hy.describe(hy.parse_config(dict(HY3_CONFIG, quantization_config=FP8)))
    p = "model.layers.5."
    assert desc.spine[p + "self_attn.q_proj.weight_scale_inv"] == (64, 32)
    assert desc.spine[p + "mlp.shared_mlp.down_proj.weight_scale_inv"] == (32, 12)
    assert p + "mlp.router.gate.weight_scale_inv" not in desc.spine
    refs = {role: (r.name, tuple(r.shape)) for role, r in desc.expert_tensors(5, 0).items()}
    e = p + "mlp.experts.0."
    assert refs["gate_scale_inv"] == (e + "gate_proj.weight_scale_inv", (12, 32))
    assert refs["down_scale_inv"] == (e + "down_proj.weight_scale_inv", (32, 12))


def test_names_match_what_transformers_saves(family_models):
    """Every tensor transformers writes for the tiny model is a declared spine tensor or an expert tensor."""
    from safetensors import safe_open

    path = family_models.hf("hy_v3", "f32")
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    assert {"model.layers.1.mlp.router.gate.weight", "model.layers.1.mlp.expert_bias",
            "model.layers.2.mlp.shared_mlp.up_proj.weight", "model.layers.2.mlp.experts.7.down_proj.weight"} <= saved
    desc = hy.describe(hy.parse_config(json.loads((path / "config.json").read_text())))
    experts = {r.name for layer in desc.moe_layers for e in range(desc.n_experts)
               for r in desc.expert_tensors(layer, e).values()}
    assert saved == set(desc.spine) | experts


def _exact(path) -> None:
    ref = reference(path)
    ids = prompt_ids()
    with torch.no_grad():
        ref_logits = ref(ids[None]).logits[0]
        ref_out = ref.generate(ids[None], max_new_tokens=N_NEW, do_sample=False)[0]
    with sluice.load(path, memory="4GiB", progress=False) as eng:
        assert (eng.forward(ids) - ref_logits).abs().max().item() <= 1e-4
        out = eng.generate(ids.tolist(), max_new_tokens=N_NEW, ignore_eos=True, speculate=False)
    assert out.token_ids == ref_out[len(ids):].tolist()


def test_published_config_shape_against_transformers(family_models, tmp_path):
    """The published config.json's own keys (ignored by transformers, agreeing with it), a
    top-level ``rope_theta`` and no ``mlp_layer_types`` (transformers: the first layer dense)."""
    src = family_models.hf("hy_v3", "f32")
    dst = tmp_path / "published"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    theta = cfg.pop("rope_parameters")["rope_theta"]
    del cfg["mlp_layer_types"]
    cfg.update({k: HY3_CONFIG[k] for k in ("first_k_dense_replace", "moe_router_use_sigmoid", "route_norm", "qk_norm",
                                           "moe_router_enable_expert_bias", "enable_lm_head_fp32",
                                           "enable_attention_fp32_softmax", "enable_moe_fp32_combine")},
               rope_theta=theta, expert_hidden_dim=cfg["moe_intermediate_size"])
    (dst / "config.json").write_text(json.dumps(cfg))
    assert hy.parse_config(cfg).mlp_layer_types == ["dense", "sparse", "sparse"]
    _exact(dst)


@pytest.mark.parametrize("variant", [
    dict(mlp_layer_types=["sparse", "dense", "sparse"], num_shared_experts=1, attention_bias=False),
    dict(mlp_layer_types=["sparse"] * 3, tie_word_embeddings=True, router_scaling_factor=1.0),
])
def test_config_variants_against_transformers(variant, tmp_path):
    """Dense layers anywhere (or none), one shared expert, no biases, a tied head, no scaling."""
    _exact(save_family(tmp_path / "m", "hy_v3", **variant))


def test_fp8_linears_stay_fp8(family_models):
    """The FP8 checkpoint against transformers on its dequantized twin (fp32 compute on both
    sides: the fp32 bound), attention, dense, shared and expert linears kept in FP8."""
    fp8 = family_models.hf("hy_v3", "fp8")
    ref_logits, ref_tokens = family_models.expected("hy_v3", "fp8")  # transformers on the twin, once a session
    ids = PROMPT
    with sluice.load(fp8, memory="4GiB", cache_experts=4, progress=False) as eng:
        assert (eng.forward(ids) - ref_logits).abs().max().item() <= 1e-4
        result = eng.generate(ids.tolist(), max_new_tokens=N_NEW, ignore_eos=True, speculate=False)
        assert result.token_ids == ref_tokens
        assert eng.experts_source.format == "fp8"
        attn = eng.model.layers[1].attn
        for w in (attn.wq, attn.wk, attn.wv, attn.wo):
            assert isinstance(w, BlockFP8) and w.weight.dtype == torch.float8_e4m3fn
        assert isinstance(eng.model.layers[0].mlp.gate, BlockFP8)  # the dense MLP
        assert isinstance(eng.model.layers[1].mlp.shared.down, BlockFP8)
        assert eng.model.layers[1].mlp.router.weight.dtype == torch.float32  # the router stays plain


def test_config_fields():
    cfg = hy.parse_config(HY3_CONFIG)
    assert (cfg.head_dim, cfg.rope["rope_theta"], cfg.mtp_layers, cfg.router_scaling_factor) == (
        128, 11158840.0, 1, 2.826)
    assert cfg.mlp_layer_types == ["dense"] + ["sparse"] * 79 and cfg.weights.kind is None
    bare = {k: v for k, v in HY3_CONFIG.items() if k not in ("head_dim", "rope_parameters", "router_scaling_factor")}
    cfg = hy.parse_config(bare)  # transformers' defaults: head_dim 128 (not hidden / heads), theta 11158840
    assert (cfg.head_dim, cfg.rope["rope_theta"], cfg.router_scaling_factor) == (128, 11158840.0, 2.826)
    three = dict(HY3_CONFIG, first_k_dense_replace=3, mlp_layer_types=["dense"] * 3 + ["sparse"] * 77)
    assert hy.parse_config(three).moe_layers == list(range(3, 80))
    with pytest.raises(UnsupportedModelError, match="first_k_dense_replace=3 disagrees"):
        hy.parse_config(dict(HY3_CONFIG, first_k_dense_replace=3))  # transformers: only layer 0 dense
