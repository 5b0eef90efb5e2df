"""Qwen3-MoE (``model_type: qwen3_moe``): GQA with per-head q/k RMSNorm, softmax top-k
routing with optional renormalisation, dense layers via ``mlp_only_layers`` and
``decoder_sparse_step``."""

from __future__ import annotations

from dataclasses import dataclass

from ..experts.spec import ExpertSpec
from ..layers.rotary import Rotary, rope_parameters
from .base import CausalLM, ModelDescription
from .config import MAX_EXPERTS, MAX_LAYERS, MAX_POSITIONS, RawConfig, check_rope
from .declare import Layer, Model
from .parts import attention, gated_mlp, moe, rms_norm, softmax_router
from .standard import PROJ_NAMES
from .weight_format import PLAIN, WeightFormat

MODEL_TYPE = "qwen3_moe"


@dataclass
class Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_act: str
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    sliding_window: int | None
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    moe_layers: list[int]
    rope: dict
    raw: dict
    weights: WeightFormat = PLAIN


def parse_config(raw: dict) -> Config:
    c = RawConfig(raw)
    n_layers = c.layers()
    hidden = c.pos_int("hidden_size")
    heads, kv, head_dim = c.heads(hidden)
    n_experts = c.int("num_experts", 0, "num_local_experts", lo=0, hi=MAX_EXPERTS)
    step = c.pos_int("decoder_sparse_step", 1, hi=MAX_LAYERS)
    mlp_only = set(c.int_list("mlp_only_layers", (), lo=0))
    moe = [i for i in range(n_layers) if i not in mlp_only and n_experts > 0 and (i + 1) % step == 0]
    top_k = c.top_k("num_experts_per_tok", n_experts) if n_experts else c.int("num_experts_per_tok", 0)
    act = c.act()
    return Config(
        vocab_size=c.pos_int("vocab_size"),
        hidden_size=hidden,
        intermediate_size=c.pos_int("intermediate_size"),
        moe_intermediate_size=c.pos_int("moe_intermediate_size"),
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        hidden_act=act,
        rms_norm_eps=c.eps(1e-6),
        max_position_embeddings=c.pos_int("max_position_embeddings", 32768, hi=MAX_POSITIONS),
        tie_word_embeddings=c.bool("tie_word_embeddings", False),
        attention_bias=c.bool("attention_bias", False),
        sliding_window=c.sliding_window() if c.bool("use_sliding_window", False) else None,
        num_experts=n_experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=c.bool("norm_topk_prob", False),
        moe_layers=moe,
        rope=check_rope(rope_parameters(raw)),
        raw=raw,
        weights=WeightFormat(raw.get("quantization_config"), c.where),
    )


def declare(cfg: Config) -> Model:
    h, eps = cfg.hidden_size, cfg.rms_norm_eps

    def mlp(i: int):
        if i in cfg.moe_layers:
            return moe(softmax_router(cfg.num_experts, h, cfg.num_experts_per_tok, cfg.norm_topk_prob))
        return gated_mlp(h, cfg.intermediate_size, cfg.hidden_act)

    layers = [Layer(i, rms_norm(h, eps), rms_norm(h, eps),
                    attention(h, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, eps,
                              bias=cfg.attention_bias, qk_norm="head", window=cfg.sliding_window), mlp(i))
              for i in range(cfg.num_hidden_layers)]
    return Model(cfg.vocab_size, h, layers, rms_norm(h, eps), cfg.tie_word_embeddings,
                 lambda: Rotary(cfg.head_dim, cfg.rope, cfg.max_position_embeddings), weights=cfg.weights)


def describe(cfg: Config) -> ModelDescription:
    spec = ExpertSpec(hidden=cfg.hidden_size, intermediate=cfg.moe_intermediate_size, act=cfg.hidden_act)
    model = declare(cfg)
    return model.describe(
        model_type=MODEL_TYPE, n_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
        **model.routed_experts(spec, "model.layers.{layer}.mlp.experts.{e}.{name}", PROJ_NAMES),
        max_position_embeddings=cfg.max_position_embeddings, attn_heads=cfg.num_attention_heads,
    )


def build(cfg: Config, w, experts) -> CausalLM:
    return declare(cfg).build(w, experts)
