"""Qwen3-MoE (``model_type: qwen3_moe``): GQA with per-head q/k RMSNorm, softmax top-k
routing with optional renormalisation, dense layers via ``mlp_only_layers`` and
``decoder_sparse_step``."""

from __future__ import annotations

from dataclasses import dataclass

from ..experts.spec import ExpertSpec
from ..layers.attention import Attention, KVCache
from ..layers.mlp import GatedMLP
from ..layers.norm import RMSNorm
from ..layers.rotary import Rotary, rope_parameters
from ..layers.routing import softmax_topk
from ..quant import linear
from .base import CausalLM, DecoderLayer, ModelDescription, MoEBlock, TensorRef
from .config import RawConfig

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


def parse_config(raw: dict) -> Config:
    c = RawConfig(raw)
    n_layers = c.int("num_hidden_layers")
    heads = c.int("num_attention_heads")
    hidden = c.int("hidden_size")
    n_experts = c.int("num_experts", None, "num_local_experts") or 0
    step = c.int("decoder_sparse_step", 1)
    mlp_only = c.get("mlp_only_layers", []) or []
    moe = [i for i in range(n_layers) if i not in mlp_only and n_experts > 0 and (i + 1) % step == 0]
    return Config(
        vocab_size=c.int("vocab_size"),
        hidden_size=hidden,
        intermediate_size=c.int("intermediate_size"),
        moe_intermediate_size=c.int("moe_intermediate_size"),
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=c.int("num_key_value_heads", heads),
        head_dim=c.int("head_dim", hidden // heads),
        hidden_act=c.get("hidden_act", "silu"),
        rms_norm_eps=c.float("rms_norm_eps", 1e-6),
        max_position_embeddings=c.int("max_position_embeddings", 32768),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        attention_bias=bool(c.get("attention_bias", False)),
        sliding_window=c.get("sliding_window", None) if c.get("use_sliding_window", False) else None,
        num_experts=n_experts,
        num_experts_per_tok=c.int("num_experts_per_tok"),
        norm_topk_prob=bool(c.get("norm_topk_prob", False)),
        moe_layers=moe,
        rope=rope_parameters(raw),
        raw=raw,
    )


def _prefix(i: int) -> str:
    return f"model.layers.{i}."


def describe(cfg: Config) -> ModelDescription:
    h, d = cfg.hidden_size, cfg.head_dim
    nq, nkv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    spine: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        spine["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_hidden_layers):
        p = _prefix(i)
        spine.update({
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (nq, h),
            p + "self_attn.k_proj.weight": (nkv, h),
            p + "self_attn.v_proj.weight": (nkv, h),
            p + "self_attn.o_proj.weight": (h, nq),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
        })
        if cfg.attention_bias:
            spine.update({p + "self_attn.q_proj.bias": (nq,), p + "self_attn.k_proj.bias": (nkv,),
                          p + "self_attn.v_proj.bias": (nkv,), p + "self_attn.o_proj.bias": (h,)})
        if i in cfg.moe_layers:
            spine[p + "mlp.gate.weight"] = (cfg.num_experts, h)
        else:
            im = cfg.intermediate_size
            spine.update({p + "mlp.gate_proj.weight": (im, h), p + "mlp.up_proj.weight": (im, h),
                          p + "mlp.down_proj.weight": (h, im)})
    spec = ExpertSpec(hidden=h, intermediate=cfg.moe_intermediate_size, act=cfg.hidden_act)
    shapes = spec.matrix_shapes()

    def expert_tensors(layer: int, e: int) -> dict[str, TensorRef]:
        p = f"{_prefix(layer)}mlp.experts.{e}."
        return {r: TensorRef(f"{p}{r}_proj.weight", shapes[r]) for r in ("gate", "up", "down")}

    return ModelDescription(
        model_type=MODEL_TYPE, n_layers=cfg.num_hidden_layers, hidden=h, vocab=cfg.vocab_size, spine=spine,
        moe_layers=cfg.moe_layers, n_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok, expert=spec,
        expert_tensors=expert_tensors, state_bytes_per_token=KVCache.nbytes(cfg.num_key_value_heads, 1, d) * cfg.num_hidden_layers,
        max_position_embeddings=cfg.max_position_embeddings, attn_heads=cfg.num_attention_heads,
    )


def build(cfg: Config, w, experts) -> CausalLM:
    layers = []
    for i in range(cfg.num_hidden_layers):
        p = _prefix(i)
        bias = (lambda n: w(p + f"self_attn.{n}_proj.bias")) if cfg.attention_bias else (lambda n: None)
        attn = Attention(
            wq=w(p + "self_attn.q_proj.weight"), wk=w(p + "self_attn.k_proj.weight"),
            wv=w(p + "self_attn.v_proj.weight"), wo=w(p + "self_attn.o_proj.weight"),
            bq=bias("q"), bk=bias("k"), bv=bias("v"), bo=bias("o"),
            n_heads=cfg.num_attention_heads, n_kv=cfg.num_key_value_heads, head_dim=cfg.head_dim,
            qk_norm="head", q_norm=w(p + "self_attn.q_norm.weight"), k_norm=w(p + "self_attn.k_norm.weight"),
            norm_eps=cfg.rms_norm_eps, window=cfg.sliding_window,
        )
        if i in cfg.moe_layers:
            router_w = w(p + "mlp.gate.weight")
            k, norm = cfg.num_experts_per_tok, cfg.norm_topk_prob
            mlp = MoEBlock(i, lambda x, bias=None, rw=router_w: softmax_topk(linear(x, rw), k, norm, bias), experts)
        else:
            mlp = GatedMLP(w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight"), w(p + "mlp.down_proj.weight"),
                           cfg.hidden_act)
        layers.append(DecoderLayer(RMSNorm(w(p + "input_layernorm.weight"), cfg.rms_norm_eps), attn,
                                   RMSNorm(w(p + "post_attention_layernorm.weight"), cfg.rms_norm_eps), mlp))
    embed = w("model.embed_tokens.weight")
    head = embed if cfg.tie_word_embeddings else w("lm_head.weight")
    rotary = Rotary(cfg.head_dim, cfg.rope, cfg.max_position_embeddings)
    return CausalLM(embed, layers, RMSNorm(w("model.norm.weight"), cfg.rms_norm_eps), head, rotary)
