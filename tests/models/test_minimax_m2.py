"""MiniMax-M2: the checkpoint tensor names Sluice relies on, the original config.json shape
(``rotary_dim``, top-level ``rope_theta``) against transformers, block-FP8 attention and
experts kept in FP8 against the dequantized twin, and the config fields it reads.

(Exactness on every axis runs in the fidelity matrix through the registry entry.)"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import sluice
from conftest import prompt_ids
from families import PROMPT, reference
from sluice.convert import convert
from sluice.errors import UnsupportedModelError
from sluice.models import get_family
from sluice.quant.fp8 import BlockFP8

mm = get_family("minimax_m2")
N_NEW = 32

# The published MiniMax-M2 config.json (the keys its architecture reads, as transformers'
# configuration_minimax_m2.py and the original checkpoints' config document them).
M2_CONFIG = dict(
    architectures=["MiniMaxM2ForCausalLM"], model_type="minimax_m2", vocab_size=200064, hidden_size=3072,
    intermediate_size=1536, num_hidden_layers=62, num_attention_heads=48, num_key_value_heads=8, head_dim=128,
    hidden_act="silu", max_position_embeddings=196608, rms_norm_eps=1e-6, rope_theta=5000000, rotary_dim=64,
    num_local_experts=256, num_experts_per_tok=8, scoring_func="sigmoid", use_routing_bias=True, use_qk_norm=True,
    qk_norm_type="per_layer", shared_intermediate_size=0, attn_type_list=[1] * 62, sliding_window=None,
    tie_word_embeddings=False, use_mtp=True, num_mtp_modules=3, mtp_transformer_layers=1,
    quantization_config={"quant_method": "fp8", "fmt": "float8_e4m3fn", "activation_scheme": "dynamic",
                         "weight_block_size": [128, 128],
                         "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]},
)


def test_checkpoint_tensor_names():
    """The names of one layer as MiniMax-M2's model.safetensors.index.json lays them out
    (transformers' conversion mapping for minimax_m2 reads ``block_sparse_moe.*`` with the
    correction bias on the block and per-expert ``w1``/``w2``/``w3``): FP8 linears with their
    ``weight_scale_inv`` [ceil(N/128), ceil(K/128)], the router and the bias unquantized."""
    desc = mm.describe(mm.parse_config(M2_CONFIG))
    p = "model.layers.7."
    layer = {k: v for k, v in desc.spine.items() if k.startswith(p)}
    assert layer == {
        p + "input_layernorm.weight": (3072,), p + "post_attention_layernorm.weight": (3072,),
        p + "self_attn.q_proj.weight": (6144, 3072), p + "self_attn.q_proj.weight_scale_inv": (48, 24),
        p + "self_attn.k_proj.weight": (1024, 3072), p + "self_attn.k_proj.weight_scale_inv": (8, 24),
        p + "self_attn.v_proj.weight": (1024, 3072), p + "self_attn.v_proj.weight_scale_inv": (8, 24),
        p + "self_attn.o_proj.weight": (3072, 6144), p + "self_attn.o_proj.weight_scale_inv": (24, 48),
        p + "self_attn.q_norm.weight": (6144,), p + "self_attn.k_norm.weight": (1024,),  # the whole projection
        p + "block_sparse_moe.gate.weight": (256, 3072),
        p + "block_sparse_moe.e_score_correction_bias": (256,),
    }
    assert {k: v for k, v in desc.spine.items() if not k.startswith("model.layers.")} == {
        "model.embed_tokens.weight": (200064, 3072), "model.norm.weight": (3072,), "lm_head.weight": (200064, 3072)}
    refs = {role: (r.name, tuple(r.shape)) for role, r in desc.expert_tensors(7, 255).items()}
    e = p + "block_sparse_moe.experts.255."
    assert refs == {
        "gate": (e + "w1.weight", (1536, 3072)), "gate_scale_inv": (e + "w1.weight_scale_inv", (12, 24)),
        "up": (e + "w3.weight", (1536, 3072)), "up_scale_inv": (e + "w3.weight_scale_inv", (12, 24)),
        "down": (e + "w2.weight", (3072, 1536)), "down_scale_inv": (e + "w2.weight_scale_inv", (24, 12)),
    }
    assert desc.moe_layers == list(range(62)) and desc.top_k == 8 and desc.n_experts == 256
    assert any("partial RoPE: 64 of 128" in n for n in desc.notes)
    assert any("multi-token-prediction" in n for n in desc.notes)


def test_names_match_what_transformers_saves(family_models):
    """Every tensor transformers writes for the tiny model is a declared spine tensor or an expert tensor."""
    from safetensors import safe_open

    path = family_models.hf("minimax_m2", "f32")
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    desc = mm.describe(mm.parse_config(json.loads((path / "config.json").read_text())))
    experts = {r.name for layer in desc.moe_layers for e in range(desc.n_experts)
               for r in desc.expert_tensors(layer, e).values()}
    assert saved == set(desc.spine) | experts


def test_original_config_shape_against_transformers(family_models, tmp_path):
    """The original checkpoints' config.json: ``rotary_dim`` and a top-level ``rope_theta``,
    no ``rope_parameters`` (transformers derives partial_rotary_factor from rotary_dim)."""
    src = family_models.hf("minimax_m2", "f32")
    dst = tmp_path / "original"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    theta = cfg.pop("rope_parameters")["rope_theta"]
    cfg.update(rope_theta=theta, rotary_dim=8, use_qk_norm=True, qk_norm_type="per_layer", scoring_func="sigmoid",
               use_routing_bias=True, shared_intermediate_size=0, attn_type_list=[1, 1, 1])
    (dst / "config.json").write_text(json.dumps(cfg))
    assert mm.parse_config(cfg).rotary_dim == 8
    ref = reference(dst)
    assert ref.config.rope_parameters["partial_rotary_factor"] == 0.5
    ids = prompt_ids()
    with torch.no_grad():
        ref_logits = ref(ids[None]).logits[0]
        ref_out = ref.generate(ids[None], max_new_tokens=N_NEW, do_sample=False)[0]
    with sluice.load(dst, memory="4GiB", progress=False) as eng:
        assert (eng.forward(ids) - ref_logits).abs().max().item() <= 1e-4
        out = eng.generate(ids.tolist(), max_new_tokens=N_NEW, ignore_eos=True, speculate=False)
    assert out.token_ids == ref_out[len(ids):].tolist()


def test_fp8_attention_and_experts_stay_fp8(family_models, tmp_path):
    """The FP8 checkpoint against transformers on its dequantized twin (fp32 compute on both
    sides: the fp32 bound), with the attention projections and the experts kept in FP8."""
    fp8 = family_models.hf("minimax_m2", "fp8")
    ref_logits, ref_tokens = family_models.expected("minimax_m2", "fp8")  # transformers on the twin, once a session
    ids = PROMPT
    with sluice.load(fp8, memory="4GiB", cache_experts=4, progress=False) as eng:
        logits = eng.forward(ids)
        assert (logits - ref_logits).abs().max().item() <= 1e-4
        result = eng.generate(ids.tolist(), max_new_tokens=N_NEW, ignore_eos=True, speculate=False)
        assert result.token_ids == ref_tokens
        assert eng.experts_source.format == "fp8" and result.stats["evictions"] > 0
        attn = eng.model.layers[0].attn
        for w in (attn.wq, attn.wk, attn.wv, attn.wo):
            assert isinstance(w, BlockFP8) and w.weight.dtype == torch.float8_e4m3fn
        slot = next(s for s in eng.cache.slots if s.weights is not None)
        assert isinstance(slot.weights["gate"], BlockFP8)
        assert eng.model.layers[0].mlp.router.weight.dtype == torch.float32  # the router stays plain
    box = convert(fp8, tmp_path / "fp8.sluice", progress=False)
    with sluice.load(box, memory="4GiB", cache_experts=4, progress=False) as b:
        assert b.experts_source.format == "fp8"
        assert torch.equal(b.forward(ids), logits)


def test_config_fields():
    base = dict(M2_CONFIG, quantization_config=None)
    cfg = mm.parse_config(base)
    assert (cfg.rotary_dim, cfg.head_dim, cfg.rope["rope_theta"], cfg.mtp_layers) == (64, 128, 5000000, 3)
    assert cfg.weights.kind is None
    same = dict(base, rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5})
    assert mm.parse_config(same).rotary_dim == 64
    no_rotary = {k: v for k, v in base.items() if k != "rotary_dim"}
    assert mm.parse_config(no_rotary).rotary_dim == 128  # transformers: the whole head
    assert mm.parse_config(dict(base, use_mtp=False)).mtp_layers == 0
    with pytest.raises(UnsupportedModelError, match="disagree"):
        mm.parse_config(dict(same, rotary_dim=32))


def test_transformers_fp8_loading_reads_the_same_layout(family_models, tmp_path):
    """transformers' own FP8 loader (on a CPU-only machine it dequantizes at load) reads the FP8
    layout Sluice reads, per-expert ``w1/w2/w3.weight_scale_inv`` included, and agrees. (It
    derives the block from the weight and scale shapes, hence 8 x 8 blocks on the tiny sides.)"""
    pytest.importorskip("accelerate")  # transformers' FP8 loader needs it
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from families import to_fp8

    fp8, _ = to_fp8(family_models.hf("minimax_m2", "f32"), tmp_path / "fp8", tmp_path / "deq", block=[8, 8])
    with safe_open(str(fp8 / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"model.layers.0.block_sparse_moe.experts.3.w2.weight_scale_inv",
            "model.layers.2.self_attn.o_proj.weight_scale_inv"} <= names
    ref = AutoModelForCausalLM.from_pretrained(fp8, dtype=torch.float32).eval()
    ids = prompt_ids()
    with torch.no_grad():
        ref_logits = ref(ids[None]).logits[0].float()
    with sluice.load(fp8, memory="4GiB", progress=False) as eng:
        assert (eng.forward(ids) - ref_logits).abs().max().item() <= 1e-4
