"""GLM-5 (``glm_moe_dsa``): the published tensor names and config.json, ``indexer_types`` derived as
transformers' GlmMoeDsaConfig derives it, shared layers reading the previous full layer's selection
(no indexer, no keys of their own), and a 4-layer schedule variant against transformers.

(Its sparse attention's exactness, long runs and tie order are in test_deepseek_v32.py; the
registry entry runs every axis of the fidelity matrix.)"""

from __future__ import annotations

import json

import pytest
import torch

import sluice
from conftest import prompt_ids
from families import reference, save_family
from sluice.layers.dsa import IndexedLatentCache, SharedLatentCache
from sluice.models import get_family

glm = get_family("glm_moe_dsa")

# The published GLM-5 config.json (the keys its architecture reads; the bf16 release)
GLM5_CONFIG = dict(
    architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa", vocab_size=154880, hidden_size=6144,
    intermediate_size=12288, moe_intermediate_size=2048, num_hidden_layers=78, num_attention_heads=64,
    num_key_value_heads=64, n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512,
    q_lora_rank=2048, qk_rope_head_dim=64, v_head_dim=256, qk_nope_head_dim=192, n_group=1, topk_group=1,
    num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True, scoring_func="sigmoid",
    topk_method="noaux_tc", hidden_act="silu", max_position_embeddings=202752, rms_norm_eps=1e-5,
    rope_parameters={"rope_theta": 8000000, "rope_type": "default"}, index_topk=2048, index_head_dim=128,
    index_n_heads=32, num_nextn_predict_layers=1, tie_word_embeddings=False, attention_bias=False)


def test_checkpoint_tensor_names():
    desc = glm.describe(glm.parse_config(GLM5_CONFIG))
    p = "model.layers.77.self_attn."
    attn = {k[len(p):]: v for k, v in desc.spine.items() if k.startswith(p)}
    assert attn == {
        "q_a_proj.weight": (2048, 6144), "q_a_layernorm.weight": (2048,), "q_b_proj.weight": (64 * 256, 2048),
        "kv_a_proj_with_mqa.weight": (576, 6144), "kv_a_layernorm.weight": (512,),
        "kv_b_proj.weight": (64 * 448, 512), "o_proj.weight": (6144, 64 * 256),
        "indexer.wq_b.weight": (32 * 128, 2048), "indexer.wk.weight": (128, 6144), "indexer.k_norm.weight": (128,),
        "indexer.k_norm.bias": (128,), "indexer.weights_proj.weight": (32, 6144)}
    assert desc.moe_layers == list(range(3, 78)) and not any(k.startswith("model.layers.78.") for k in desc.spine)
    assert desc.state_bytes_per_token == 78 * 4 * (512 + 64 + 128)
    cfg = glm.parse_config(GLM5_CONFIG)
    assert cfg.index_interleave and cfg.indexer_types == ("full",) * 78 and cfg.rms_norm_eps == 1e-5


SCHEDULES = [dict(), dict(index_topk_freq=4), dict(index_topk_freq=3, index_skip_topk_offset=0),
             dict(index_topk_freq=2, index_skip_topk_offset=5), dict(index_topk_pattern="FFSSFS" * 2)]


@pytest.mark.parametrize("keys", SCHEDULES, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()) or "default")
def test_indexer_types_derived_as_transformers_derives_them(keys):
    from transformers import AutoConfig

    want = AutoConfig.for_model("glm_moe_dsa", num_hidden_layers=12, **keys).indexer_types
    raw = {k: v for k, v in GLM5_CONFIG.items() if k != "num_hidden_layers"}
    if want[0] == "shared":
        with pytest.raises(sluice.UnsupportedModelError, match="starts with a \"shared\" layer"):
            glm.parse_config(dict(raw, num_hidden_layers=12, **keys))
        return
    cfg = glm.parse_config(dict(raw, num_hidden_layers=12, **keys))
    assert list(cfg.indexer_types) == want
    assert glm.parse_config(dict(raw, num_hidden_layers=12, indexer_types=want)).indexer_types == cfg.indexer_types


def test_shared_layers_keep_no_indexer(family_models):
    """Layer 1 of the registry model reuses layer 0's selection: no indexer tensors, a latent cache
    linked to layer 0's state of the same sequence, and the state bytes say so."""
    path = family_models.hf("glm_moe_dsa", "f32")
    with sluice.load(path, memory="4GiB", progress=False) as eng:
        assert not any(".layers.1.self_attn.indexer." in k for k in eng.desc.spine)
        assert eng.model.layers[1].attn.indexer is None and eng.model.layers[1].attn.source == 0
        a, b = eng.model.new_state(32), eng.model.new_state(32)
        assert isinstance(a.layers[0], IndexedLatentCache) and isinstance(a.layers[1], SharedLatentCache)
        assert a.layers[1].source is a.layers[0] and b.layers[1].source is b.layers[0]
        assert eng.desc.state_bytes_per_token == 4 * (3 * (40 + 4) + 2 * 16)


def test_schedule_variant_against_transformers(tmp_path):
    """Four layers, full / shared / full / shared from ``index_topk_freq`` 2 and ``index_skip_topk_offset``
    1, read from a config.json without ``indexer_types`` (Sluice derives the schedule itself): logits at
    every position of 60 tokens within 1e-4 of transformers, and the shared layers' reuse matters."""
    path = save_family(tmp_path / "glm", "glm_moe_dsa", num_hidden_layers=4, index_topk=10, index_topk_freq=2,
                       index_skip_topk_offset=1, indexer_types=None, mlp_layer_types=["dense"] + ["sparse"] * 3)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg.pop("indexer_types") == ["full", "shared", "full", "shared"]
    (path / "config.json").write_text(json.dumps(cfg))
    ref = reference(path)
    ids = prompt_ids(60, seed=2)
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    with sluice.load(path, memory="4GiB", progress=False) as eng:
        assert [layer.attn.source for layer in eng.model.layers] == [None, 0, None, 2]
        got = eng.forward(ids)
        assert (got - want).abs().max().item() <= 1e-4
        own = eng.model.layers[2].attn  # layer 3 reading layer 2's selection; with layer 0's it differs
        eng.model.layers[3].attn.source = 0
        for s in eng.runner.slots:
            s.model_state.layers[3].source_layer = 0
            s.model_state.layers[3].link(s.model_state.layers)
        assert own.indexer is not None and (eng.forward(ids) - want).abs().max().item() > 1e-3
