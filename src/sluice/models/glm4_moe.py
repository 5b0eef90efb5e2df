"""GLM-4.5 (``model_type: glm4_moe``; GLM-4.5, GLM-4.5-Air, GLM-4.6 and GLM-4.7 ship this architecture).

GQA with q/k/v biases (``attention_bias``; o_proj never has one) and optional per-head q/k
RMSNorm (``use_qk_norm``), partial RoPE on the first ``partial_rotary_factor`` of each head
(0.5 unless config.json says otherwise; rotate-half, the rest passes through); the first
``first_k_dense_replace`` layers dense, the others MoE blocks routed DeepSeek-V3's way
(sigmoid scores, the selection-only ``e_score_correction_bias`` on the gate, ``n_group`` /
``topk_group`` group-limited top-k, ``norm_topk_prob``, ``routed_scaling_factor``) with
``n_shared_experts`` shared experts. Block-FP8 checkpoints (``weight_scale_inv``) stay FP8:
the attention projections, dense and shared MLPs and the experts (``models/weight_format.py``).

The multi-token-prediction layers (``num_nextn_predict_layers``, stored as
``model.layers.<num_hidden_layers + i>.*``) are not declared, so they are never read.

Semantics follow transformers 5.24 (modeling_glm4_moe.py, the oracle). Keys transformers
ignores but that would change the computation (another scoring function or top-k method, a
sliding window, an MoE layer frequency, an MLP layer schedule other than the dense-first one)
are refused at their non-default values.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UnsupportedModelError
from ..experts.spec import ExpertSpec
from ..layers.rotary import Rotary, rope_parameters
from .base import CausalLM, ModelDescription
from .config import MAX_EXPERTS, MAX_LAYERS, MAX_POSITIONS, REQUIRED, RawConfig, check_rope
from .declare import Layer, Model
from .parts import attention, gated_mlp, grouped_router, moe, rms_norm
from .standard import PROJ_NAMES
from .weight_format import WeightFormat

MODEL_TYPE = "glm4_moe"
EXPERT_TEMPLATE = "model.layers.{layer}.mlp.experts.{e}.{name}"  # + ".weight" (+ its scales)

# keys transformers' Glm4Moe ignores (DeepSeek-V3's, Qwen's, GLM-4.7-Flash's): the value it
# computes with; anything else is refused
_IGNORED = {
    "scoring_func": ("sigmoid",),
    "topk_method": ("noaux_tc",),  # bias-corrected group top-k
    "moe_layer_freq": (1,),  # every layer from first_k_dense_replace on is MoE
    "use_sliding_window": (False,),
}


@dataclass
class Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense layers'
    moe_intermediate_size: int  # each routed expert's (and each shared expert's)
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    hidden_act: str
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    use_qk_norm: bool
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    moe_layers: list[int]
    mtp_layers: int
    rope: dict
    weights: WeightFormat


def _rope(raw: dict, head_dim: int) -> tuple[dict, int]:
    """The RoPE parameters (``partial_rotary_factor`` from ``rope_parameters``, else the top
    level, else transformers' 0.5) and the rotated dims per head."""
    params = rope_parameters(raw)
    params.setdefault("partial_rotary_factor", 0.5)
    rope = check_rope(params)
    dim = int(head_dim * rope["partial_rotary_factor"])
    if dim % 2 or dim < 2:
        raise UnsupportedModelError(
            f"config.json: partial_rotary_factor={rope['partial_rotary_factor']!r} rotates {dim} of "
            f"head_dim={head_dim} dims (must be a positive even number)")
    return rope, dim


def _experts(c: RawConfig) -> int:
    """``n_routed_experts`` (transformers maps ``num_local_experts`` onto it): both given must agree."""
    n = c.pos_int("n_routed_experts", REQUIRED, "num_local_experts", hi=MAX_EXPERTS)
    other = c.raw.get("num_local_experts")
    if "n_routed_experts" in c and other is not None and other != n:
        raise UnsupportedModelError(
            f"config.json: n_routed_experts={n} and num_local_experts={other!r} disagree")
    return n


def _groups(c: RawConfig, n_experts: int, k: int) -> tuple[int, int]:
    n_group = c.pos_int("n_group", 1, hi=MAX_EXPERTS)
    topk_group = c.pos_int("topk_group", 1, hi=MAX_EXPERTS)
    if n_experts % n_group:
        raise UnsupportedModelError(
            f"config.json: n_routed_experts={n_experts} is not divisible by n_group={n_group}")
    if topk_group > n_group:
        raise UnsupportedModelError(f"config.json: topk_group={topk_group} exceeds n_group={n_group}")
    if n_group > 1 and n_experts // n_group < 2:
        raise UnsupportedModelError(f"config.json: n_group={n_group} leaves fewer than 2 experts per group "
                                    "(groups are scored by their two best experts)")
    if k > topk_group * (n_experts // n_group):
        raise UnsupportedModelError(f"config.json: num_experts_per_tok={k} exceeds the {topk_group} x "
                                    f"{n_experts // n_group} experts of the selected groups")
    return n_group, topk_group


def _check_layer_types(c: RawConfig, n_layers: int, first_dense: int) -> None:
    """GLM-4.7-Flash's ``mlp_layer_types``, which transformers' Glm4Moe ignores: only the schedule
    ``first_k_dense_replace`` gives is accepted."""
    types = c.raw.get("mlp_layer_types")
    if types is None:
        return
    want = ["dense" if i < first_dense else "sparse" for i in range(n_layers)]
    if types != want:
        raise UnsupportedModelError(
            f"config.json: mlp_layer_types={types!r} is not supported (transformers' GLM-4.5 ignores it "
            f"and makes the first first_k_dense_replace={first_dense} layers dense, the others MoE)")


def parse_config(raw: dict) -> Config:
    c = RawConfig(raw)
    n_layers = c.layers()
    hidden = c.pos_int("hidden_size")
    heads, kv, head_dim = c.heads(hidden)
    for key, allowed in _IGNORED.items():
        c.refuse(key, allowed, "transformers' GLM-4.5 ignores it and computes as if it were "
                 f"{allowed[0]!r}; another value would be silently different")
    if raw.get("sliding_window") is not None:
        raise UnsupportedModelError(f"config.json: sliding_window={raw['sliding_window']!r} is not supported "
                                    "(transformers' GLM-4.5 ignores it and attends to the whole context)")
    n_experts = _experts(c)
    k = c.top_k("num_experts_per_tok", n_experts)
    n_group, topk_group = _groups(c, n_experts, k)
    first_dense = c.int("first_k_dense_replace", 1, lo=0, hi=MAX_LAYERS)
    _check_layer_types(c, n_layers, first_dense)
    rope, rotary_dim = _rope(raw, head_dim)
    max_pos = c.pos_int("max_position_embeddings", 131072, hi=MAX_POSITIONS)
    try:
        Rotary(head_dim, rope, max_pos)  # refuses unsupported RoPE types now, at load
    except UnsupportedModelError as e:
        raise UnsupportedModelError(f"config.json: {e}") from None
    mtp = c.int("num_nextn_predict_layers", 1, "num_mtp_layers", lo=0, hi=MAX_LAYERS)
    return Config(
        vocab_size=c.pos_int("vocab_size"),
        hidden_size=hidden,
        intermediate_size=c.pos_int("intermediate_size"),
        moe_intermediate_size=c.pos_int("moe_intermediate_size"),
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        hidden_act=c.act(),
        rms_norm_eps=c.eps(1e-5),
        max_position_embeddings=max_pos,
        tie_word_embeddings=c.bool("tie_word_embeddings", False),
        attention_bias=c.bool("attention_bias", False),
        use_qk_norm=c.bool("use_qk_norm", False),
        n_routed_experts=n_experts,
        n_shared_experts=c.int("n_shared_experts", 1, lo=0, hi=MAX_EXPERTS),
        num_experts_per_tok=k,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=c.bool("norm_topk_prob", True),
        routed_scaling_factor=c.float("routed_scaling_factor", 1.0, positive=True),
        moe_layers=[i for i in range(n_layers) if i >= first_dense],
        mtp_layers=mtp,
        rope=rope,
        weights=WeightFormat(raw.get("quantization_config"), c.where),
    )


def declare(cfg: Config) -> Model:
    h, eps = cfg.hidden_size, cfg.rms_norm_eps
    attn = attention(h, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, eps,
                     bias=cfg.attention_bias, o_bias=False, qk_norm="head" if cfg.use_qk_norm else None)

    def mlp(i: int):
        if i not in cfg.moe_layers:
            return gated_mlp(h, cfg.intermediate_size, cfg.hidden_act)
        router = grouped_router(cfg.n_routed_experts, h, cfg.num_experts_per_tok, scoring="sigmoid",
                                n_group=cfg.n_group, topk_group=cfg.topk_group, normalize=cfg.norm_topk_prob,
                                scale=cfg.routed_scaling_factor)
        # n_shared_experts=0: transformers builds a zero-width MLP, which adds nothing
        shared = gated_mlp(h, cfg.moe_intermediate_size * cfg.n_shared_experts, cfg.hidden_act, prefix="") \
            if cfg.n_shared_experts else None
        return moe(router, shared=shared)

    layers = [Layer(i, rms_norm(h, eps), rms_norm(h, eps), attn, mlp(i))
              for i in range(cfg.num_hidden_layers)]
    return Model(cfg.vocab_size, h, layers, rms_norm(h, eps), cfg.tie_word_embeddings,
                 lambda: Rotary(cfg.head_dim, cfg.rope, cfg.max_position_embeddings),
                 weights=cfg.weights)


def describe(cfg: Config) -> ModelDescription:
    spec = ExpertSpec(hidden=cfg.hidden_size, intermediate=cfg.moe_intermediate_size, act=cfg.hidden_act)
    model = declare(cfg)
    notes = [f"partial RoPE: {cfg.rotary_dim} of {cfg.head_dim} dims per head"]
    if cfg.mtp_layers:
        n = cfg.num_hidden_layers
        notes.append(f"{cfg.mtp_layers} multi-token-prediction layer(s) (model.layers.{n}"
                     f"{'..' + str(n + cfg.mtp_layers - 1) if cfg.mtp_layers > 1 else ''}.*) are not used: "
                     "generation predicts one token per step")
    return model.describe(
        model_type=MODEL_TYPE, n_experts=cfg.n_routed_experts, top_k=cfg.num_experts_per_tok,
        **model.routed_experts(spec, EXPERT_TEMPLATE, PROJ_NAMES), max_position_embeddings=cfg.max_position_embeddings,
        attn_heads=cfg.num_attention_heads, notes=notes,
    )


def build(cfg: Config, w, experts) -> CausalLM:
    return declare(cfg).build(w, experts)
