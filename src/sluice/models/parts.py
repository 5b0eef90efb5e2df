"""What each layer kind of ``layers/`` needs and keeps, as a ``declare.Part``: its tensors
(relative to its prefix, shapes from the config), how it is built from them, and its state.

One function per kind: ``rms_norm``, ``attention`` (GQA, optional window, sinks, clipping, q/k
norms), ``gated_attention`` (Qwen3-Next, Qwen3.5), ``mla`` (DeepSeek-V3, Kimi Linear),
``dsa_mla`` (MLA with DeepSeek sparse attention's indexer: DeepSeek-V3.2, GLM-5),
``gated_delta`` (Gated DeltaNet, fused or split projections), ``kimi_delta`` (KDA),
``gated_mlp``, the routers (``softmax_router``, ``grouped_router``, ``topk_softmax_router``)
and ``moe`` (a router, optional shared experts and their gate, the routed experts through the
expert interface).
"""

from __future__ import annotations

from ..layers.attention import Attention, KVCache, WindowKVCache
from ..layers.dsa import SparseMLA
from ..layers.gated_attention import GatedAttention
from ..layers.gated_delta import (DECAY_BLOCK_BYTES, SNAPSHOTS, GatedDeltaNet, KimiDeltaAttention, LinearState,
                                  SplitGatedDeltaNet)
from ..layers.indexer import IndexKeys, LightningIndexer, PooledIndexer
from ..layers.mla import MLA, LatentCache
from ..layers.mlp import GatedMLP
from ..layers.norm import RMSNorm
from ..layers.routing import GroupedRouter, SoftmaxRouter, TopKSoftmaxRouter
from .base import MoEBlock
from .declare import Lin, Part


def rms_norm(dim: int, eps: float, offset: float = 0.0, name: str = "weight") -> Part:
    return Part({name: (dim,)}, lambda t: RMSNorm(t(name), eps, offset=offset))


def _kv_state(n_kv: int, head_dim: int, window: int | None, v_head_dim: int | None = None) -> dict[str, int]:
    per = KVCache.nbytes(n_kv, 1, head_dim, v_head_dim)
    if window is None:
        return dict(kv_per_token=per)
    return dict(window_per_token=per, window_positions=WindowKVCache.positions(window))


def attention(hidden: int, n_heads: int, n_kv: int, head_dim: int, eps: float, *, bias: bool = False,
              qk_norm: str | None = None, window: int | None = None, clip_qkv: float | None = None,
              sinks: bool = False, bias_in_tail: bool = False, prefix: str = "self_attn.",
              v_head_dim: int | None = None, v_scale: float | None = None, sinks_name: str = "sinks",
              o_bias: bool = True, rope: str = "half", norm_names: tuple[str, str] = ("q_norm", "k_norm"),
              norm_after_rope: bool = False) -> Part:
    """GQA (``layers.attention.Attention``); ``qk_norm``: None, "head" (per head) or "full" (whole
    projection), the norms named ``norm_names`` (Hunyuan: query_layernorm, key_layernorm) and,
    with ``norm_after_rope``, applied to the rotated heads; ``bias_in_tail``: the biases are listed
    after the layer's other tensors (GPT-OSS); ``v_head_dim``: value heads narrower or wider than
    ``head_dim`` (v_proj [Hkv x Dv, H], o_proj [H, Hq x Dv]); ``v_scale``: the values' constant
    factor; ``sinks_name``: the learned sinks' tensor name; ``o_bias``: with ``bias``, o_proj has
    one too (MiMo-V2-Flash's has none); ``rope``: "half" (rotate-half) or "pairs" (GPT-J pairs,
    ERNIE-4.5). The projections are linears (``Lin``): a family's weight format (block FP8)
    applies to them."""
    dv = v_head_dim or head_dim
    nq, nkv, nv, no = n_heads * head_dim, n_kv * head_dim, n_kv * dv, n_heads * dv
    p = prefix
    qn, kn = p + norm_names[0] + ".weight", p + norm_names[1] + ".weight"
    tensors = {p + "q_proj": Lin((nq, hidden)), p + "k_proj": Lin((nkv, hidden)),
               p + "v_proj": Lin((nv, hidden)), p + "o_proj": Lin((hidden, no))}
    if sinks:
        tensors[p + sinks_name] = (n_heads,)
    if qk_norm == "head":
        tensors.update({qn: (head_dim,), kn: (head_dim,)})
    elif qk_norm == "full":
        tensors.update({qn: (nq,), kn: (nkv,)})
    biases = {p + "q_proj.bias": (nq,), p + "k_proj.bias": (nkv,), p + "v_proj.bias": (nv,)} if bias else {}
    if bias and o_bias:
        biases[p + "o_proj.bias"] = (hidden,)
    extra = {} if rope == "half" else {"rope": rope}
    if v_head_dim is not None:
        extra["v_head_dim"] = v_head_dim
    if v_scale is not None:
        extra["v_scale"] = v_scale
    if window is not None:
        extra["window"] = window
    if clip_qkv is not None:
        extra["clip_qkv"] = clip_qkv
    if qk_norm is not None:
        extra.update(qk_norm=qk_norm, norm_eps=eps)
    if norm_after_rope:
        extra["norm_after_rope"] = True

    def make(t):
        kw = dict(extra)
        if qk_norm is not None:
            kw.update(q_norm=t(qn), k_norm=t(kn))
        if sinks:
            kw["sinks"] = t(p + sinks_name)
        return Attention(wq=t.lin(p + "q_proj"), wk=t.lin(p + "k_proj"), wv=t.lin(p + "v_proj"),
                         wo=t.lin(p + "o_proj"), bq=t.opt(p + "q_proj.bias"), bk=t.opt(p + "k_proj.bias"),
                         bv=t.opt(p + "v_proj.bias"), bo=t.opt(p + "o_proj.bias"), n_heads=n_heads, n_kv=n_kv,
                         head_dim=head_dim, **kw)

    state = _kv_state(n_kv, head_dim, window, dv)
    if bias_in_tail:
        return Part(tensors, make, tail=biases, **state)
    return Part({**tensors, **biases}, make, **state)


def gated_attention(hidden: int, n_heads: int, n_kv: int, head_dim: int, eps: float, *, bias: bool = False,
                    norm_offset: float = 1.0) -> Part:
    """Qwen3-Next's full attention: q_proj also yields the sigmoid output gate (2 x the query width)."""
    nq, nkv, p = n_heads * head_dim, n_kv * head_dim, "self_attn."
    tensors = {p + "q_proj": Lin((2 * nq, hidden)), p + "k_proj": Lin((nkv, hidden)),
               p + "v_proj": Lin((nkv, hidden)), p + "o_proj": Lin((hidden, nq)),
               p + "q_norm.weight": (head_dim,), p + "k_norm.weight": (head_dim,)}
    if bias:
        tensors.update({p + "q_proj.bias": (2 * nq,), p + "k_proj.bias": (nkv,), p + "v_proj.bias": (nkv,),
                        p + "o_proj.bias": (hidden,)})

    def make(t):
        return GatedAttention(
            wq=t.lin(p + "q_proj"), wk=t.lin(p + "k_proj"), wv=t.lin(p + "v_proj"),
            wo=t.lin(p + "o_proj"), bq=t.opt(p + "q_proj.bias"), bk=t.opt(p + "k_proj.bias"),
            bv=t.opt(p + "v_proj.bias"), bo=t.opt(p + "o_proj.bias"), n_heads=n_heads, n_kv=n_kv,
            head_dim=head_dim, q_norm=t(p + "q_norm.weight"), k_norm=t(p + "k_norm.weight"), norm_eps=eps,
            norm_offset=norm_offset)

    return Part(tensors, make, **_kv_state(n_kv, head_dim, None))


def mla(hidden: int, n_heads: int, *, q_lora_rank: int | None, kv_lora_rank: int, qk_nope_head_dim: int,
        qk_rope_head_dim: int, v_head_dim: int, bias: bool, scale: float, interleave: bool, norm_eps: float,
        cls=MLA, bias_inline: bool = True, extra=None) -> Part:
    """Multi-head latent attention (``layers.mla.MLA`` or a subclass ``cls``), a latent cache of
    ``kv_lora_rank + qk_rope_head_dim`` floats per position. ``bias_inline``: each bias listed
    right after its weight (DeepSeek-V3), else after the query tensors / at the end (Kimi Linear);
    ``extra(t)``: more keyword arguments of ``cls`` built from the part's tensors (``dsa_mla``)."""
    p, dn, dr, dv, r = "self_attn.", qk_nope_head_dim, qk_rope_head_dim, v_head_dim, kv_lora_rank
    tensors: dict = {}

    def lin(module, shape, has_bias=False, late=None):
        tensors[p + module] = Lin(shape)
        if has_bias:
            (tensors if bias_inline else late)[p + module + ".bias"] = (shape[0],)

    q_late: dict = {}
    late: dict = {}
    if q_lora_rank is None:
        lin("q_proj", (n_heads * (dn + dr), hidden))
    else:
        lin("q_a_proj", (q_lora_rank, hidden), bias, q_late)
        tensors[p + "q_a_layernorm.weight"] = (q_lora_rank,)
        lin("q_b_proj", (n_heads * (dn + dr), q_lora_rank))
    tensors.update(q_late)
    lin("kv_a_proj_with_mqa", (r + dr, hidden), bias, late)
    tensors[p + "kv_a_layernorm.weight"] = (r,)
    lin("kv_b_proj", (n_heads * (dn + dv), r))
    lin("o_proj", (hidden, n_heads * dv), bias, late)
    tensors.update(late)

    def make(t):
        q = dict(wq=t.lin(p + "q_proj")) if q_lora_rank is None else dict(
            wq_a=t.lin(p + "q_a_proj"), bq_a=t.opt(p + "q_a_proj.bias"), q_a_norm=t(p + "q_a_layernorm.weight"),
            wq_b=t.lin(p + "q_b_proj"))
        return cls(**q, wkv_a=t.lin(p + "kv_a_proj_with_mqa"), bkv_a=t.opt(p + "kv_a_proj_with_mqa.bias"),
                   kv_a_norm=t(p + "kv_a_layernorm.weight"), wkv_b=t.lin(p + "kv_b_proj"), wo=t.lin(p + "o_proj"),
                   bo=t.opt(p + "o_proj.bias"), n_heads=n_heads, kv_lora_rank=r, qk_nope_head_dim=dn,
                   qk_rope_head_dim=dr, v_head_dim=dv, scale=scale, interleave=interleave, norm_eps=norm_eps,
                   **(extra(t) if extra is not None else {}))

    return Part(tensors, make, kv_per_token=LatentCache.nbytes(1, r, dr))


def dsa_mla(hidden: int, n_heads: int, *, topk: int, index_heads: int, index_head_dim: int, index_interleave: bool,
            source: int | None = None, kpool: int | None = None, weights_proj_linear: bool = False,
            **mla_args) -> Part:
    """MLA with DeepSeek sparse attention (``layers.dsa.SparseMLA``): ``mla``'s tensors, then the
    lightning indexer's at ``self_attn.indexer.`` (``wq_b``, ``wk``, the LayerNorm ``k_norm`` with
    its bias, ``weights_proj``, which transformers keeps unquantized: a plain tensor; with
    ``weights_proj_linear`` a linear like the others, for a model that keeps no module in fp32) and
    its keys, ``index_head_dim`` floats per position more. ``source``: no indexer, the selection of that
    earlier layer reused (GLM-5's ``"shared"`` layers; the latent cache only). ``kpool``: the indexer
    scores pools of that many positions (``layers.indexer.PooledIndexer``, GLM-5.3-Flash: with
    ``index_kpool_compress_ape`` [P, D] and ``index_kpool_compress_gate`` [D, H], 2 D floats per
    position and D per complete pool)."""
    base = mla(hidden, n_heads, cls=SparseMLA, extra=lambda t: extra(t), **mla_args)
    p, d, q_rank = "self_attn.indexer.", index_head_dim, mla_args["q_lora_rank"]
    weights = ({p + "weights_proj": Lin((index_heads, hidden))} if weights_proj_linear
               else {p + "weights_proj.weight": (index_heads, hidden)})
    tensors = {} if source is not None else {
        p + "wq_b": Lin((index_heads * d, q_rank)), p + "wk": Lin((d, hidden)), p + "k_norm.weight": (d,),
        p + "k_norm.bias": (d,), **weights}
    if kpool is not None and source is None:
        tensors.update({p + "index_kpool_compress_ape": (kpool, d), p + "index_kpool_compress_gate": (d, hidden)})

    def proj(t):
        return t.lin(p + "weights_proj") if weights_proj_linear else t(p + "weights_proj.weight")

    def extra(t):
        if source is not None:
            return dict(source=source)
        if kpool is not None:
            return dict(indexer=PooledIndexer(
                wq_b=t.lin(p + "wq_b"), wk=t.lin(p + "wk"), weights_proj=proj(t),
                k_norm_weight=t(p + "k_norm.weight"), k_norm_bias=t(p + "k_norm.bias"), n_heads=index_heads,
                head_dim=d, topk=topk, compress_gate=t(p + "index_kpool_compress_gate"),
                ape=t(p + "index_kpool_compress_ape"), pool=kpool))
        return dict(indexer=LightningIndexer(
            wq_b=t.lin(p + "wq_b"), wk=t.lin(p + "wk"), weights_proj=proj(t),
            k_norm_weight=t(p + "k_norm.weight"), k_norm_bias=t(p + "k_norm.bias"), n_heads=index_heads,
            head_dim=d, topk=topk, interleave=index_interleave))

    keys = 0 if source is not None else IndexKeys.nbytes(1, d if kpool is None else 2 * d)
    # a pooled indexer also keeps each complete pool's key (``PooledKeys.pools``): D floats per P positions
    pools = {kpool: 4 * d} if kpool is not None and source is None else {}
    return Part({**base.tensors, **tensors}, base.make, kv_per_token=base.kv_per_token + keys, entries=pools)


def _recurrent(one: int) -> dict[str, int]:
    """A linear-attention layer's state: one state and its ``SNAPSHOTS`` snapshots per sequence;
    a forward's transients, a few copies of one layer's state."""
    return dict(fixed=one * (1 + SNAPSHOTS), transient=4 * one)


def gated_delta(hidden: int, *, n_k: int, n_v: int, dk: int, dv: int, kernel: int, act: str, eps: float,
                split: bool = False, gate: str = "silu") -> Part:
    """Gated DeltaNet (``layers.gated_delta.GatedDeltaNet``) at ``linear_attn.``: the fused
    ``in_proj_qkvz`` / ``in_proj_ba`` (Qwen3-Next), or with ``split`` Qwen3.5's ``in_proj_qkv``,
    ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` (``SplitGatedDeltaNet``)."""
    p, kd, vd = "linear_attn.", n_k * dk, n_v * dv
    channels = 2 * kd + vd
    if split:
        proj = {p + "in_proj_qkv": Lin((channels, hidden)), p + "in_proj_z": Lin((vd, hidden)),
                p + "in_proj_b": Lin((n_v, hidden)), p + "in_proj_a": Lin((n_v, hidden))}
    else:
        proj = {p + "in_proj_qkvz": Lin((2 * kd + 2 * vd, hidden)), p + "in_proj_ba": Lin((2 * n_v, hidden))}
    tensors = {**proj, p + "conv1d.weight": (channels, 1, kernel), p + "A_log": (n_v,), p + "dt_bias": (n_v,),
               p + "norm.weight": (dv,), p + "out_proj": Lin((hidden, vd))}

    def make(t):
        common = dict(conv_weight=t(p + "conv1d.weight"), a_log=t(p + "A_log"), dt_bias=t(p + "dt_bias"),
                      norm_weight=t(p + "norm.weight"), w_out=t.lin(p + "out_proj"),
                      n_k=n_k, n_v=n_v, dk=dk, dv=dv, act=act, eps=eps, gate=gate)
        if split:
            return SplitGatedDeltaNet(w_qkv=t.lin(p + "in_proj_qkv"), w_z=t.lin(p + "in_proj_z"),
                                      w_b=t.lin(p + "in_proj_b"), w_a=t.lin(p + "in_proj_a"), **common)
        return GatedDeltaNet(w_qkvz=t.lin(p + "in_proj_qkvz"), w_ba=t.lin(p + "in_proj_ba"), **common)

    return Part(tensors, make, **_recurrent(LinearState.nbytes(channels, kernel, n_v, dk, dv)))


def kimi_delta(hidden: int, *, heads: int, head_dim: int, kernel: int, act: str, eps: float,
               lower_bound: float | None = None, a_log_shape: tuple[int, ...] | None = None) -> Part:
    """Kimi Delta Attention (``layers.gated_delta.KimiDeltaAttention``) at ``self_attn.``; its
    forward also builds bounded per-channel decay blocks. ``lower_bound``: GLM-5.3-Flash's bounded
    forget gate; ``a_log_shape``: ``A_log``'s stored shape (Kimi's [1, 1, H, 1] by default)."""
    p, d = "self_attn.", head_dim
    qkv = heads * d
    tensors = {p + "q_proj": Lin((qkv, hidden)), p + "k_proj": Lin((qkv, hidden)),
               p + "v_proj": Lin((qkv, hidden)), p + "q_conv1d.weight": (qkv, 1, kernel),
               p + "k_conv1d.weight": (qkv, 1, kernel), p + "v_conv1d.weight": (qkv, 1, kernel),
               p + "f_a_proj": Lin((d, hidden)), p + "f_b_proj": Lin((qkv, d)), p + "dt_bias": (qkv,),
               p + "A_log": a_log_shape or (1, 1, heads, 1), p + "b_proj": Lin((heads, hidden)),
               p + "g_a_proj": Lin((d, hidden)),
               p + "g_b_proj": Lin((qkv, d)), p + "o_norm.weight": (d,), p + "o_proj": Lin((hidden, qkv))}

    def make(t):
        return KimiDeltaAttention(
            wq=t.lin(p + "q_proj"), wk=t.lin(p + "k_proj"), wv=t.lin(p + "v_proj"),
            q_conv=t(p + "q_conv1d.weight"), k_conv=t(p + "k_conv1d.weight"), v_conv=t(p + "v_conv1d.weight"),
            f_a=t.lin(p + "f_a_proj"), f_b=t.lin(p + "f_b_proj"), a_log=t(p + "A_log"),
            dt_bias=t(p + "dt_bias"), w_b=t.lin(p + "b_proj"), g_a=t.lin(p + "g_a_proj"),
            g_b=t.lin(p + "g_b_proj"), norm_weight=t(p + "o_norm.weight"), w_out=t.lin(p + "o_proj"),
            n_heads=heads, head_dim=head_dim, act=act, eps=eps, lower_bound=lower_bound)

    one = LinearState.nbytes(3 * qkv, kernel, heads, d, d)
    state = _recurrent(one)
    state["transient"] += 3 * min(DECAY_BLOCK_BYTES, 4 * heads * 64 * 64 * d)
    return Part(tensors, make, **state)


def gated_mlp(hidden: int, intermediate: int, act: str, prefix: str = "mlp.", bias: bool = False,
              limit: float | None = None) -> Part:
    """``layers.mlp.GatedMLP``: gate_proj, up_proj [I, H], down_proj [H, I] under ``prefix``;
    ``bias``: each with its ``.bias`` right after its weight (ERNIE-4.5's ``use_bias``); ``limit``:
    the clamped SwiGLU (``swiglu_limit``: GLM-5.3-Flash)."""
    p, names = prefix, ("gate_proj", "up_proj", "down_proj")
    shapes = {"gate_proj": (intermediate, hidden), "up_proj": (intermediate, hidden),
              "down_proj": (hidden, intermediate)}
    tensors: dict = {}
    for n in names:
        tensors[p + n] = Lin(shapes[n])
        if bias:
            tensors[p + n + ".bias"] = (shapes[n][0],)

    def make(t):
        return GatedMLP(*(t.lin(p + n) for n in names), act, biases=tuple(t.opt(p + n + ".bias") for n in names),
                        limit=limit)

    return Part(tensors, make)


def softmax_router(n_experts: int, hidden: int, top_k: int, normalize: bool, *, weight: str = "weight",
                   correction: str | None = None, correction_shape: tuple[int, ...] | None = None,
                   norm_min: float | None = None) -> Part:
    """``SoftmaxRouter``; ``correction``: the name of a selection-only correction bias (shape
    ``correction_shape``, default [E]) and ``norm_min`` the renormalisation's clamp (ERNIE-4.5:
    ``moe(softmax_router(..., weight="gate.weight", correction="moe_statics.e_score_correction_bias",
    correction_shape=(1, E)), router_name="")``)."""
    tensors = {weight: (n_experts, hidden)}
    if correction is not None:
        tensors[correction] = correction_shape or (n_experts,)
    return Part(tensors, lambda t: SoftmaxRouter(t(weight), top_k, normalize=normalize, norm_min=norm_min,
                                                 correction=t(correction) if correction is not None else None))


def grouped_router(n_experts: int, hidden: int, top_k: int, *, weight: str = "weight",
                   bias: str = "e_score_correction_bias", **kw) -> Part:
    """``GroupedRouter`` with its selection-only correction bias (``e_score_correction_bias``).
    ``weight`` / ``bias``: their names under the router's prefix (MiniMax-M2 keeps the bias on
    the MoE block: ``moe(grouped_router(..., weight="gate.weight"), router_name="")``)."""
    return Part({weight: (n_experts, hidden), bias: (n_experts,)},
                lambda t: GroupedRouter(t(weight), top_k, correction=t(bias), **kw))


def topk_softmax_router(n_experts: int, hidden: int, top_k: int) -> Part:
    """GPT-OSS: a linear router with a bias, softmax over the top-k logits."""
    return Part({"weight": (n_experts, hidden), "bias": (n_experts,)},
                lambda t: TopKSoftmaxRouter(t("weight"), top_k, t("bias")))


def moe(router: Part, *, prefix: str = "mlp.", router_name: str = "gate.", shared: Part | None = None,
        shared_name: str = "shared_experts.", shared_gate: int | None = None) -> Part:
    """An MoE block (``models.base.MoEBlock``) under ``prefix``: the router at ``router_name``,
    optional shared experts (a ``gated_mlp(..., prefix="")``) at ``shared_name`` and, with
    ``shared_gate`` (the hidden size), their sigmoid gate ``shared_expert_gate.weight`` [1, H].
    The routed experts are not spine tensors (``ModelDescription.expert_tensors``)."""
    r = router.nested(prefix + router_name)
    tensors = dict(r.tensors)
    s = shared.nested(prefix + shared_name) if shared is not None else None
    if s is not None:
        tensors.update(s.tensors)
    gate = prefix + "shared_expert_gate"
    if shared_gate is not None:
        tensors[gate] = Lin((1, shared_gate))

    def make(t):
        return MoEBlock(t.layer, r.make(t), t.experts, shared=s.make(t) if s is not None else None,
                        shared_gate=t.lin(gate) if shared_gate is not None else None)

    return Part(tensors, make, routed=True)
