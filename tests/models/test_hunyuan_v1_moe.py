"""Hunyuan-A13B (hunyuan_v1_moe): the checkpoint tensor names Sluice relies on (the published
layout, per-expert keys as transformers' qwen2_moe conversion mapping reads them), the
NTK-alpha RoPE frequencies against transformers' own rotary module, a per-layer top-k against
transformers, and per-layer expert counts refused (transformers has none).

(Exactness on every axis runs in the fidelity matrix through the registry entry.)"""

from __future__ import annotations

import torch

from families import LOGIT_MARGIN, ROUTER_MARGIN

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


# Per-layer top-k (``moe_topk`` as a list, as the published config writes it): 1, 4 and 2
# experts per token in the three layers of the registry's tiny model.
PER_LAYER_TOPK = [1, 4, 2]
PER_LAYER_SEED = 0  # decisive logits and per-layer router choices on the compared prompt
N_NEW = 32


def _decisive_per_layer(ref, ids: torch.Tensor, first: int) -> None:
    """A clear top-1 logit from ``first`` on, and in every layer a clear gap between the k-th and
    the (k+1)-th router probability for that layer's own k."""
    with torch.no_grad():
        out = ref(ids[None], output_router_logits=True)
    top = out.logits[0, first:].topk(2, dim=-1).values
    assert (top[:, 0] - top[:, 1]).min().item() > LOGIT_MARGIN, "near-tied logits: pick another seed"
    assert len(out.router_logits) == len(PER_LAYER_TOPK)
    for layer, (rl, k) in enumerate(zip(out.router_logits, PER_LAYER_TOPK)):
        v = torch.softmax(rl.float().reshape(-1, rl.shape[-1]), -1).topk(k + 1, dim=-1).values
        gap = (v[:, k - 1] - v[:, k]).min().item()
        assert gap > ROUTER_MARGIN, f"router margin {gap:.2e} in layer {layer} (top-{k}): pick another seed"


def test_per_layer_top_k_exact_against_transformers(tmp_path):
    """``moe_topk`` [1, 4, 2] in a config of the published shape (per-layer lists of expert
    sizes and shared-expert counts, the original code's flags): transformers' gate takes
    ``moe_topk[layer]`` experts per token; Sluice's router of each layer takes the same (the
    plan counts the largest), f32 logits within 1e-4 at every position and 32 greedy tokens
    identical, with expert-cache evictions."""
    import json

    import sluice
    from conftest import check_exact, expected_outputs, prompt_ids
    from families import reference, save_family

    path = save_family(tmp_path / "m", "hunyuan_v1_moe", seed=PER_LAYER_SEED, num_experts_per_tok=PER_LAYER_TOPK)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["moe_topk"] == PER_LAYER_TOPK
    # the published config's other per-layer lists and flags, at the values transformers computes with
    n = len(PER_LAYER_TOPK)
    cfg.update(moe_intermediate_size=[cfg["intermediate_size"]] * n, num_shared_expert=[1] * n, use_mixed_mlp_moe=True,
               use_qk_norm=True, use_cla=False, use_mla=False, mlp_bias=False, moe_layer_num_skipped=0,
               routed_scaling_factor=1.0, topk_group=1, attention_head_dim=cfg["head_dim"])
    (path / "config.json").write_text(json.dumps(cfg))
    ref = reference(path)
    assert [layer.mlp.gate.top_k for layer in ref.model.layers] == PER_LAYER_TOPK
    ids = prompt_ids()
    exp = expected_outputs(ref, ids, N_NEW, _decisive_per_layer)
    with sluice.load(path, memory="2GiB", progress=False, cache_experts=4) as eng:
        assert eng.desc.top_k == 4 and any("vary by layer (1..4)" in n for n in eng.desc.notes)
        _, result = check_exact(exp, eng, ids, N_NEW)  # measured 1.4e-5
        assert result.stats["evictions"] > 0


def test_per_layer_expert_counts_do_not_exist_in_transformers():
    """A list of expert counts (the original Hunyuan code allowed one per layer) is refused by
    name, since transformers 5.24's HunYuanMoEV1Config holds one integer (it rejects the list
    itself) and its experts module sizes every layer by it."""
    import pytest
    from transformers import AutoConfig

    from sluice.errors import UnsupportedModelError

    with pytest.raises(Exception, match="num_experts"):
        AutoConfig.for_model("hunyuan_v1_moe", num_experts=[8, 4, 8], num_hidden_layers=3)
    with pytest.raises(UnsupportedModelError, match=r"num_experts=\[8, 4, 8\] per layer is not supported"):
        hy.parse_config({**A13B, "num_hidden_layers": 3, "num_experts": [8, 4, 8], "moe_topk": [2, 2, 2],
                         "moe_intermediate_size": 3072, "num_shared_expert": 1})
