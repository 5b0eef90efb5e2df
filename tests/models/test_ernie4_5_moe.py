"""ERNIE-4.5 MoE: the checkpoint tensor names Sluice relies on (21B-A3B and 300B-A47B), the
MoE layer schedule, GPT-J RoPE and the router bit for bit against transformers' own functions,
the published checkpoints' shape (bf16 with the router kept in fp32, no biases, the Paddle
config keys, MTP weights present but unused) against transformers, and the config fields.

(Exactness on every axis runs in the fidelity matrix through the registry entry, which has
biases, a clamped renormalisation and a start/end/interval schedule.)"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import sluice
from conftest import prompt_ids
from families import PROMPT, assert_decisive_model, reference, save_family
from sluice.errors import UnsupportedModelError
from sluice.layers.rotary import Rotary, apply_rotary_pairs
from sluice.layers.routing import SoftmaxRouter
from sluice.models import get_family

em = get_family("ernie4_5_moe")
N_NEW = 32

# The published ERNIE-4.5-21B-A3B-PT config.json (the keys its architecture reads, as
# transformers' configuration_ernie4_5_moe.py and the Baidu checkpoints document them, plus
# Paddle keys transformers ignores at the values the checkpoints carry).
A3B = dict(
    architectures=["Ernie4_5_MoeForCausalLM"], model_type="ernie4_5_moe", vocab_size=103424, hidden_size=2560,
    intermediate_size=12288, num_hidden_layers=28, num_attention_heads=20, num_key_value_heads=4,
    hidden_act="silu", max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000,
    tie_word_embeddings=True, use_bias=False, use_rmsnorm=True, moe_num_experts=64, moe_num_shared_experts=2,
    moe_layer_start_index=1, moe_layer_end_index=27, moe_layer_interval=1, moe_intermediate_size=1536, moe_k=6,
    moe_capacity=[64, 64, 64], moe_gate="topk", moe_use_aux_free=True, num_nextn_predict_layers=1,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
# ERNIE-4.5-300B-A47B-PT: no shared experts, three leading dense layers, an untied head.
A47B = dict(A3B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=54, num_attention_heads=64,
            num_key_value_heads=8, moe_num_shared_experts=0, moe_layer_start_index=3, moe_layer_end_index=53,
            moe_intermediate_size=3584, moe_k=8, tie_word_embeddings=False)


def test_checkpoint_tensor_names():
    """The names of a dense and an MoE layer as ERNIE-4.5-21B-A3B's model.safetensors.index.json
    lays them out (transformers' conversion mapping for ernie4_5_moe: the qwen2_moe per-expert
    merge of ``mlp.experts.<e>.{gate,up,down}_proj.weight``, and ``mlp.moe_statics.
    e_score_correction_bias`` [1, E] renamed to ``mlp.gate.moe_statics.*`` in memory only)."""
    desc = em.describe(em.parse_config(A3B))
    attn = {"self_attn.q_proj.weight": (2560, 2560), "self_attn.k_proj.weight": (512, 2560),
            "self_attn.v_proj.weight": (512, 2560), "self_attn.o_proj.weight": (2560, 2560),
            "input_layernorm.weight": (2560,), "post_attention_layernorm.weight": (2560,)}

    def layer(i):
        p = f"model.layers.{i}."
        return {k[len(p):]: v for k, v in desc.spine.items() if k.startswith(p)}

    assert layer(0) == {**attn, "mlp.gate_proj.weight": (12288, 2560), "mlp.up_proj.weight": (12288, 2560),
                        "mlp.down_proj.weight": (2560, 12288)}
    assert layer(1) == {**attn, "mlp.gate.weight": (64, 2560), "mlp.moe_statics.e_score_correction_bias": (1, 64),
                        "mlp.shared_experts.gate_proj.weight": (3072, 2560),  # 2 shared experts x 1536
                        "mlp.shared_experts.up_proj.weight": (3072, 2560),
                        "mlp.shared_experts.down_proj.weight": (2560, 3072)}
    assert {k: v for k, v in desc.spine.items() if not k.startswith("model.layers.")} == {
        "model.embed_tokens.weight": (103424, 2560), "model.norm.weight": (2560,)}  # tied head
    e = "model.layers.27.mlp.experts.63."
    assert {role: (r.name, tuple(r.shape)) for role, r in desc.expert_tensors(27, 63).items()} == {
        "gate": (e + "gate_proj.weight", (1536, 2560)), "up": (e + "up_proj.weight", (1536, 2560)),
        "down": (e + "down_proj.weight", (2560, 1536))}
    assert desc.moe_layers == list(range(1, 28)) and desc.top_k == 6 and desc.n_experts == 64
    assert any("multi-token-prediction" in n for n in desc.notes)
    assert em.tensor_aliases(em.parse_config(A3B))["model.layers.5.mlp.moe_statics.e_score_correction_bias"] == (
        "model.layers.5.mlp.gate.moe_statics.e_score_correction_bias")


def test_300b_layout():
    desc = em.describe(em.parse_config(A47B))
    assert desc.moe_layers == list(range(3, 54)) and desc.top_k == 8
    assert desc.spine["lm_head.weight"] == (103424, 8192) and "lm_head.bias" not in desc.spine
    assert not any("shared_experts" in k for k in desc.spine)
    assert desc.spine["model.layers.2.mlp.gate_proj.weight"] == (28672, 8192)
    assert desc.spine["model.layers.3.mlp.gate.weight"] == (64, 8192)
    assert desc.spine["model.layers.3.self_attn.k_proj.weight"] == (1024, 8192)


def test_use_bias_names():
    """``use_bias``: every projection of attention and of the dense and shared MLPs has ``.bias``, and
    the head too (``lm_head.bias`` [V], tied head or not); routed experts and the router have none."""
    spine = em.describe(em.parse_config(dict(A3B, use_bias=True))).spine
    p = "model.layers.1."
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj"):
        assert spine[p + name + ".bias"] == spine[p + name + ".weight"][:1]
    assert spine["model.layers.0.mlp.down_proj.bias"] == (2560,) and spine["lm_head.bias"] == (103424,)
    assert "lm_head.weight" not in spine and p + "mlp.gate.bias" not in spine


def test_names_match_what_transformers_saves(family_models):
    """Every tensor transformers writes for the tiny model is a declared spine tensor or an expert tensor."""
    from safetensors import safe_open

    path = family_models.hf("ernie4_5_moe", "f32")
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    desc = em.describe(em.parse_config(json.loads((path / "config.json").read_text())))
    experts = {r.name for layer in desc.moe_layers for e in range(desc.n_experts)
               for r in desc.expert_tensors(layer, e).values()}
    assert saved == set(desc.spine) | experts
    assert "model.layers.1.mlp.moe_statics.e_score_correction_bias" in saved and "lm_head.bias" in saved


@pytest.mark.parametrize("start,end,interval", [(1, -1, 1), (3, -1, 1), (0, 5, 2), (1, 6, 3), (2, 4, 1), (0, 9, 1)])
def test_moe_schedule_is_transformers(start, end, interval):
    """Which layers are MoE blocks: the decoder layers transformers builds for the same keys."""
    from transformers import Ernie4_5_MoeConfig
    from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import (
        Ernie4_5_MoeDecoderLayer,
        Ernie4_5_MoeSparseMoeBlock,
    )

    keys = dict(num_hidden_layers=8, hidden_size=16, intermediate_size=8, moe_intermediate_size=8,
                num_attention_heads=2, num_key_value_heads=1, moe_num_experts=4, moe_k=2, vocab_size=32,
                moe_layer_start_index=start, moe_layer_end_index=end, moe_layer_interval=interval)
    cfg = Ernie4_5_MoeConfig(**keys)
    want = [i for i in range(8) if isinstance(Ernie4_5_MoeDecoderLayer(cfg, i).mlp, Ernie4_5_MoeSparseMoeBlock)]
    assert em.parse_config(dict(keys, model_type="ernie4_5_moe")).moe_layers == want


def test_rope_pairs_is_transformers_rope():
    """GPT-J RoPE: bit-identical to transformers' ``apply_rotary_pos_emb`` for ERNIE (and not rotate-half)."""
    from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(0)
    t, h, d = 7, 3, 16
    q, k = torch.randn(t, h, d, generator=g), torch.randn(t, h, d, generator=g)
    cos, sin = Rotary(d, {"rope_type": "default", "rope_theta": 500000.0}).cos_sin(torch.arange(100, 100 + t))
    tq, tk = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    assert torch.equal(apply_rotary_pairs(q, cos, sin), tq[0].transpose(0, 1))
    assert torch.equal(apply_rotary_pairs(k, cos, sin), tk[0].transpose(0, 1))
    from sluice.layers.rotary import apply_rotary

    assert not torch.allclose(apply_rotary(q, cos, sin), tq[0].transpose(0, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm_min", [1e-12, 0.7])
def test_router_is_transformers_router(dtype, norm_min):
    """The router bit for bit: transformers' Ernie4_5_MoeTopKRouter computes in fp32 (autocast off,
    ``hidden.float() @ weight.float()``, the weight and bias kept fp32), selects by the softmax
    plus the [1, E] correction bias, divides by the sum clamped at ``moe_norm_min`` and only then
    casts the weights to the activations' dtype. Sluice's SoftmaxRouter on the same fp32 logits
    gives the same ids and, cast the same way, the same weights."""
    from transformers import Ernie4_5_MoeConfig
    from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import Ernie4_5_MoeTopKRouter

    e, hdim, k = 16, 32, 6
    cfg = Ernie4_5_MoeConfig(hidden_size=hdim, moe_num_experts=e, moe_k=k, moe_norm_min=norm_min)
    g = torch.Generator().manual_seed(3)
    router = Ernie4_5_MoeTopKRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.randn(e, hdim, generator=g))
        router.moe_statics.e_score_correction_bias.copy_(0.2 * torch.randn(1, e, generator=g))
    x = torch.randn(40, hdim, generator=g).to(dtype)
    with torch.no_grad():
        logits, tw, tids = router(x)
    bias = router.moe_statics.e_score_correction_bias.detach()
    ours = SoftmaxRouter(router.weight.detach(), k, True, correction=bias, norm_min=norm_min)
    # the projection: fp32 both (Sluice's batch-invariant kernel sums in its own order); the rule
    # after it, on transformers' own logits: bit for bit
    assert logits.dtype == torch.float32
    torch.testing.assert_close(ours.logits(x.float()), logits, rtol=1e-5, atol=1e-5)
    ids, w = ours.select(logits)
    assert torch.equal(ids, tids) and torch.equal(w.to(dtype), tw)
    if norm_min > 0.5:  # the clamp decides some rows here
        chosen = torch.softmax(logits, -1).gather(1, tids).sum(-1)
        assert (chosen < norm_min).any() and (chosen > norm_min).any()


def test_registry_model_exercises_the_clamp(family_models):
    """In the matrix's model some tokens' chosen probabilities sum below moe_norm_min (0.8), others above."""
    ref = family_models.transformers("ernie4_5_moe", "f32")
    with torch.no_grad():
        out = ref(PROMPT[None], output_router_logits=True)
    sums = []
    for layer, rl in zip([1, 3], out.router_logits):
        bias = ref.model.layers[layer].mlp.gate.moe_statics.e_score_correction_bias
        p = torch.softmax(rl.float(), -1)
        sums.append(p.gather(1, (p + bias).topk(4, dim=-1).indices).sum(-1))
    s = torch.cat(sums)
    assert (s < 0.8).any() and (s > 0.8).any(), s


def _published(family_models, tmp_path):
    """A tiny checkpoint shaped as the published ones: bf16, the router weight and correction bias
    in fp32 (as transformers keeps them), no biases, the default schedule (MoE from layer 1 to
    the last), two shared experts, moe_norm_min at its default, the Paddle config keys and a top-level
    ``rope_theta``, and MTP tensors that transformers (and Sluice) do not use."""
    from safetensors.torch import load_file, save_file

    src = save_family(tmp_path / "src", "ernie4_5_moe", torch.float32, seed=0, use_bias=False,
                      moe_layer_end_index=-1, moe_layer_interval=1, moe_num_shared_experts=2, moe_norm_min=1e-12)
    dst = tmp_path / "published"
    dst.mkdir()
    tensors = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        router = name.endswith(("mlp.gate.weight", "e_score_correction_bias"))
        tensors[name] = t if router else t.to(torch.bfloat16)
    tensors["model.mtp_emb_norm.0.weight"] = torch.ones(64, dtype=torch.bfloat16)
    tensors["model.mtp_hidden_norm.0.weight"] = torch.ones(64, dtype=torch.bfloat16)
    tensors["model.mtp_linear_proj.0.weight"] = torch.zeros(64, 128, dtype=torch.bfloat16)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["rope_theta"] = cfg.pop("rope_parameters")["rope_theta"]
    cfg.update({k: A3B[k] for k in ("use_rmsnorm", "moe_capacity", "moe_gate", "moe_use_aux_free",
                                    "num_nextn_predict_layers")}, dtype="bfloat16")
    for key in ("moe_layer_end_index", "moe_norm_min"):
        cfg.pop(key)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_published_shape_against_transformers(family_models, tmp_path):
    path = _published(family_models, tmp_path)
    cfg = em.parse_config(json.loads((path / "config.json").read_text()))
    assert cfg.moe_layers == [1, 2, 3] and cfg.num_shared_experts == 2 and cfg.norm_min == 1e-12 and not cfg.use_bias
    ref = reference(path)  # fp32 upcast of the stored weights
    ids = prompt_ids()
    with torch.no_grad():
        ref_logits = ref(ids[None]).logits[0]
        ref_out = ref.generate(ids[None], max_new_tokens=N_NEW, do_sample=False)[0]
    assert_decisive_model(ref, ref_out, len(ids) - 1)
    with sluice.load(path, memory="4GiB", cache_experts=6, progress=False) as eng:
        assert eng.model.layers[1].mlp.router.weight.dtype == torch.float32  # as stored
        assert eng.model.layers[1].attn.wq.dtype == torch.bfloat16
        diff = (eng.forward(ids) - ref_logits).abs().max().item()
        assert diff <= 1e-4 * max(1.0, ref_logits.abs().max().item())
        out = eng.generate(ids.tolist(), max_new_tokens=N_NEW, ignore_eos=True, speculate=False)
        assert out.token_ids == ref_out[len(ids):].tolist() and out.stats["evictions"] > 0


def test_transformers_in_memory_bias_name_loads(family_models, tmp_path):
    """A state dict saved with transformers' module names (``mlp.gate.moe_statics.*``) loads through
    ``tensor_aliases`` and gives the same logits, bit for bit."""
    from safetensors.torch import load_file, save_file

    src = family_models.hf("ernie4_5_moe", "f32")
    dst = tmp_path / "renamed"
    shutil.copytree(src, dst)
    tensors = {k.replace("mlp.moe_statics.", "mlp.gate.moe_statics."): v
               for k, v in load_file(str(src / "model.safetensors")).items()}
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    ids = prompt_ids()
    with sluice.load(src, memory="4GiB", progress=False) as a, sluice.load(dst, memory="4GiB", progress=False) as b:
        assert torch.equal(a.forward(ids), b.forward(ids))


def test_config_fields():
    cfg = em.parse_config(A3B)
    assert (cfg.head_dim, cfg.rope["rope_theta"], cfg.rms_norm_eps, cfg.mtp_layers) == (128, 500000, 1e-5, 1)
    assert cfg.tie_word_embeddings and cfg.norm_min == 1e-12 and cfg.num_experts_per_tok == 6
    bare = {k: v for k, v in A3B.items() if not k.startswith(("moe_", "rope_", "use_", "num_nextn"))}
    d = em.parse_config(bare)  # transformers' defaults: 64 experts, top-6, 2 shared, MoE from layer 1 on
    assert (d.num_experts, d.num_experts_per_tok, d.num_shared_experts, d.moe_layers, d.rope["rope_theta"]) == (
        64, 6, 2, list(range(1, 28)), 500000.0)
    aliased = em.parse_config(dict(bare, num_experts=16, num_experts_per_tok=3))  # attribute_map's names
    assert (aliased.num_experts, aliased.num_experts_per_tok) == (16, 3)
    with pytest.raises(UnsupportedModelError, match="none of the 28 layers"):
        em.parse_config(dict(A3B, moe_layer_start_index=28))
