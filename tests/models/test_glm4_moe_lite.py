"""GLM-4.7-Flash (``glm4_moe_lite``): the checkpoint tensor names Sluice relies on, the released
config.json shape and a q_proj / rotate-half / bias / grouped variant against transformers,
block FP8 kept in FP8 against the dequantized twin, absorbed vs naive MLA and the latent cache's
prefix reuse, and the router against transformers' own.

(Exactness on every axis runs in the fidelity matrix through the registry entry.)"""

from __future__ import annotations

import json

import pytest
import torch

import sluice
from conftest import prompt_ids
from families import PROMPT, assert_decisive_model, reference, save_family
from sluice.convert import convert
from sluice.layers.mla import MLA
from sluice.layers.routing import grouped_topk
from sluice.models import get_family
from sluice.quant.fp8 import BlockFP8

gl = get_family("glm4_moe_lite")
N_NEW = 32

# The released GLM-4.7-Flash config.json: the keys its architecture reads (transformers'
# configuration_glm4_moe_lite.py documents these values as its defaults); no mlp_layer_types,
# DeepSeek-V3's first_k_dense_replace instead, one MTP layer.
FLASH_CONFIG = dict(
    architectures=["Glm4MoeLiteForCausalLM"], model_type="glm4_moe_lite", vocab_size=154880, hidden_size=2048,
    intermediate_size=10240, moe_intermediate_size=1536, num_hidden_layers=47, num_attention_heads=20,
    num_key_value_heads=20, n_shared_experts=1, n_routed_experts=64, routed_scaling_factor=1.8, kv_lora_rank=512,
    q_lora_rank=768, qk_rope_head_dim=64, v_head_dim=256, qk_nope_head_dim=192, n_group=1, topk_group=1,
    num_experts_per_tok=4, norm_topk_prob=True, topk_method="noaux_tc", first_k_dense_replace=1,
    num_nextn_predict_layers=1, hidden_act="silu", max_position_embeddings=202752, rms_norm_eps=1e-5,
    rope_theta=1000000, partial_rotary_factor=1.0, attention_bias=False, tie_word_embeddings=False,
)
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def test_checkpoint_tensor_names():
    """The names of a dense and a sparse layer as the released model.safetensors.index.json lays
    them out (transformers' conversion mapping reads glm4_moe_lite as qwen2_moe: per-expert
    ``experts.<e>.gate_proj/up_proj/down_proj``), with their shapes."""
    desc = gl.describe(gl.parse_config(FLASH_CONFIG))
    assert desc.moe_layers == list(range(1, 47)) and desc.n_experts == 64 and desc.top_k == 4
    a = "model.layers.{}.self_attn."
    attn = {"q_a_proj.weight": (768, 2048), "q_a_layernorm.weight": (768,), "q_b_proj.weight": (20 * 256, 768),
            "kv_a_proj_with_mqa.weight": (512 + 64, 2048), "kv_a_layernorm.weight": (512,),
            "kv_b_proj.weight": (20 * (192 + 256), 512), "o_proj.weight": (2048, 20 * 256)}
    norms = {"input_layernorm.weight": (2048,), "post_attention_layernorm.weight": (2048,)}

    def layer(i):
        p = f"model.layers.{i}."
        return {k[len(p):]: v for k, v in desc.spine.items() if k.startswith(p)}

    assert layer(0) == {**norms, **{"self_attn." + k: v for k, v in attn.items()},
                        "mlp.gate_proj.weight": (10240, 2048), "mlp.up_proj.weight": (10240, 2048),
                        "mlp.down_proj.weight": (2048, 10240)}
    assert layer(46) == {**norms, **{"self_attn." + k: v for k, v in attn.items()},
                         "mlp.gate.weight": (64, 2048), "mlp.gate.e_score_correction_bias": (64,),
                         "mlp.shared_experts.gate_proj.weight": (1536, 2048),
                         "mlp.shared_experts.up_proj.weight": (1536, 2048),
                         "mlp.shared_experts.down_proj.weight": (2048, 1536)}
    assert a.format(0) + "q_a_proj.weight" in desc.spine
    assert not any(k.startswith("model.layers.47.") for k in desc.spine)  # the MTP layer is never read
    assert {k: v for k, v in desc.spine.items() if not k.startswith("model.layers.")} == {
        "model.embed_tokens.weight": (154880, 2048), "model.norm.weight": (2048,), "lm_head.weight": (154880, 2048)}
    e = "model.layers.46.mlp.experts.63."
    assert {r: (t.name, tuple(t.shape)) for r, t in desc.expert_tensors(46, 63).items()} == {
        "gate": (e + "gate_proj.weight", (1536, 2048)), "up": (e + "up_proj.weight", (1536, 2048)),
        "down": (e + "down_proj.weight", (2048, 1536))}
    assert any("model.layers.47" in n and "multi-token-prediction" in n for n in desc.notes)
    assert any("512 + 64 floats per position" in n for n in desc.notes)
    # block FP8: every linear with its weight_scale_inv [ceil(N/128), ceil(K/128)]; router and bias plain
    fp8 = gl.describe(gl.parse_config(dict(FLASH_CONFIG, quantization_config=FP8)))
    p = "model.layers.46."
    assert fp8.spine[p + "self_attn.kv_a_proj_with_mqa.weight_scale_inv"] == (5, 16)
    assert fp8.spine[p + "self_attn.kv_b_proj.weight_scale_inv"] == (70, 4)
    assert fp8.spine[p + "mlp.shared_experts.down_proj.weight_scale_inv"] == (16, 12)
    assert fp8.spine["model.layers.0.mlp.gate_proj.weight_scale_inv"] == (80, 16)
    assert p + "mlp.gate.weight_scale_inv" not in fp8.spine
    refs = {r: (t.name, tuple(t.shape)) for r, t in fp8.expert_tensors(46, 63).items()}
    assert refs["down_scale_inv"] == (e + "down_proj.weight_scale_inv", (16, 12))
    assert refs["gate_scale_inv"] == (e + "gate_proj.weight_scale_inv", (12, 16))


def test_released_config_fields():
    cfg = gl.parse_config(FLASH_CONFIG)
    assert (cfg.rms_norm_eps, cfg.routed_scaling_factor, cfg.rope["rope_theta"], cfg.mtp_layers) == (1e-5, 1.8, 1e6, 1)
    assert cfg.rope_interleave and cfg.n_group == 1 and cfg.softmax_scale == 256 ** -0.5
    minimal = {k: v for k, v in FLASH_CONFIG.items() if k not in (
        "first_k_dense_replace", "n_group", "topk_group", "routed_scaling_factor", "kv_lora_rank", "q_lora_rank",
        "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "n_routed_experts", "num_experts_per_tok",
        "rms_norm_eps")}
    same = gl.parse_config(minimal)  # transformers' Glm4MoeLiteConfig defaults fill the rest
    assert (same.moe_layers, same.kv_lora_rank, same.v_head_dim, same.rms_norm_eps) == (cfg.moe_layers, 512, 256, 1e-5)
    listed = gl.parse_config(dict(FLASH_CONFIG, mlp_layer_types=["dense"] * 3 + ["sparse"] * 44 + ["sparse"],
                                  first_k_dense_replace=3))
    assert listed.moe_layers == list(range(3, 47))  # entries past num_hidden_layers unused, as in transformers


def _checked(path, expected=None, cache_experts=None):
    """Logits at every prompt position and 32 greedy tokens against transformers (``expected``:
    its logits and tokens on ``PROMPT``, else run here on ``prompt_ids()``)."""
    if expected is None:
        ref = reference(path)
        ids = prompt_ids()
        with torch.no_grad():
            ref_logits = ref(ids[None]).logits[0]
            ref_out = ref.generate(ids[None], max_new_tokens=N_NEW, do_sample=False)[0]
        assert_decisive_model(ref, ref_out, len(ids) - 1)
        ref_tokens = ref_out[len(ids):].tolist()
    else:
        ids, (ref_logits, ref_tokens) = PROMPT, expected
    eng = sluice.load(path, memory="4GiB", cache_experts=cache_experts, progress=False)
    logits = eng.forward(ids)
    assert (logits - ref_logits).abs().max().item() <= 1e-4
    out = eng.generate(ids.tolist(), max_new_tokens=N_NEW, ignore_eos=True, speculate=False)
    assert out.token_ids == ref_tokens
    return eng, logits, out


# name -> (overrides of the registry entry, seed)
VARIANTS = {
    # the released shape: no mlp_layer_types (layer 0 dense), first_k_dense_replace 1 beside it
    "released-shape": (dict(mlp_layer_types=None), 0),
    # plain q_proj, rotate-half RoPE, attention biases, groups, two shared experts, no renormalisation
    "qproj-halfrope-bias": (dict(q_lora_rank=None, rope_interleave=False, attention_bias=True, n_group=4, topk_group=2,
                                 n_shared_experts=2, norm_topk_prob=False), 1),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variants_against_transformers(variant, tmp_path):
    overrides, seed = VARIANTS[variant]
    path = save_family(tmp_path / variant, "glm4_moe_lite", seed=seed, **overrides)
    if variant == "released-shape":
        cfg = json.loads((path / "config.json").read_text())
        assert cfg["mlp_layer_types"] == ["dense", "sparse", "sparse"]  # what transformers derived
        del cfg["mlp_layer_types"]
        (path / "config.json").write_text(json.dumps(dict(cfg, first_k_dense_replace=1, topk_method="noaux_tc")))
    eng, _, _ = _checked(path, cache_experts=4)
    assert [i for i in range(3) if eng.model.is_moe(i)] == ([1, 2] if variant == "released-shape" else [0, 2])


def test_fp8_stays_fp8(family_models, tmp_path):
    """The FP8 checkpoint against transformers on its dequantized twin (fp32 compute on both
    sides: the fp32 bound); attention, the dense MLP, the shared expert and the experts in FP8."""
    fp8 = family_models.hf("glm4_moe_lite", "fp8")  # transformers on its dequantized twin, once a session
    eng, logits, out = _checked(fp8, family_models.expected("glm4_moe_lite", "fp8"), cache_experts=4)
    assert eng.experts_source.format == "fp8" and out.stats["evictions"] > 0
    attn = eng.model.layers[0].attn
    assert isinstance(attn.wkv_b, BlockFP8) and attn.wkv_b.weight.dtype == torch.float8_e4m3fn
    assert isinstance(eng.model.layers[1].mlp.gate, BlockFP8)  # the dense layer
    slot = next(s for s in eng.cache.slots if s.weights is not None)
    assert isinstance(slot.weights["down"], BlockFP8)
    box = convert(fp8, tmp_path / "fp8.sluice", progress=False)
    with sluice.load(box, memory="4GiB", cache_experts=4, progress=False) as b:
        assert b.experts_source.format == "fp8"
        assert torch.equal(b.forward(PROMPT), logits)
    eng.close()


def test_names_match_what_transformers_saves(family_models):
    from safetensors import safe_open

    path = family_models.hf("glm4_moe_lite", "f32")
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    desc = gl.describe(gl.parse_config(json.loads((path / "config.json").read_text())))
    experts = {r.name for layer in desc.moe_layers for e in range(desc.n_experts)
               for r in desc.expert_tensors(layer, e).values()}
    assert saved == set(desc.spine) | experts


def test_absorbed_and_naive_mla_and_prefix_reuse(family_models):
    """Absorbed and naive MLA agree to fp32 rounding with the same greedy tokens, and the latent
    cache truncates like a KV cache (prefix reuse gives the same tokens)."""
    path = family_models.hf("glm4_moe_lite", "f32")
    ids = prompt_ids(seed=3)
    runs = {}
    for mode in (False, True):
        with sluice.load(path, memory="4GiB", progress=False) as eng:
            attns = [layer.attn for layer in eng.model.layers]
            assert all(isinstance(a, MLA) for a in attns)
            for a in attns:
                a.absorb = mode
            runs[mode] = (eng.forward(ids), eng.generate(ids.tolist(), max_new_tokens=8).token_ids)
    assert (runs[True][0] - runs[False][0]).abs().max().item() < 2e-5
    assert runs[True][1] == runs[False][1]
    with sluice.load(path, memory="4GiB", progress=False) as eng:
        first = eng.generate(ids.tolist(), max_new_tokens=8)
        again = eng.generate(ids.tolist(), max_new_tokens=8, reuse_prefix=True)
    assert again.stats["reused_prefix_tokens"] == len(ids) - 1
    assert again.token_ids == first.token_ids == runs[True][1]


def test_router_matches_transformers():
    from transformers import AutoConfig
    from transformers.models.glm4_moe_lite.modeling_glm4_moe_lite import Glm4MoeLiteTopkRouter

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=g)
    for n_group, topk_group, norm in ((1, 1, True), (4, 2, True), (8, 3, False)):
        cfg = AutoConfig.for_model("glm4_moe_lite", hidden_size=16, num_attention_heads=4, n_routed_experts=32,
                                   num_experts_per_tok=4, n_group=n_group, topk_group=topk_group,
                                   norm_topk_prob=norm, routed_scaling_factor=1.8)
        r = Glm4MoeLiteTopkRouter(cfg)
        with torch.no_grad():
            r.weight.copy_(torch.randn(32, 16, generator=g))
            r.e_score_correction_bias.copy_(0.2 * torch.randn(32, generator=g))
            _, want_w, want_i = r(x)
        ids, w = grouped_topk(x @ r.weight.T, 4, bias=r.e_score_correction_bias, n_group=n_group,
                              topk_group=topk_group, normalize=norm, scale=1.8)
        a, oa = ids.sort(dim=-1)
        b, ob = want_i.sort(dim=-1)
        assert torch.equal(a, b)
        torch.testing.assert_close(w.gather(1, oa), want_w.gather(1, ob), rtol=1e-6, atol=1e-7)
