"""MiMo-V2-Flash: the checkpoint tensor names Sluice relies on (the published layout), the
published config.json shape against transformers (its own keys next to transformers' defaults:
no ``rope_parameters``, ``sliding_window_size``, null scale factors), config-shape variants
(attention biases, other layer-kind patterns, value heads wider than the query heads), block-FP8
linears kept in FP8, attention with value heads of another width than the keys (C kernel and
torch), and the config fields it reads.

(Exactness on every axis runs in the fidelity matrix through the registry entry.)"""

from __future__ import annotations

import json

import pytest
import torch

import sluice
from conftest import prompt_ids
from families import PROMPT, reference, save_family
from sluice.convert import convert
from sluice.errors import UnsupportedModelError
from sluice.layers import attention
from sluice.layers.attention import KVCache, WindowKVCache
from sluice.models import get_family
from sluice.quant.fp8 import BlockFP8

mf = get_family("mimo_v2_flash")
N_NEW = 32

# The published MiMo-V2-Flash config.json (the keys its architecture reads, as transformers'
# configuration_mimo_v2_flash.py and the checkpoint's config document them): 48 layers, full
# attention at 0, 5, 11, ..., 47 (hybrid_layer_pattern 0), a dense layer 0 (moe_layer_freq 0).
PATTERN = [0 if i == 0 or (i + 1) % 6 == 0 else 1 for i in range(48)]
HUB_CONFIG = dict(
    architectures=["MiMoV2FlashForCausalLM"], model_type="mimo_v2_flash", vocab_size=152576, hidden_size=4096,
    intermediate_size=16384, moe_intermediate_size=2048, num_hidden_layers=48, num_attention_heads=64,
    num_key_value_heads=4, head_dim=192, v_head_dim=128, swa_num_attention_heads=64, swa_num_key_value_heads=8,
    swa_head_dim=192, swa_v_head_dim=128, partial_rotary_factor=0.334, rope_theta=5000000, swa_rope_theta=10000,
    sliding_window=128, sliding_window_size=128, attention_chunk_size=128, hybrid_layer_pattern=PATTERN,
    moe_layer_freq=[0] + [1] * 47, add_swa_attention_sink_bias=True, add_full_attention_sink_bias=False,
    n_routed_experts=256, num_experts_per_tok=8, routed_scaling_factor=None, scoring_func="sigmoid",
    topk_method="noaux_tc", n_group=1, topk_group=1, norm_topk_prob=True, n_shared_experts=None,
    layernorm_epsilon=1e-5, attention_value_scale=0.707, attention_bias=False, hidden_act="silu",
    max_position_embeddings=262144, tie_word_embeddings=False, num_nextn_predict_layers=3,
    quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                         "weight_block_size": [128, 128]},
)


def _fp8(p: str, shape: tuple[int, int]) -> dict:
    return {p + ".weight": shape, p + ".weight_scale_inv": (-(-shape[0] // 128), -(-shape[1] // 128))}


def test_checkpoint_tensor_names():
    """The names of a full-attention dense layer and a sliding-window MoE layer as the published
    model.safetensors.index.json lays them out (transformers' conversion mapping for mimo_v2_flash
    reads per-expert ``mlp.experts.<e>.{gate,up,down}_proj`` and renames
    ``self_attn.attention_sink_bias`` to its ``sinks``): FP8 linears with their
    ``weight_scale_inv`` [ceil(N/128), ceil(K/128)], the router, its bias and the sinks plain."""
    desc = mf.describe(mf.parse_config(HUB_CONFIG))
    p = "model.layers.0."
    assert {k: v for k, v in desc.spine.items() if k.startswith(p)} == {
        p + "input_layernorm.weight": (4096,), p + "post_attention_layernorm.weight": (4096,),
        **_fp8(p + "self_attn.q_proj", (64 * 192, 4096)), **_fp8(p + "self_attn.k_proj", (4 * 192, 4096)),
        **_fp8(p + "self_attn.v_proj", (4 * 128, 4096)), **_fp8(p + "self_attn.o_proj", (4096, 64 * 128)),
        **_fp8(p + "mlp.gate_proj", (16384, 4096)), **_fp8(p + "mlp.up_proj", (16384, 4096)),
        **_fp8(p + "mlp.down_proj", (4096, 16384)),
    }
    p = "model.layers.1."
    assert {k: v for k, v in desc.spine.items() if k.startswith(p)} == {
        p + "input_layernorm.weight": (4096,), p + "post_attention_layernorm.weight": (4096,),
        **_fp8(p + "self_attn.q_proj", (64 * 192, 4096)), **_fp8(p + "self_attn.k_proj", (8 * 192, 4096)),
        **_fp8(p + "self_attn.v_proj", (8 * 128, 4096)), **_fp8(p + "self_attn.o_proj", (4096, 64 * 128)),
        p + "self_attn.attention_sink_bias": (64,),
        p + "mlp.gate.weight": (256, 4096), p + "mlp.gate.e_score_correction_bias": (256,),
    }
    assert "model.layers.5.self_attn.attention_sink_bias" not in desc.spine  # full attention: no sinks
    assert {k: v for k, v in desc.spine.items() if not k.startswith("model.layers.")} == {
        "model.embed_tokens.weight": (152576, 4096), "model.norm.weight": (4096,),
        "lm_head.weight": (152576, 4096)}
    refs = {role: (r.name, tuple(r.shape)) for role, r in desc.expert_tensors(47, 255).items()}
    e = "model.layers.47.mlp.experts.255."
    assert refs == {
        "gate": (e + "gate_proj.weight", (2048, 4096)), "gate_scale_inv": (e + "gate_proj.weight_scale_inv", (16, 32)),
        "up": (e + "up_proj.weight", (2048, 4096)), "up_scale_inv": (e + "up_proj.weight_scale_inv", (16, 32)),
        "down": (e + "down_proj.weight", (4096, 2048)), "down_scale_inv": (e + "down_proj.weight_scale_inv", (32, 16)),
    }
    assert desc.moe_layers == list(range(1, 48)) and desc.top_k == 8 and desc.n_experts == 256
    # KV per position: 9 full layers (4 heads x (192 + 128)); sliding layers keep a window of 129
    assert desc.state_bytes_per_token == 9 * 4 * 4 * (192 + 128)
    assert desc.window_bytes_per_token == 39 * 4 * 8 * (192 + 128)
    assert any("multi-token-prediction" in n for n in desc.notes)
    assert any("64 of 192 dims" in n for n in desc.notes)


def test_names_match_what_transformers_saves(family_models):
    """Every tensor transformers writes for the tiny model is a declared spine tensor or an expert tensor."""
    from safetensors import safe_open

    path = family_models.hf("mimo_v2_flash", "f32")
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    desc = mf.describe(mf.parse_config(json.loads((path / "config.json").read_text())))
    experts = {r.name for layer in desc.moe_layers for e in range(desc.n_experts)
               for r in desc.expert_tensors(layer, e).values()}
    assert saved == set(desc.spine) | experts
    assert "model.layers.1.self_attn.attention_sink_bias" in saved


def _against_transformers(path, **load):
    ref = reference(path)
    ids = prompt_ids()
    with torch.no_grad():
        ref_logits = ref(ids[None]).logits[0]
        ref_out = ref.generate(ids[None], max_new_tokens=N_NEW, do_sample=False)[0]
    with sluice.load(path, memory="4GiB", progress=False, **load) as eng:
        logits = eng.forward(ids)
        assert (logits - ref_logits).abs().max().item() <= 1e-4
        out = eng.generate(ids.tolist(), max_new_tokens=N_NEW, ignore_eos=True, speculate=False)
        assert out.token_ids == ref_out[len(ids):].tolist()
    return ref, logits


def test_published_config_shape_against_transformers(tmp_path):
    """The published config.json's spelling: no ``rope_parameters`` (transformers' defaults,
    thetas 5e6 / 1e4 and factor 0.334: 5 of 16 dims, rotated as 6), ``sliding_window_size``
    (+1 is the window), null ``routed_scaling_factor`` and ``attention_value_scale``, and
    Xiaomi's keys agreeing with what transformers computes."""
    hub = dict(hybrid_layer_pattern=[0, 1, 1], moe_layer_freq=[0, 1, 1], swa_num_attention_heads=4,
               swa_num_key_value_heads=4, swa_head_dim=16, swa_v_head_dim=8, rope_theta=5000000,
               swa_rope_theta=10000, partial_rotary_factor=0.334, layernorm_epsilon=1e-5, scoring_func="sigmoid",
               topk_method="noaux_tc", add_swa_attention_sink_bias=True, add_full_attention_sink_bias=False,
               n_shared_experts=None)
    path = save_family(tmp_path / "hub", "mimo_v2_flash", rope_parameters=None, sliding_window_size=3,
                       routed_scaling_factor=None, attention_value_scale=None)
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("rope_parameters")
    cfg.update(hub, routed_scaling_factor=None, attention_value_scale=None)
    (path / "config.json").write_text(json.dumps(cfg))
    ref, _ = _against_transformers(path)
    assert ref.config.sliding_window == 4 and ref.model.layers[1].self_attn.v_scale == 1.0
    parsed = mf.parse_config(cfg)
    assert (parsed.sliding_window, parsed.v_scale, parsed.routed_scaling_factor) == (4, 1.0, 1.0)
    assert parsed.rope["full_attention"]["rope_theta"] == 5e6 and parsed.rope["sliding_attention"]["rope_theta"] == 1e4


@pytest.mark.parametrize("variant", [
    # q/k/v biases (o_proj has none); sliding, full, sliding; layer 1 dense, layers 0 and 2 MoE
    dict(attention_bias=True, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
         mlp_layer_types=["sparse", "dense", "sparse"]),
    # value heads wider than the query/key heads, one key/value head in full layers, no groups
    dict(v_head_dim=24, num_key_value_heads=1, n_group=1, topk_group=1, num_hidden_layers=4,
         layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
         mlp_layer_types=["dense", "sparse", "sparse", "dense"], norm_topk_prob=False),
], ids=["biases+other-pattern", "wide-values+ungrouped"])
def test_config_variants_against_transformers(variant, tmp_path):
    path = save_family(tmp_path / "v", "mimo_v2_flash", **variant)
    _against_transformers(path)


def test_fp8_linears_stay_fp8(family_models, tmp_path):
    """The FP8 checkpoint against transformers on its dequantized twin (fp32 compute on both
    sides: the fp32 bound), with the attention, dense and expert linears kept in FP8."""
    fp8 = family_models.hf("mimo_v2_flash", "fp8")
    ref_logits, ref_tokens = family_models.expected("mimo_v2_flash", "fp8")  # transformers on the twin, once a session
    ids = PROMPT
    with sluice.load(fp8, memory="4GiB", cache_experts=4, progress=False) as eng:
        logits = eng.forward(ids)
        assert (logits - ref_logits).abs().max().item() <= 1e-4
        result = eng.generate(ids.tolist(), max_new_tokens=N_NEW, ignore_eos=True, speculate=False)
        assert result.token_ids == ref_tokens
        assert eng.experts_source.format == "fp8" and result.stats["evictions"] > 0
        for layer in (eng.model.layers[0], eng.model.layers[1]):
            attn = layer.attn
            for w in (attn.wq, attn.wk, attn.wv, attn.wo):
                assert isinstance(w, BlockFP8) and w.weight.dtype == torch.float8_e4m3fn
        assert isinstance(eng.model.layers[0].mlp.gate, BlockFP8)  # the dense layer
        assert eng.model.layers[1].mlp.router.weight.dtype == torch.float32  # the router stays plain
        slot = next(s for s in eng.cache.slots if s.weights is not None)
        assert isinstance(slot.weights["gate"], BlockFP8)
    box = convert(fp8, tmp_path / "fp8.sluice", progress=False)
    with sluice.load(box, memory="4GiB", cache_experts=4, progress=False) as b:
        assert b.experts_source.format == "fp8"
        assert torch.equal(b.forward(ids), logits)


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("sinks", [False, True])
def test_attend_values_narrower_and_wider_than_keys(window, sinks):
    """``attend`` with Dv != D: the C kernel (one query and head at a time) against the torch form
    and an fp64 reference, every query block the same bits as the whole prefill."""
    from sluice.kernels.backend import cpu

    g = torch.Generator().manual_seed(0)
    t, hq, hkv, d = 9, 4, 2, 12
    for dv in (5, 20):
        q, k, v = torch.randn(t, hq, d, generator=g), torch.randn(hkv, t, d, generator=g), torch.randn(hkv, t, dv,
                                                                                                         generator=g)
        s = torch.randn(hq, generator=g) if sinks else None
        scores = torch.einsum("thd,hld->htl", q.double(), k.double().repeat_interleave(hq // hkv, 0)) * 0.3
        qp, kp = torch.arange(t)[:, None], torch.arange(t)[None, :]
        masked = (kp > qp) | ((kp <= qp - window) if window else torch.zeros(t, t, dtype=torch.bool))
        scores = scores.masked_fill(masked, float("-inf"))
        if s is not None:
            scores = torch.cat([scores, s.double()[:, None, None].expand(hq, t, 1)], -1)
        p = torch.softmax(scores, -1)[..., :t]
        want = torch.einsum("htl,hlv->thv", p, v.double().repeat_interleave(hq // hkv, 0))
        got = attention.attend(q, k, v, 0, 0.3, window, s)
        assert got.shape == (t, hq, dv)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
        if cpu.batch_invariant():
            from sluice import kernels

            for q0 in (0, 4, 8):  # a block of queries alone: the same bits
                assert torch.equal(kernels.attend(q[q0:], k, v, q0, 0.3, window, s), got[q0:])


def test_caches_hold_value_heads_of_their_own_width():
    assert KVCache.nbytes(2, 10, 12, 5) == 4 * 2 * 10 * 17
    c = WindowKVCache(2, 64, 12, 4, v_dim=5)
    keys, values, q0 = c.update(0, torch.randn(6, 2, 12), torch.randn(6, 2, 5))
    assert keys.shape[-1] == 12 and values.shape[-1] == 5 and q0 == 0


def test_config_fields():
    cfg = mf.parse_config(dict(HUB_CONFIG, quantization_config=None))
    assert (cfg.head_dim, cfg.v_head_dim, cfg.v_scale, cfg.sliding_window) == (192, 128, 0.707, 129)
    assert cfg.layer_types.count("full_attention") == 9 and cfg.layer_types[5] == "full_attention"
    assert cfg.kv_heads(0) == 4 and cfg.kv_heads(1) == 8 and cfg.moe_layers == list(range(1, 48))
    assert (cfg.routed_scaling_factor, cfg.mtp_modules, cfg.weights.kind) == (1.0, 3, None)
    assert cfg.rope == {"full_attention": {"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.334},
                        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4,
                                              "partial_rotary_factor": 0.334}}
    no_size = {k: v for k, v in HUB_CONFIG.items() if k != "sliding_window_size"}
    assert mf.parse_config(no_size).sliding_window == 128  # transformers: sliding_window as given
    with pytest.raises(UnsupportedModelError, match="hybrid_layer_pattern"):
        mf.parse_config(dict(HUB_CONFIG, hybrid_layer_pattern=[1] * 48))
