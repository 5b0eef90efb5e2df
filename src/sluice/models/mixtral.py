"""Mixtral (``model_type: mixtral``): GQA, optional sliding window, softmax top-k routing
always renormalised over the chosen experts; experts ``w1`` (gate), ``w3`` (up), ``w2`` (down)."""

from __future__ import annotations

from dataclasses import dataclass

from ..experts.spec import ExpertSpec
from ..layers.rotary import Rotary, rope_parameters
from .base import CausalLM, ModelDescription
from .config import REQUIRED, MAX_EXPERTS, MAX_POSITIONS, RawConfig, check_rope
from .declare import Layer, Model
from .parts import attention, moe, rms_norm, softmax_router
from .weight_format import PLAIN, WeightFormat

MODEL_TYPE = "mixtral"
_ROLE_NAMES = {"gate": "w1", "up": "w3", "down": "w2"}


@dataclass
class Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_act: str
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    sliding_window: int | None
    num_experts: int
    num_experts_per_tok: int
    rope: dict
    weights: WeightFormat = PLAIN


def parse_config(raw: dict) -> Config:
    c = RawConfig(raw)
    n_layers = c.layers()
    hidden = c.pos_int("hidden_size")
    heads, kv, head_dim = c.heads(hidden)
    n_experts = c.pos_int("num_local_experts", REQUIRED, "num_experts", hi=MAX_EXPERTS)
    act = c.act()
    return Config(
        vocab_size=c.pos_int("vocab_size"),
        hidden_size=hidden,
        intermediate_size=c.pos_int("intermediate_size"),
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        hidden_act=act,
        rms_norm_eps=c.eps(1e-5),
        max_position_embeddings=c.pos_int("max_position_embeddings", 4096 * 32, hi=MAX_POSITIONS),
        tie_word_embeddings=c.bool("tie_word_embeddings", False),
        sliding_window=c.sliding_window(),
        num_experts=n_experts,
        num_experts_per_tok=c.top_k("num_experts_per_tok", n_experts),
        rope=check_rope(rope_parameters({"rope_theta": 1e6, **raw})),
        weights=WeightFormat(raw.get("quantization_config"), c.where),
    )


def declare(cfg: Config) -> Model:
    h, eps = cfg.hidden_size, cfg.rms_norm_eps
    layers = [Layer(i, rms_norm(h, eps), rms_norm(h, eps),
                    attention(h, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, eps,
                              window=cfg.sliding_window),
                    moe(softmax_router(cfg.num_experts, h, cfg.num_experts_per_tok, normalize=True),
                        prefix="block_sparse_moe."))
              for i in range(cfg.num_hidden_layers)]
    return Model(cfg.vocab_size, h, layers, rms_norm(h, eps), cfg.tie_word_embeddings,
                 lambda: Rotary(cfg.head_dim, cfg.rope, cfg.max_position_embeddings), weights=cfg.weights)


def describe(cfg: Config) -> ModelDescription:
    spec = ExpertSpec(hidden=cfg.hidden_size, intermediate=cfg.intermediate_size, act=cfg.hidden_act)
    model = declare(cfg)
    return model.describe(
        model_type=MODEL_TYPE, n_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
        **model.routed_experts(spec, "model.layers.{layer}.block_sparse_moe.experts.{e}.{name}", _ROLE_NAMES),
        max_position_embeddings=cfg.max_position_embeddings, attn_heads=cfg.num_attention_heads,
    )


def build(cfg: Config, w, experts) -> CausalLM:
    return declare(cfg).build(w, experts)
