"""OLMoE (``model_type: olmoe``): GQA with q/k RMSNorm over the whole projection,
optional ``clip_qkv``, softmax top-k routing with optional renormalisation."""

from __future__ import annotations

from dataclasses import dataclass

from ..experts.spec import ExpertSpec
from ..layers.rotary import Rotary, rope_parameters
from ..layers.routing import SoftmaxRouter
from .base import CausalLM, ModelDescription, MoEBlock
from .config import RawConfig
from .standard import (AttnShape, attention_spine, build_attention, causal_lm, decoder_layer, expert_refs,
                       global_spine, kv_bytes_per_token, prefix)

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


def parse_config(raw: dict) -> Config:
    c = RawConfig(raw)
    heads = c.int("num_attention_heads")
    hidden = c.int("hidden_size")
    clip = c.get("clip_qkv", None)
    return Config(
        vocab_size=c.int("vocab_size"),
        hidden_size=hidden,
        intermediate_size=c.int("intermediate_size"),
        num_hidden_layers=c.int("num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=c.int("num_key_value_heads", heads),
        head_dim=c.int("head_dim", hidden // heads),
        hidden_act=c.get("hidden_act", "silu"),
        rms_norm_eps=c.float("rms_norm_eps", 1e-5),
        max_position_embeddings=c.int("max_position_embeddings", 4096),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        attention_bias=bool(c.get("attention_bias", False)),
        clip_qkv=float(clip) if clip is not None else None,
        num_experts=c.int("num_experts", None, "num_local_experts"),
        num_experts_per_tok=c.int("num_experts_per_tok"),
        norm_topk_prob=bool(c.get("norm_topk_prob", False)),
        rope=rope_parameters(raw),
    )


def _attn(cfg: Config) -> AttnShape:
    return AttnShape(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                     cfg.attention_bias, "full")


def describe(cfg: Config) -> ModelDescription:
    h, a = cfg.hidden_size, _attn(cfg)
    spine = global_spine(cfg.vocab_size, h, cfg.tie_word_embeddings)
    for i in range(cfg.num_hidden_layers):
        spine.update(attention_spine(prefix(i), a))
        spine[prefix(i) + "mlp.gate.weight"] = (cfg.num_experts, h)
    spec = ExpertSpec(hidden=h, intermediate=cfg.intermediate_size, act=cfg.hidden_act)
    return ModelDescription(
        model_type=MODEL_TYPE, n_layers=cfg.num_hidden_layers, hidden=h, vocab=cfg.vocab_size, spine=spine,
        moe_layers=list(range(cfg.num_hidden_layers)), n_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
        expert=spec,
        expert_tensors=expert_refs(spec, "model.layers.{layer}.mlp.experts.{e}.{name}.weight",
                                   {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
        state_bytes_per_token=kv_bytes_per_token(a, cfg.num_hidden_layers),
        max_position_embeddings=cfg.max_position_embeddings, attn_heads=cfg.num_attention_heads,
    )


def build(cfg: Config, w, experts) -> CausalLM:
    a, eps = _attn(cfg), cfg.rms_norm_eps
    layers = []
    for i in range(cfg.num_hidden_layers):
        p = prefix(i)
        attn = build_attention(w, p, a, eps, clip_qkv=cfg.clip_qkv)
        router = SoftmaxRouter(w(p + "mlp.gate.weight"), cfg.num_experts_per_tok, cfg.norm_topk_prob)
        layers.append(decoder_layer(w, p, eps, attn, MoEBlock(i, router, experts)))
    return causal_lm(w, layers, cfg.tie_word_embeddings, eps,
                     Rotary(cfg.head_dim, cfg.rope, cfg.max_position_embeddings))
