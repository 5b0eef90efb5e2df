"""Hunyuan-A13B (hunyuan_v1_moe): the checkpoint tensor names Sluice relies on (the published
layout, per-expert keys as transformers' qwen2_moe conversion mapping reads them) and the
NTK-alpha RoPE frequencies against transformers' own rotary module.

(Exactness on every axis runs in the fidelity matrix through the registry entry.)"""

from __future__ import annotations

import torch

from sluice.layers.rotary import Rotary
from sluice.models import get_family

hy = get_family("hunyuan_v1_moe")

# The published Hunyuan-A13B-Instruct config.json (the keys its architecture reads).
A13B = dict(
    architectures=["HunYuanMoEV1ForCausalLM"], model_type="hunyuan_v1_moe", vocab_size=128167, hidden_size=4096,
    intermediate_size=3072, moe_intermediate_size=[3072] * 32, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, attention_head_dim=128, hidden_act="silu", max_position_embeddings=32768,
    rms_norm_eps=1e-5, rope_theta=10000.0, num_experts=64, moe_topk=[8] * 32, num_shared_expert=[1] * 32,
    use_mixed_mlp_moe=True, use_qk_norm=True, use_cla=False, cla_share_factor=2, use_mla=False, mlp_bias=False,
    attention_bias=False, tie_word_embeddings=True, moe_layer_num_skipped=0, routed_scaling_factor=1.0,
    topk_group=1, rope_scaling={"alpha": 1000.0, "beta_fast": 32, "beta_slow": 1, "factor": 1.0, "mscale": 1.0,
                                "mscale_all_dim": 1.0, "type": "dynamic"},
)


def test_checkpoint_tensor_names():
    desc = hy.describe(hy.parse_config(A13B))
    p = "model.layers.7."
    layer = {k: v for k, v in desc.spine.items() if k.startswith(p)}
    assert layer == {
        p + "input_layernorm.weight": (4096,), p + "post_attention_layernorm.weight": (4096,),
        p + "self_attn.q_proj.weight": (4096, 4096), p + "self_attn.k_proj.weight": (1024, 4096),
        p + "self_attn.v_proj.weight": (1024, 4096), p + "self_attn.o_proj.weight": (4096, 4096),
        p + "self_attn.query_layernorm.weight": (128,), p + "self_attn.key_layernorm.weight": (128,),
        p + "mlp.gate.wg.weight": (64, 4096),
        p + "mlp.shared_mlp.gate_proj.weight": (3072, 4096), p + "mlp.shared_mlp.up_proj.weight": (3072, 4096),
        p + "mlp.shared_mlp.down_proj.weight": (4096, 3072),
    }
    assert {k: v for k, v in desc.spine.items() if not k.startswith("model.layers.")} == {
        "model.embed_tokens.weight": (128167, 4096), "model.norm.weight": (4096,)}  # tied head
    refs = {role: (r.name, tuple(r.shape)) for role, r in desc.expert_tensors(7, 63).items()}
    e = p + "mlp.experts.63."
    assert refs == {"gate": (e + "gate_proj.weight", (3072, 4096)), "up": (e + "up_proj.weight", (3072, 4096)),
                    "down": (e + "down_proj.weight", (4096, 3072))}
    assert desc.moe_layers == list(range(32)) and desc.top_k == 8 and desc.n_experts == 64


def test_ntk_alpha_frequencies_match_transformers():
    from transformers import AutoConfig
    from transformers.models.hunyuan_v1_moe.modeling_hunyuan_v1_moe import HunYuanMoEV1RotaryEmbedding

    cfg = hy.parse_config(A13B)
    assert cfg.rope["rope_type"] == "ntk_alpha"
    raw = {k: v for k, v in A13B.items() if k not in ("model_type", "architectures")}
    ref = HunYuanMoEV1RotaryEmbedding(AutoConfig.for_model("hunyuan_v1_moe", **raw))
    assert ref.rope_type == "ntk_alpha"
    assert torch.equal(Rotary(128, cfg.rope, 32768, ntk=True).inv_freq, ref.inv_freq)
