"""GLM-5 (``model_type: glm_moe_dsa``; GLM-5, GLM-5.1, GLM-5.2, 744B).

DeepSeek-V3.2's architecture (``models/deepseek_v32.py``): MLA with DeepSeek sparse attention
(``layers/dsa.py``), sigmoid routing with the selection-only ``e_score_correction_bias`` (one
group by default) as GLM-4.7-Flash, shared experts, dense layers first by ``mlp_layer_types``
(``first_k_dense_replace`` = 3). What differs: the indexer rotates interleaved pairs, and
``indexer_types`` lets a layer reuse the previous ``"full"`` layer's selection (``"shared"``: no
indexer of its own, no indexer keys), derived when absent from ``index_topk_pattern`` ("F"/"S"
per layer) or ``index_topk_freq`` / ``index_skip_topk_offset`` as transformers derives it. The
MTP layer stored after the decoder's (``model.layers.78.*``) is never read.

Semantics follow transformers 5.24 (modeling_glm_moe_dsa.py, the oracle); keys it ignores that
would change the computation are refused (``docs/families.md``).
"""

from __future__ import annotations

from ..errors import UnsupportedModelError
from . import deepseek_v32
from .base import CausalLM, ModelDescription
from .config import RawConfig

MODEL_TYPE = "glm_moe_dsa"

# transformers' GlmMoeDsaConfig defaults, used only when config.json lacks the key
_DEFAULTS = dict(n_shared_experts=1, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=2048,
                 qk_rope_head_dim=64, v_head_dim=256, qk_nope_head_dim=192, n_group=1, topk_group=1,
                 norm_topk_prob=True, rope_interleave=True, rms_norm_eps=1e-5, max_position_embeddings=202752,
                 n_routed_experts=256, num_experts_per_tok=8, first_k_dense_replace=3, index_topk=2048,
                 index_head_dim=128, index_n_heads=32)


def _indexer_types(c: RawConfig, n_layers: int) -> list[str]:
    """Each layer's indexer mode: ``indexer_types``, else ``index_topk_pattern``, else the schedule of
    ``index_topk_freq`` (1) and ``index_skip_topk_offset`` (2), as transformers' GlmMoeDsaConfig."""
    types = c.raw.get("indexer_types")
    key = "indexer_types"
    if types is None and c.raw.get("index_topk_pattern") is not None:
        key, pattern = "index_topk_pattern", c.raw["index_topk_pattern"]
        if isinstance(pattern, str):
            if any(ch not in "FS" for ch in pattern):
                raise c.bad(key, pattern, "a string of \"F\" (full) and \"S\" (shared), one per layer")
            types = ["full" if ch == "F" else "shared" for ch in pattern]
        else:
            types = pattern
    elif types is None:
        freq = max(c.int("index_topk_freq", 1), 1)
        offset = c.int("index_skip_topk_offset", 2)
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n_layers)]
    if not isinstance(types, list) or any(t not in deepseek_v32.INDEXER_TYPES for t in types):
        raise c.bad(key, types, "a list of \"full\" / \"shared\", one per layer")
    if len(types) < n_layers:
        raise UnsupportedModelError(f"{c.where}: {key} has {len(types)} entries for num_hidden_layers={n_layers} "
                                    "(one per layer is needed)")
    if types[0] == "shared":
        raise UnsupportedModelError(f"{c.where}: {key} starts with a \"shared\" layer, which has no earlier "
                                    "selection to reuse (transformers refuses it too)")
    return list(types[:n_layers])


def parse_config(raw: dict) -> deepseek_v32.Config:
    return deepseek_v32.parse_dsa_config(raw, _DEFAULTS, MODEL_TYPE, "GLM-5", _indexer_types, index_interleave=True)


def declare(cfg: deepseek_v32.Config):
    return deepseek_v32.declare(cfg)


def describe(cfg: deepseek_v32.Config) -> ModelDescription:
    return deepseek_v32.describe(cfg)


def build(cfg: deepseek_v32.Config, w, experts) -> CausalLM:
    return deepseek_v32.build(cfg, w, experts)
