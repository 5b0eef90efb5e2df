"""Pieces shared by families built on standard GQA attention (Mixtral, Qwen3-MoE, OLMoE, ...):
the spine tensor tables and the wiring of attention, norms and the head."""

from __future__ import annotations

from dataclasses import dataclass

from ..experts.spec import ExpertSpec, TensorRef
from ..layers.attention import Attention, KVCache, WindowKVCache
from ..layers.norm import RMSNorm
from .base import CausalLM, DecoderLayer


@dataclass(frozen=True)
class AttnShape:
    hidden: int
    n_heads: int
    n_kv: int
    head_dim: int
    bias: bool = False
    qk_norm: str | None = None  # None | "head" (per head, Qwen3) | "full" (whole projection, OLMoE)


def prefix(i: int) -> str:
    return f"model.layers.{i}."


def global_spine(vocab: int, hidden: int, tied: bool) -> dict[str, tuple[int, ...]]:
    spine = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not tied:
        spine["lm_head.weight"] = (vocab, hidden)
    return spine


def attention_spine(p: str, a: AttnShape) -> dict[str, tuple[int, ...]]:
    """Norms and attention tensors of one decoder layer (prefix ``p``)."""
    h, nq, nkv = a.hidden, a.n_heads * a.head_dim, a.n_kv * a.head_dim
    out = {
        p + "input_layernorm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (nq, h),
        p + "self_attn.k_proj.weight": (nkv, h),
        p + "self_attn.v_proj.weight": (nkv, h),
        p + "self_attn.o_proj.weight": (h, nq),
    }
    if a.qk_norm == "head":
        out.update({p + "self_attn.q_norm.weight": (a.head_dim,), p + "self_attn.k_norm.weight": (a.head_dim,)})
    elif a.qk_norm == "full":
        out.update({p + "self_attn.q_norm.weight": (nq,), p + "self_attn.k_norm.weight": (nkv,)})
    if a.bias:
        out.update({p + "self_attn.q_proj.bias": (nq,), p + "self_attn.k_proj.bias": (nkv,),
                    p + "self_attn.v_proj.bias": (nkv,), p + "self_attn.o_proj.bias": (h,)})
    return out


def build_attention(w, p: str, a: AttnShape, eps: float, **extra) -> Attention:
    def opt(name):
        return w(p + name) if a.bias else None

    return Attention(
        wq=w(p + "self_attn.q_proj.weight"), wk=w(p + "self_attn.k_proj.weight"),
        wv=w(p + "self_attn.v_proj.weight"), wo=w(p + "self_attn.o_proj.weight"),
        bq=opt("self_attn.q_proj.bias"), bk=opt("self_attn.k_proj.bias"), bv=opt("self_attn.v_proj.bias"),
        bo=opt("self_attn.o_proj.bias"), n_heads=a.n_heads, n_kv=a.n_kv, head_dim=a.head_dim,
        qk_norm=a.qk_norm, q_norm=w(p + "self_attn.q_norm.weight") if a.qk_norm else None,
        k_norm=w(p + "self_attn.k_norm.weight") if a.qk_norm else None, norm_eps=eps, **extra,
    )


def kv_bytes_per_token(a: AttnShape, layers: int) -> int:
    return KVCache.nbytes(a.n_kv, 1, a.head_dim) * layers


def window_state(a: AttnShape, layers: int, window: int | None) -> dict[str, int]:
    """``ModelDescription`` state fields for ``layers`` attention layers, all with ``window``
    (None: full attention, KV for the whole context)."""
    if window is None:
        return {"state_bytes_per_token": kv_bytes_per_token(a, layers)}
    return {"state_bytes_per_token": 0, "window_bytes_per_token": kv_bytes_per_token(a, layers),
            "window_positions": WindowKVCache.positions(window)}


def expert_refs(spec: ExpertSpec, template: str, names: dict[str, str]):
    """``expert_tensors(layer, e)`` for per-expert tensors named ``template.format(layer=, e=, name=)``."""
    shapes = spec.matrix_shapes()

    def expert_tensors(layer: int, e: int) -> dict[str, TensorRef]:
        return {role: TensorRef(template.format(layer=layer, e=e, name=n), shapes[role]) for role, n in names.items()}

    return expert_tensors


def decoder_layer(w, p: str, eps: float, attn, mlp) -> DecoderLayer:
    return DecoderLayer(RMSNorm(w(p + "input_layernorm.weight"), eps), attn,
                        RMSNorm(w(p + "post_attention_layernorm.weight"), eps), mlp)


def causal_lm(w, layers: list[DecoderLayer], tied: bool, eps: float, rotary) -> CausalLM:
    embed = w("model.embed_tokens.weight")
    head = embed if tied else w("lm_head.weight")
    return CausalLM(embed, layers, RMSNorm(w("model.norm.weight"), eps), head, rotary)
