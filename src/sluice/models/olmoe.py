"""OLMoE (``model_type: olmoe``): GQA with q/k RMSNorm over the whole projection,
optional ``clip_qkv``, softmax top-k routing with optional renormalisation."""

from __future__ import annotations

from dataclasses import dataclass

from ..experts.spec import ExpertSpec
from ..layers.rotary import Rotary, rope_parameters
from .base import CausalLM, ModelDescription
from .config import REQUIRED, MAX_EXPERTS, MAX_POSITIONS, RawConfig, check_rope
from .declare import Layer, Model
from .parts import attention, moe, rms_norm, softmax_router
from .standard import PROJ_NAMES
from .weight_format import PLAIN, WeightFormat

MODEL_TYPE = "olmoe"


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
    attention_bias: bool
    clip_qkv: float | None
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    rope: dict
    weights: WeightFormat = PLAIN


def parse_config(raw: dict) -> Config:
    c = RawConfig(raw)
    n_layers = c.layers()
    hidden = c.pos_int("hidden_size")
    heads, kv, head_dim = c.heads(hidden)
    clip = c.float("clip_qkv", None, positive=True) if "clip_qkv" in c else None
    n_experts = c.pos_int("num_experts", REQUIRED, "num_local_experts", hi=MAX_EXPERTS)
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
        max_position_embeddings=c.pos_int("max_position_embeddings", 4096, hi=MAX_POSITIONS),
        tie_word_embeddings=c.bool("tie_word_embeddings", False),
        attention_bias=c.bool("attention_bias", False),
        clip_qkv=clip,
        num_experts=n_experts,
        num_experts_per_tok=c.top_k("num_experts_per_tok", n_experts),
        norm_topk_prob=c.bool("norm_topk_prob", False),
        rope=check_rope(rope_parameters(raw)),
        weights=WeightFormat(raw.get("quantization_config"), c.where),
    )


def declare(cfg: Config) -> Model:
    h, eps = cfg.hidden_size, cfg.rms_norm_eps
    layers = [Layer(i, rms_norm(h, eps), rms_norm(h, eps),
                    attention(h, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, eps,
                              bias=cfg.attention_bias, qk_norm="full", clip_qkv=cfg.clip_qkv),
                    moe(softmax_router(cfg.num_experts, h, cfg.num_experts_per_tok, cfg.norm_topk_prob)))
              for i in range(cfg.num_hidden_layers)]
    return Model(cfg.vocab_size, h, layers, rms_norm(h, eps), cfg.tie_word_embeddings,
                 lambda: Rotary(cfg.head_dim, cfg.rope, cfg.max_position_embeddings), weights=cfg.weights)


def describe(cfg: Config) -> ModelDescription:
    spec = ExpertSpec(hidden=cfg.hidden_size, intermediate=cfg.intermediate_size, act=cfg.hidden_act)
    model = declare(cfg)
    return model.describe(
        model_type=MODEL_TYPE, n_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
        **model.routed_experts(spec, "model.layers.{layer}.mlp.experts.{e}.{name}", PROJ_NAMES),
        max_position_embeddings=cfg.max_position_embeddings, attn_heads=cfg.num_attention_heads,
    )


def build(cfg: Config, w, experts) -> CausalLM:
    return declare(cfg).build(w, experts)
