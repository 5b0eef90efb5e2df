"""DeepSeek-V3.2 (``model_type: deepseek_v32``; V3.2-Exp, V3.2, V3.2-Speciale).

DeepSeek-V3 (``models/deepseek_v3.py``, whose config reading, routing, experts and block-FP8
handling this family reuses) with DeepSeek sparse attention on every layer: a lightning indexer
(``layers/indexer.py``) scores the positions a query sees and MLA attends only over the
``index_topk`` best (``layers/dsa.py``); the indexer keeps ``index_head_dim`` floats per position
per layer beside the latent cache. MLA always rotates interleaved pairs (transformers' V3.2 has no
``rope_interleave``) and the indexer rotate-half; the low-rank query is always there (the indexer
reads its normalised latent). Which layers are MoE: ``mlp_layer_types`` (by default the first
``first_k_dense_replace`` = 3 dense, the rest sparse). The MTP layer stored after the decoder's
(``model.layers.61.*``) is never read.

Semantics follow transformers 5.24 (modeling_deepseek_v32.py, the oracle); keys it ignores that
would change the computation are refused (``docs/families.md``). GLM-5 (``glm_moe_dsa``) reuses
this module with its own defaults, interleaved RoPE in the indexer and ``indexer_types``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ..errors import UnsupportedModelError
from . import deepseek_v3
from .base import CausalLM, ModelDescription
from .config import MAX_HEAD_DIM, MAX_HEADS, MAX_POSITIONS, RawConfig
from .declare import Model
from .parts import dsa_mla

MODEL_TYPE = "deepseek_v32"
MLP_TYPES = ("dense", "sparse")
INDEXER_TYPES = ("full", "shared")

# transformers' DeepseekV32Config defaults, used only when config.json lacks the key
_DEFAULTS = dict(n_shared_experts=1, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
                 qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4,
                 norm_topk_prob=True, rope_interleave=True, rms_norm_eps=1e-6, max_position_embeddings=163840,
                 n_routed_experts=256, num_experts_per_tok=8, first_k_dense_replace=3, index_topk=2048,
                 index_head_dim=128, index_n_heads=64)


@dataclass
class Config(deepseek_v3.Config):
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 64
    index_interleave: bool = False  # the indexer's RoPE: interleaved pairs (GLM-5) or rotate-half
    indexer_types: tuple[str, ...] = ()  # per layer: "full" (its own indexer) or "shared"

    def index_source(self, i: int) -> int | None:
        """The layer whose selection layer ``i`` reuses (the last "full" one before it), None if its own."""
        if self.indexer_types[i] == "full":
            return None
        return max(j for j in range(i) if self.indexer_types[j] == "full")


def _moe_layers(c: RawConfig, n_layers: int, n_experts: int) -> list[int]:
    """The "sparse" layers of ``mlp_layer_types``, by default all but the first ``first_k_dense_replace``
    (transformers derives the list from it when absent, and then follows the list alone)."""
    first = c.int("first_k_dense_replace", _DEFAULTS["first_k_dense_replace"], lo=0)
    types = c.raw.get("mlp_layer_types")
    if types is None:
        types = ["dense"] * min(first, n_layers) + ["sparse"] * max(0, n_layers - first)
    elif not isinstance(types, list) or any(t not in MLP_TYPES for t in types):
        raise c.bad("mlp_layer_types", types, "a list of \"dense\" / \"sparse\", one per layer")
    elif len(types) < n_layers:
        raise UnsupportedModelError(f"{c.where}: mlp_layer_types has {len(types)} entries for "
                                    f"num_hidden_layers={n_layers} (one per layer is needed)")
    types = types[:n_layers]
    c.refuse("moe_layer_freq", (1,), "transformers ignores it and follows mlp_layer_types")
    moe = [i for i, t in enumerate(types) if t == "sparse"]
    if moe and not n_experts:
        raise UnsupportedModelError(f"{c.where}: n_routed_experts=0 with \"sparse\" layers in mlp_layer_types "
                                    "is not supported (an MoE layer needs experts)")
    return moe


def _all_full(c: RawConfig, n_layers: int) -> list[str]:
    """DeepSeek-V3.2: every layer runs its own indexer."""
    return ["full"] * n_layers


def parse_dsa_config(raw: dict, defaults: dict, family: str, name: str, indexer_types=_all_full,
                     index_interleave: bool = False) -> Config:
    """The config of a model with DeepSeek sparse attention (DeepSeek-V3.2's layout) of ``family``
    (``name`` in messages): ``defaults`` its transformers config's defaults, ``indexer_types(c,
    n_layers)`` each layer's indexer mode, ``index_interleave`` the indexer's RoPE layout."""
    c = RawConfig(raw)
    c.refuse("rope_interleave", (True,), f"transformers' {name} always rotates interleaved pairs in MLA and "
             "ignores rope_interleave")
    if "q_lora_rank" in raw and raw["q_lora_rank"] is None:
        raise UnsupportedModelError(f"config.json: q_lora_rank=None is not supported ({name} always has the "
                                    "low-rank query: its indexer reads the normalised q_a_proj output)")
    n_layers = c.layers()
    layer_types = raw.get("layer_types")
    if layer_types is not None and (not isinstance(layer_types, list) or len(layer_types) < n_layers
                                    or any(t != "indexed_attention" for t in layer_types[:n_layers])):
        raise c.bad("layer_types", layer_types, f"\"indexed_attention\" for each of the {n_layers} layers "
                    f"(every {name} layer is sparse attention)")
    if "num_experts" in c:  # transformers' backward-compatible key wins over n_routed_experts
        raw = dict(raw, n_routed_experts=c.int("num_experts", lo=0))
    base = deepseek_v3.parse_mla_config(raw, defaults, family, name, _moe_layers)
    d = c.pos_int("index_head_dim", defaults["index_head_dim"], hi=MAX_HEAD_DIM)
    if d < base.qk_rope_head_dim:
        raise UnsupportedModelError(f"config.json: index_head_dim={d} is not supported: the indexer rotates its "
                                    f"first qk_rope_head_dim={base.qk_rope_head_dim} dims")
    types = indexer_types(c, n_layers)
    return Config(**{f.name: getattr(base, f.name) for f in fields(deepseek_v3.Config)},
                  index_topk=c.pos_int("index_topk", defaults["index_topk"], hi=MAX_POSITIONS),
                  index_head_dim=d, index_n_heads=c.pos_int("index_n_heads", defaults["index_n_heads"], hi=MAX_HEADS),
                  index_interleave=index_interleave, indexer_types=tuple(types))


def parse_config(raw: dict) -> Config:
    return parse_dsa_config(raw, _DEFAULTS, MODEL_TYPE, "DeepSeek-V3.2")


def declare(cfg: Config) -> Model:
    args = deepseek_v3.mla_args(cfg)
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    parts = {}

    def attention(i: int):
        source = cfg.index_source(i)
        if source not in parts:  # one part per distinct source (None: a layer with its own indexer)
            parts[source] = dsa_mla(h, heads, topk=cfg.index_topk, index_heads=cfg.index_n_heads,
                                    index_head_dim=cfg.index_head_dim, index_interleave=cfg.index_interleave,
                                    source=source, **args)
        return parts[source]

    return deepseek_v3.declare(cfg, attention)


def notes(cfg: Config) -> tuple[str, ...]:
    rope = "interleaved-pair" if cfg.index_interleave else "rotate-half"
    out = [f"DeepSeek sparse attention: a query that sees more than index_topk={cfg.index_topk} positions attends "
           f"over the {cfg.index_topk} its lightning indexer selects ({cfg.index_n_heads} heads x "
           f"{cfg.index_head_dim}, {rope} RoPE); indexer keys: {cfg.index_head_dim} floats per position per "
           "indexer layer"]
    shared = cfg.indexer_types.count("shared")
    if shared:
        out.append(f"{shared} of {cfg.num_hidden_layers} layers reuse the previous full layer's selection "
                   "(indexer_types \"shared\": no indexer of their own)")
    return tuple(out)


def describe(cfg: Config) -> ModelDescription:
    return deepseek_v3.describe(cfg, declare(cfg), notes(cfg))


def build(cfg: Config, w, experts) -> CausalLM:
    return declare(cfg).build(w, experts)

