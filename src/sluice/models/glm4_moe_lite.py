"""GLM-4.7-Flash (``model_type: glm4_moe_lite``).

The DeepSeek-V3 architecture (``models/deepseek_v3.py``, whose config reading, declaration
and expert layout this family reuses): Multi-head Latent Attention with its latent cache,
RoPE on the rope sub-head (interleaved pairs by default), sigmoid routing with the
selection-only ``e_score_correction_bias``, groups (one by default), renormalised top-k
weights times ``routed_scaling_factor``, shared experts, block-FP8 checkpoints kept in FP8.
What differs is which layers are MoE: the per-layer ``mlp_layer_types`` list ("dense" or
"sparse"; by default layer 0 dense, every other layer sparse), and transformers' defaults.
The multi-token-prediction layer stored after the decoder's (``model.layers.47.*`` in the
published checkpoint) is never read.

Semantics follow transformers 5.24 (modeling_glm4_moe_lite.py, the oracle). Keys it ignores
that would change the computation (``first_k_dense_replace`` or ``moe_layer_freq`` that
disagree with ``mlp_layer_types``, another scoring function, a sliding window, ...) are refused.
"""

from __future__ import annotations

from ..errors import UnsupportedModelError
from . import deepseek_v3
from .base import CausalLM, ModelDescription
from .config import RawConfig

MODEL_TYPE = "glm4_moe_lite"
MLP_TYPES = ("dense", "sparse")

# transformers' Glm4MoeLiteConfig defaults, used only when config.json lacks the key
_DEFAULTS = dict(n_shared_experts=1, routed_scaling_factor=1.8, kv_lora_rank=512, q_lora_rank=768,
                 qk_rope_head_dim=64, v_head_dim=256, qk_nope_head_dim=192, n_group=1, topk_group=1,
                 norm_topk_prob=True, rope_interleave=True, rms_norm_eps=1e-5, max_position_embeddings=202752,
                 n_routed_experts=64, num_experts_per_tok=4)


def _moe_layers(c: RawConfig, n_layers: int, n_experts: int) -> list[int]:
    """The "sparse" layers of ``mlp_layer_types`` (transformers reads its first ``n_layers`` entries)."""
    types = c.raw.get("mlp_layer_types")
    if types is None:
        types = ["dense"] + ["sparse"] * (n_layers - 1)
    elif not isinstance(types, list) or any(t not in MLP_TYPES for t in types):
        raise c.bad("mlp_layer_types", types, "a list of \"dense\" / \"sparse\", one per layer")
    elif len(types) < n_layers:
        raise UnsupportedModelError(f"{c.where}: mlp_layer_types has {len(types)} entries for "
                                    f"num_hidden_layers={n_layers} (one per layer is needed)")
    types = types[:n_layers]
    # DeepSeek-V3's layer keys, which transformers' GLM-4.7-Flash ignores: refused where they disagree
    first = c.int("first_k_dense_replace", None, lo=0)
    if first is not None and types != ["dense"] * min(first, n_layers) + ["sparse"] * (n_layers - first):
        raise UnsupportedModelError(
            f"{c.where}: first_k_dense_replace={first} is not supported: it disagrees with mlp_layer_types "
            f"({types.count('dense')} dense layer(s)), which transformers' GLM-4.7-Flash follows instead")
    c.refuse("moe_layer_freq", (1,), "transformers' GLM-4.7-Flash ignores it and follows mlp_layer_types")
    moe = [i for i, t in enumerate(types) if t == "sparse"]
    if moe and not n_experts:
        raise UnsupportedModelError(f"{c.where}: n_routed_experts=0 with \"sparse\" layers in mlp_layer_types "
                                    "is not supported (an MoE layer needs experts)")
    return moe


def parse_config(raw: dict) -> deepseek_v3.Config:
    c = RawConfig(raw)
    if "head_dim" in c and "qk_rope_head_dim" in c and raw["head_dim"] != raw["qk_rope_head_dim"]:
        # transformers maps head_dim onto qk_rope_head_dim (attribute_map), and head_dim wins
        raise UnsupportedModelError(
            f"config.json: head_dim={raw['head_dim']!r} with qk_rope_head_dim={raw['qk_rope_head_dim']!r} is not "
            "supported (head_dim is transformers' alias of qk_rope_head_dim for GLM-4.7-Flash)")
    if "head_dim" in c and "qk_rope_head_dim" not in c:
        raw = dict(raw, qk_rope_head_dim=raw["head_dim"])
    return deepseek_v3.parse_mla_config(raw, _DEFAULTS, MODEL_TYPE, "GLM-4.7-Flash", _moe_layers)


def describe(cfg: deepseek_v3.Config) -> ModelDescription:
    return deepseek_v3.describe(cfg)


def build(cfg: deepseek_v3.Config, w, experts) -> CausalLM:
    return deepseek_v3.build(cfg, w, experts)
