"""dots.llm1 (``model_type: dots1``; rednote-hilab's dots.llm1.base and dots.llm1.inst, 142B-A14B).

Qwen3-style attention (GQA, q/k RMSNorm per head before RoPE, rotate-half RoPE over the whole
head, optional q/k/v/o biases) with a sliding window on the layers ``layer_types`` marks
``sliding_attention`` (by default the layers from ``max_window_layers`` on, when
``sliding_window`` is set); DeepSeek-V3-style MoE blocks: sigmoid scores, the selection-only
``e_score_correction_bias`` on the gate, expert groups (``n_group`` / ``topk_group``, scored by
their two best experts), optional renormalisation (``norm_topk_prob``), ``routed_scaling_factor``,
``n_shared_experts`` shared experts fused into one MLP; the first ``first_k_dense_replace``
layers dense. Per-expert ``gate_proj`` / ``up_proj`` / ``down_proj`` (the released layout).

Semantics follow transformers 5.24 (modeling_dots1.py, the oracle). Keys transformers' Dots1
ignores but that would change the computation (another scoring function, ``moe_layer_freq``,
``use_sliding_window``, interleaved or partial RoPE, MLP biases, MTP layers, ...) are refused at
their non-default values.
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
from .weight_format import PLAIN, WeightFormat

MODEL_TYPE = "dots1"
EXPERT_TEMPLATE = "model.layers.{layer}.mlp.experts.{e}.{name}"  # + ".weight"
LAYER_TYPES = ("full_attention", "sliding_attention")

# keys transformers' Dots1 does not read: the value it computes as if it had (others are refused)
_IGNORED = {
    "scoring_func": ("sigmoid",),  # the gate always scores with a sigmoid
    "topk_method": ("noaux_tc",),  # bias-corrected group top-k, always
    "moe_layer_freq": (1,),  # every layer from first_k_dense_replace on is MoE
    "use_sliding_window": (False,),  # layer_types / sliding_window / max_window_layers decide
    "rope_interleave": (False,),  # RoPE rotates halves, never interleaved pairs
    "mlp_bias": (False,),  # the MLPs and experts have no biases
    "use_qk_norm": (True,),  # q_norm / k_norm always apply (per head)
    "num_nextn_predict_layers": (0,),  # no multi-token-prediction layers
}

# transformers' Dots1Config defaults, used when config.json lacks the key
_WINDOW, _MAX_WINDOW_LAYERS = 4096, 62


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
    sliding_window: int | None  # None when no layer is sliding
    layer_types: list[str]
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    moe_layers: list[int]
    rope: dict
    weights: WeightFormat = PLAIN


def _layer_types(c: RawConfig, n_layers: int) -> tuple[list[str], int | None]:
    """Each layer's attention kind and the window of the sliding ones, as transformers derives
    them: an explicit ``layer_types``, else sliding from ``max_window_layers`` on when
    ``sliding_window`` is set (an explicit null: no window; absent: transformers' 4096)."""
    window = c.sliding_window() if "sliding_window" in c.raw else _WINDOW  # an explicit null: None
    first = c.int("max_window_layers", _MAX_WINDOW_LAYERS, lo=0, hi=MAX_LAYERS)
    types = c.raw.get("layer_types")
    if types is None:
        types = ["sliding_attention" if window is not None and i >= first else "full_attention"
                 for i in range(n_layers)]
    if not isinstance(types, list) or len(types) != n_layers:
        raise UnsupportedModelError(
            f"config.json: layer_types must list one type per layer ({n_layers}), got {types!r}")
    bad = sorted({str(t) for t in types if t not in LAYER_TYPES})
    if bad:
        raise UnsupportedModelError(
            f"config.json: layer_types {bad} are not supported (supported: {', '.join(LAYER_TYPES)})")
    if "sliding_attention" in types and window is None:
        raise UnsupportedModelError(
            f"config.json: sliding_window=None with sliding_attention at layer "
            f"{types.index('sliding_attention')} is not supported (a sliding layer needs a positive window)")
    return list(types), window if "sliding_attention" in types else None


def _routing(c: RawConfig) -> tuple[int, int, int, int]:
    """(routed experts, top-k, n_group, topk_group); a null group count is one group."""
    n = c.pos_int("n_routed_experts", REQUIRED, "num_local_experts", hi=MAX_EXPERTS)
    if n < 2:
        raise UnsupportedModelError(f"config.json: n_routed_experts={n} is not supported (the gate scores "
                                    "each group by its two best experts: at least 2 are needed)")
    k = c.top_k("num_experts_per_tok", n)
    n_group = c.pos_int("n_group", 1, hi=MAX_EXPERTS)
    topk_group = c.pos_int("topk_group", 1, hi=MAX_EXPERTS)
    if n % n_group:
        raise UnsupportedModelError(
            f"config.json: n_routed_experts={n} is not divisible by n_group={n_group}")
    if topk_group > n_group:
        raise UnsupportedModelError(f"config.json: topk_group={topk_group} exceeds n_group={n_group}")
    if n // n_group < 2:
        raise UnsupportedModelError(f"config.json: n_group={n_group} leaves fewer than 2 experts per group "
                                    "(groups are scored by their two best experts)")
    if k > topk_group * (n // n_group):
        raise UnsupportedModelError(f"config.json: num_experts_per_tok={k} exceeds the {topk_group} x "
                                    f"{n // n_group} experts of the selected groups")
    return n, k, n_group, topk_group


def _rope(raw: dict) -> dict:
    rope = check_rope(rope_parameters(raw))
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError(
            f"config.json: partial_rotary_factor={rope['partial_rotary_factor']!r} is not supported "
            "(dots.llm1 rotates the whole head; transformers' default RoPE ignores the factor)")
    return rope


def parse_config(raw: dict) -> Config:
    c = RawConfig(raw)
    n_layers = c.layers()
    hidden = c.pos_int("hidden_size")
    heads, kv, head_dim = c.heads(hidden)
    for key, allowed in _IGNORED.items():
        c.refuse(key, allowed, f"transformers' Dots1 computes as if it were {allowed[0]!r}; another "
                 "value would be silently different")
    layer_types, window = _layer_types(c, n_layers)
    n_experts, k, n_group, topk_group = _routing(c)
    n_shared = c.pos_int("n_shared_experts", REQUIRED, hi=MAX_EXPERTS)
    first_dense = c.int("first_k_dense_replace", 0, lo=0, hi=MAX_LAYERS)
    max_pos = c.pos_int("max_position_embeddings", 2048, hi=MAX_POSITIONS)
    rope = _rope(raw)
    try:
        Rotary(head_dim, rope, max_pos)  # refuses unsupported RoPE types now, at load
    except UnsupportedModelError as e:
        raise UnsupportedModelError(f"config.json: rope_parameters: {e}") from None
    return Config(
        vocab_size=c.pos_int("vocab_size"),
        hidden_size=hidden,
        intermediate_size=c.pos_int("intermediate_size"),
        moe_intermediate_size=c.pos_int("moe_intermediate_size"),
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        hidden_act=c.act(),
        rms_norm_eps=c.eps(1e-6),
        max_position_embeddings=max_pos,
        tie_word_embeddings=c.bool("tie_word_embeddings", False),
        attention_bias=c.bool("attention_bias", False),
        sliding_window=window,
        layer_types=layer_types,
        n_routed_experts=n_experts,
        n_shared_experts=n_shared,
        num_experts_per_tok=k,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=c.bool("norm_topk_prob", False),
        routed_scaling_factor=c.float("routed_scaling_factor", 1.0, positive=True),
        moe_layers=list(range(first_dense, n_layers)),
        rope=rope,
        weights=WeightFormat(raw.get("quantization_config"), c.where),
    )


def declare(cfg: Config) -> Model:
    h, eps = cfg.hidden_size, cfg.rms_norm_eps

    def attn(i: int):
        window = cfg.sliding_window if cfg.layer_types[i] == "sliding_attention" else None
        return attention(h, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, eps,
                         bias=cfg.attention_bias, qk_norm="head", window=window)

    def mlp(i: int):
        if i in cfg.moe_layers:
            router = grouped_router(cfg.n_routed_experts, h, cfg.num_experts_per_tok, scoring="sigmoid",
                                    n_group=cfg.n_group, topk_group=cfg.topk_group,
                                    normalize=cfg.norm_topk_prob, scale=cfg.routed_scaling_factor)
            shared = gated_mlp(h, cfg.moe_intermediate_size * cfg.n_shared_experts, cfg.hidden_act, prefix="")
            return moe(router, shared=shared)
        return gated_mlp(h, cfg.intermediate_size, cfg.hidden_act)

    layers = [Layer(i, rms_norm(h, eps), rms_norm(h, eps), attn(i), mlp(i))
              for i in range(cfg.num_hidden_layers)]
    return Model(cfg.vocab_size, h, layers, rms_norm(h, eps), cfg.tie_word_embeddings,
                 lambda: Rotary(cfg.head_dim, cfg.rope, cfg.max_position_embeddings), weights=cfg.weights)


def describe(cfg: Config) -> ModelDescription:
    spec = ExpertSpec(hidden=cfg.hidden_size, intermediate=cfg.moe_intermediate_size, act=cfg.hidden_act)
    model = declare(cfg)
    n_sliding = cfg.layer_types.count("sliding_attention")
    n_dense = cfg.num_hidden_layers - len(cfg.moe_layers)
    notes = [(f"{cfg.n_shared_experts} shared expert(s) per MoE layer ({cfg.moe_intermediate_size} x "
              f"{cfg.n_shared_experts} wide, resident), {n_dense} dense layer(s)")]
    if n_sliding:
        notes.append(f"attention: {n_sliding} sliding-window layers (window {cfg.sliding_window}, at most "
                     f"{model.state()['window_positions']} positions kept) and "
                     f"{cfg.num_hidden_layers - n_sliding} full layers")
    return model.describe(
        model_type=MODEL_TYPE, n_experts=cfg.n_routed_experts, top_k=cfg.num_experts_per_tok,
        **model.routed_experts(spec, EXPERT_TEMPLATE, PROJ_NAMES),
        max_position_embeddings=cfg.max_position_embeddings, attn_heads=cfg.num_attention_heads, notes=notes,
    )


def build(cfg: Config, w, experts) -> CausalLM:
    return declare(cfg).build(w, experts)
