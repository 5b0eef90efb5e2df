"""Tencent Hy3 (``model_type: hy_v3``; Hy3, Hy3-preview).

GQA with per-head q/k RMSNorm before RoPE (full rotation of ``head_dim``, theta 11158840 by
default), optional q/k/v/o biases (``attention_bias``). MLPs by ``mlp_layer_types`` (by default
the first layer dense, the others MoE). An MoE block: sigmoid scores of an fp32 router
(``mlp.router.gate.weight`` in the checkpoints), the selection-only correction bias on the block
(``mlp.expert_bias``), top-k without groups, the chosen scores renormalised (+1e-20) and scaled
by ``router_scaling_factor``; one always-on shared MLP of ``num_shared_experts`` x
``moe_intermediate_size`` (``mlp.shared_mlp.*``); experts ``gate_proj`` / ``up_proj`` /
``down_proj`` per expert. Block-FP8 checkpoints (``weight_scale_inv``) stay FP8
(``models/weight_format.py``). The multi-token-prediction layer stored after the decoder layers
(``model.layers.<num_hidden_layers>.*``, ``num_nextn_predict_layers``) is not used.

Semantics follow transformers 5.24 (modeling_hy_v3.py, the oracle). The published config.json
also carries keys of Tencent's own code (``first_k_dense_replace``, ``expert_hidden_dim``,
``moe_router_use_sigmoid``, ``route_norm``, ``qk_norm``, ...), which transformers ignores: each
is accepted only where it agrees with what transformers computes, and refused otherwise.
Precision switches (``enable_moe_fp32_combine``, ``enable_lm_head_fp32``,
``enable_attention_fp32_softmax``) are read as booleans: Sluice computes in fp32 throughout.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UnsupportedModelError
from ..experts.spec import ExpertSpec
from ..layers.rotary import Rotary, rope_parameters
from .base import CausalLM, ModelDescription
from .config import MAX_EXPERTS, MAX_HEAD_DIM, MAX_HEADS, MAX_LAYERS, MAX_POSITIONS, RawConfig, check_rope, number
from .declare import Layer, Model
from .parts import attention, gated_mlp, grouped_router, moe, rms_norm
from .standard import PROJ_NAMES
from .weight_format import WeightFormat

MODEL_TYPE = "hy_v3"
MLP_TYPES = ("dense", "sparse")
DEFAULT_THETA = 11_158_840.0  # transformers' HYV3Config.default_theta
ROUTER = "router.gate.weight"  # the checkpoints' router (transformers' ``mlp.gate.weight``)
BIAS = "expert_bias"  # the checkpoints' correction bias (transformers' ``mlp.e_score_correction_bias``)
SHARED = "shared_mlp."  # the checkpoints' shared MLP (transformers' ``mlp.shared_experts``)
EXPERT_TEMPLATE = "model.layers.{layer}.mlp.experts.{e}.{name}"  # + ".weight" (+ its scales)

# keys of the published config.json that transformers' HYV3 ignores, with the values it computes
# as if they had (anything else would be silently different, so it is refused)
_IGNORED = {
    "moe_router_use_sigmoid": (True,),  # sigmoid scores
    "moe_router_enable_expert_bias": (True,),  # the correction bias always applies
    "route_norm": (True,),  # the chosen scores are always renormalised
    "qk_norm": (True,),  # q_norm / k_norm always apply
    "use_qk_norm": (True,),
    "use_cla": (False,),  # no cross-layer KV sharing
    "cla_share_factor": (1,),
    "use_sliding_window": (False,),
    "sliding_window": (),  # any window: transformers attends to the whole context
    "n_group": (1,),
    "topk_group": (1,),
}
_PRECISION = ("enable_moe_fp32_combine", "enable_lm_head_fp32", "enable_attention_fp32_softmax")


@dataclass
class Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense layers' MLP
    moe_intermediate_size: int  # each expert's
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attention_bias: bool
    hidden_act: str
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    mlp_layer_types: list[str]
    num_experts: int
    num_experts_per_tok: int
    num_shared_experts: int
    router_scaling_factor: float
    rope: dict
    mtp_layers: int  # model.layers.<n>.. after the decoder layers, not used
    weights: WeightFormat

    @property
    def moe_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.mlp_layer_types) if t == "sparse"]


def _mlp_types(c: RawConfig, n_layers: int) -> list[str]:
    v = c.raw.get("mlp_layer_types")
    if v is None:
        return ["dense"] * min(1, n_layers) + ["sparse"] * (n_layers - 1)
    if not isinstance(v, list) or len(v) != n_layers:
        raise c.bad("mlp_layer_types", v, f"a list of one MLP type per layer ({n_layers})")
    bad = sorted({repr(t) for t in v if t not in MLP_TYPES})
    if bad:
        raise UnsupportedModelError(f"config.json: mlp_layer_types has {', '.join(bad)}, which is not supported "
                                    f"(supported: {', '.join(MLP_TYPES)})")
    return list(v)


def _agrees(c: RawConfig, key: str, used, why: str) -> None:
    """Refuse an ignored key whose value differs from ``used`` (what transformers computes with)."""
    v = c.raw.get(key)
    if v is not None and v != used:
        raise UnsupportedModelError(f"config.json: {key}={v!r} is not supported: transformers ignores it and "
                                    f"computes with {used!r} ({why})")


def _rope(c: RawConfig, raw: dict) -> dict:
    rope = check_rope(rope_parameters({"rope_theta": DEFAULT_THETA, **raw}))
    partial = rope.pop("partial_rotary_factor", 1.0)
    if partial != 1.0:  # transformers' HYV3 rotates the whole head whatever this says
        raise UnsupportedModelError(f"config.json: partial_rotary_factor={partial!r} is not supported (transformers' "
                                    "Hy3 rotates every dim of the head)")
    return rope


def parse_config(raw: dict) -> Config:
    c = RawConfig(raw)
    for key, allowed in _IGNORED.items():
        used = f"computes as if it were {allowed[0]!r}" if allowed else "computes without it"
        c.refuse(key, allowed, f"transformers' Hy3 ignores it and {used}; another value would be silently different")
    for key in _PRECISION:
        c.bool(key, True)
    if c.bool("mlp_bias", False):
        raise UnsupportedModelError("config.json: mlp_bias=True is not supported (biases on the dense and shared "
                                    "MLP projections)")
    n_layers = c.layers()
    hidden = c.pos_int("hidden_size", 4096)
    heads = c.pos_int("num_attention_heads", 64, hi=MAX_HEADS)
    kv = c.pos_int("num_key_value_heads", 8, hi=MAX_HEADS)
    if heads % kv:
        raise UnsupportedModelError(f"config.json: num_key_value_heads={kv} must divide num_attention_heads={heads}")
    head_dim = c.pos_int("head_dim", 128, hi=MAX_HEAD_DIM)  # transformers' default, not hidden / heads
    mlp_types = _mlp_types(c, n_layers)
    if "first_k_dense_replace" in c:
        k = c.int("first_k_dense_replace", lo=0, hi=MAX_LAYERS)
        if mlp_types != ["dense"] * min(k, n_layers) + ["sparse"] * max(n_layers - k, 0):
            raise UnsupportedModelError(f"config.json: first_k_dense_replace={k} disagrees with mlp_layer_types "
                                        f"{mlp_types} (transformers ignores it and follows mlp_layer_types)")
    moe_inter = c.pos_int("moe_intermediate_size", 1536)
    _agrees(c, "expert_hidden_dim", moe_inter, "moe_intermediate_size")
    n_experts = c.pos_int("num_experts", 192, "num_local_experts", hi=MAX_EXPERTS)
    shared = c.pos_int("num_shared_experts", 1, hi=MAX_EXPERTS)  # 0: transformers builds a full-width MLP
    scale = raw.get("router_scaling_factor", 2.826)
    scale = number(2.826 if scale is None else scale, "router_scaling_factor", positive=True)
    mtp = c.int("num_nextn_predict_layers", 0, lo=0, hi=MAX_LAYERS)
    return Config(
        vocab_size=c.pos_int("vocab_size", 120832),
        hidden_size=hidden,
        intermediate_size=c.pos_int("intermediate_size", 13312),
        moe_intermediate_size=moe_inter,
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        attention_bias=c.bool("attention_bias", False),
        hidden_act=c.act(),
        rms_norm_eps=c.eps(1e-5),
        max_position_embeddings=c.pos_int("max_position_embeddings", 131072, hi=MAX_POSITIONS),
        tie_word_embeddings=c.bool("tie_word_embeddings", False),
        mlp_layer_types=mlp_types,
        num_experts=n_experts,
        num_experts_per_tok=c.top_k("num_experts_per_tok", n_experts, 8),
        num_shared_experts=shared,
        router_scaling_factor=scale,
        rope=_rope(c, raw),
        mtp_layers=mtp,
        weights=WeightFormat(raw.get("quantization_config"), c.where),
    )


def declare(cfg: Config) -> Model:
    h, eps, act = cfg.hidden_size, cfg.rms_norm_eps, cfg.hidden_act

    def mlp(i: int):
        if cfg.mlp_layer_types[i] == "dense":
            return gated_mlp(h, cfg.intermediate_size, act)
        router = grouped_router(cfg.num_experts, h, cfg.num_experts_per_tok, weight=ROUTER, bias=BIAS,
                                scoring="sigmoid", n_group=1, topk_group=1, normalize=True,
                                scale=cfg.router_scaling_factor)
        shared = gated_mlp(h, cfg.moe_intermediate_size * cfg.num_shared_experts, act, prefix="")
        return moe(router, router_name="", shared=shared, shared_name=SHARED)

    layers = [Layer(i, rms_norm(h, eps), rms_norm(h, eps),
                    attention(h, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, eps,
                              bias=cfg.attention_bias, qk_norm="head"), mlp(i))
              for i in range(cfg.num_hidden_layers)]
    return Model(cfg.vocab_size, h, layers, rms_norm(h, eps), cfg.tie_word_embeddings,
                 lambda: Rotary(cfg.head_dim, cfg.rope, cfg.max_position_embeddings),
                 weights=cfg.weights)


def describe(cfg: Config) -> ModelDescription:
    moe_layers = cfg.moe_layers
    spec = ExpertSpec(hidden=cfg.hidden_size, intermediate=cfg.moe_intermediate_size, act=cfg.hidden_act)
    model = declare(cfg)
    n_dense = cfg.mlp_layer_types.count("dense")
    notes = [f"{n_dense} dense layer(s), {len(moe_layers)} MoE layers with {cfg.num_shared_experts} shared "
             f"expert(s); routed weights scaled by {cfg.router_scaling_factor:g}"]
    if cfg.mtp_layers:
        n = cfg.num_hidden_layers
        notes.append(f"{cfg.mtp_layers} multi-token-prediction layer(s) (model.layers.{n}"
                     f"{'..' + str(n + cfg.mtp_layers - 1) if cfg.mtp_layers > 1 else ''}.*) are not used: "
                     "generation predicts one token per step")
    return model.describe(
        model_type=MODEL_TYPE, n_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
        **model.routed_experts(spec, EXPERT_TEMPLATE, PROJ_NAMES), max_position_embeddings=cfg.max_position_embeddings,
        attn_heads=cfg.num_attention_heads, notes=notes,
    )


def build(cfg: Config, w, experts) -> CausalLM:
    return declare(cfg).build(w, experts)
