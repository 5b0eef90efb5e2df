"""Xiaomi MiMo-V2-Flash (``model_type: mimo_v2_flash``).

GQA in two kinds of layers, set by ``layer_types``: full attention (the first layer and every
sixth by default) and sliding-window attention with twice the key/value heads and learned
per-head sinks (``self_attn.attention_sink_bias`` in the checkpoints). Queries and keys have
``head_dim`` (192) dims, values ``v_head_dim`` (128), and the values are multiplied by
``attention_value_scale`` (0.707) before they are cached. Partial RoPE (rotate-half on the first
``int(head_dim * partial_rotary_factor)`` dims) with its own theta per layer kind
(``rope_parameters["full_attention"]`` / ``["sliding_attention"]``: 5e6 and 1e4 by default).
MLPs by ``mlp_layer_types``: the first layer dense, the others MoE: sigmoid scores, the
selection-only ``e_score_correction_bias`` on the gate, group-limited top-k as DeepSeek-V3
(``n_group``, ``topk_group``), renormalised (``norm_topk_prob``) and scaled
(``routed_scaling_factor``), no shared experts; experts ``gate_proj`` / ``up_proj`` /
``down_proj`` per expert. Block-FP8 checkpoints (``weight_scale_inv``) stay FP8
(``models/weight_format.py``). The multi-token-prediction layers (``model.mtp.*``) are not used.

Semantics follow transformers 5.24 (modeling_mimo_v2_flash.py, the oracle). The published
config.json also carries the keys of Xiaomi's own code (``hybrid_layer_pattern``,
``moe_layer_freq``, ``swa_*``, ``rope_theta``, ...), which transformers ignores: each is
accepted only where it agrees with what transformers computes, and refused otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UnsupportedModelError
from ..experts.spec import ExpertSpec
from ..layers.attention import MAX_DRAFT
from ..layers.rotary import LayerRotary, Rotary
from .base import CausalLM, ModelDescription
from .config import MAX_EXPERTS, MAX_HEAD_DIM, MAX_HEADS, MAX_LAYERS, MAX_POSITIONS, RawConfig, check_rope, number
from .declare import Layer, Model
from .parts import attention, gated_mlp, grouped_router, moe, rms_norm
from .standard import PROJ_NAMES
from .weight_format import WeightFormat

MODEL_TYPE = "mimo_v2_flash"
LAYER_TYPES = ("full_attention", "sliding_attention")
MLP_TYPES = ("dense", "sparse")
SINKS = "attention_sink_bias"  # the checkpoints' name of the learned sinks (transformers' ``sinks``)
EXPERT_TEMPLATE = "model.layers.{layer}.mlp.experts.{e}.{name}"  # + ".weight" (+ its scales)

# transformers' MiMoV2FlashConfig defaults, used when config.json lacks the key
_DEFAULT_ROPE = {"full_attention": {"rope_type": "default", "rope_theta": 5_000_000.0, "partial_rotary_factor": 0.334},
                 "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.334}}
_PARTIAL = 0.334  # a layer kind's partial_rotary_factor when its parameters omit it

# keys of the published config.json that transformers ignores, with the value it computes as if
# they had (anything else would be silently different, so it is refused)
_IGNORED = {
    "add_full_attention_sink_bias": (False,),  # full-attention layers have no sinks
    "add_swa_attention_sink_bias": (True,),  # sliding-window layers always have them
    "scoring_func": ("sigmoid",),
    "topk_method": ("noaux_tc",),  # bias-corrected group top-k
    "n_shared_experts": (0,),  # no shared experts
    "rope_scaling": (),  # any RoPE scaling given this way is ignored by transformers
}


@dataclass
class Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense layers' MLP
    moe_intermediate_size: int  # each expert's
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int  # full-attention layers; sliding-window layers have twice as many
    head_dim: int
    v_head_dim: int
    v_scale: float
    attention_bias: bool
    hidden_act: str
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    sliding_window: int
    layer_types: list[str]
    mlp_layer_types: list[str]
    num_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    rope: dict  # layer kind -> {"rope_theta": ..., "partial_rotary_factor": ...}
    mtp_modules: int  # model.mtp.* layers, not used
    weights: WeightFormat

    def kv_heads(self, i: int) -> int:
        return self.num_key_value_heads * (2 if self.layer_types[i] == "sliding_attention" else 1)

    @property
    def moe_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.mlp_layer_types) if t == "sparse"]


def _types(c: RawConfig, key: str, allowed: tuple[str, ...], default: list[str], n_layers: int) -> list[str]:
    v = c.raw.get(key)
    if v is None:
        return default
    if not isinstance(v, list) or len(v) != n_layers:
        raise c.bad(key, v, f"a list of one type per layer ({n_layers})")
    bad = sorted({repr(t) for t in v if t not in allowed})
    if bad:
        raise UnsupportedModelError(f"config.json: {key} has {', '.join(bad)}, which is not supported "
                                    f"(supported: {', '.join(allowed)})")
    return list(v)


def _agrees(c: RawConfig, key: str, used, why: str) -> None:
    """Refuse an ignored key whose value differs from ``used`` (what transformers computes with)."""
    v = c.raw.get(key)
    if v is not None and v != used:
        raise UnsupportedModelError(f"config.json: {key}={v!r} is not supported: transformers ignores it and "
                                    f"computes with {used!r} ({why})")


def _rope(c: RawConfig, head_dim: int, kinds: set[str]) -> dict:
    """Each layer kind's RoPE parameters: ``rope_parameters`` keyed by layer type (as transformers
    saves them) or its defaults; only the default RoPE type (what MiMo-V2-Flash uses)."""
    given = c.raw.get("rope_parameters")
    if given is None:
        given = _DEFAULT_ROPE
    if not isinstance(given, dict) or any(not isinstance(given.get(k), dict) for k in kinds):
        raise c.bad("rope_parameters", given,
                    f"an object with the parameters of each layer type ({', '.join(sorted(kinds))})")
    for key in given:
        if key not in LAYER_TYPES:  # transformers reads only the layer types' entries
            raise c.bad(f"rope_parameters.{key}", given[key],
                        f"only the parameters of each layer type ({', '.join(LAYER_TYPES)})")
    out = {}
    for kind in sorted(kinds):
        p = dict(given[kind])
        rtype = p.get("rope_type", "default")
        if rtype != "default":
            raise UnsupportedModelError(f"config.json: rope_parameters[{kind!r}].rope_type={rtype!r} is not "
                                        "supported for mimo_v2_flash (only 'default')")
        p.setdefault("partial_rotary_factor", _PARTIAL)
        check_rope(p, f"config.json: rope_parameters[{kind!r}]")
        if int(head_dim * float(p["partial_rotary_factor"])) < 1:
            raise UnsupportedModelError(f"config.json: rope_parameters[{kind!r}].partial_rotary_factor="
                                        f"{p['partial_rotary_factor']!r} rotates no dim of head_dim={head_dim}")
        out[kind] = {"rope_type": "default", "rope_theta": float(p["rope_theta"]),
                     "partial_rotary_factor": float(p["partial_rotary_factor"])}
    return out


def parse_config(raw: dict) -> Config:
    c = RawConfig(raw)
    for key, allowed in _IGNORED.items():
        if key == "rope_scaling":
            if raw.get(key) is not None:
                raise UnsupportedModelError(f"config.json: rope_scaling={raw[key]!r} is not supported (transformers' "
                                            "MiMo-V2-Flash ignores it; give rope_parameters per layer type)")
            continue
        c.refuse(key, allowed, f"transformers' MiMo-V2-Flash computes as if it were {allowed[0]!r}; another "
                 "value would be silently different")
    layout = raw.get("attention_projection_layout")
    if layout is not None and layout != "split":
        raise UnsupportedModelError(f"config.json: attention_projection_layout={layout!r} is not supported "
                                    "(transformers' MiMo-V2-Flash reads separate q_proj / k_proj / v_proj)")
    n_layers = c.layers()
    hidden = c.pos_int("hidden_size")
    heads = c.pos_int("num_attention_heads", hi=MAX_HEADS)
    kv = c.pos_int("num_key_value_heads", 4, hi=MAX_HEADS)
    head_dim = c.pos_int("head_dim", 192, hi=MAX_HEAD_DIM)
    v_head_dim = c.pos_int("v_head_dim", 128, hi=MAX_HEAD_DIM)
    default_types = ["full_attention" if i == 0 or (i + 1) % 6 == 0 else "sliding_attention" for i in range(n_layers)]
    layer_types = _types(c, "layer_types", LAYER_TYPES, default_types, n_layers)
    mlp_types = _types(c, "mlp_layer_types", MLP_TYPES, ["dense"] + ["sparse"] * (n_layers - 1), n_layers)
    for kind, n_kv in (("full_attention", kv), ("sliding_attention", 2 * kv)):
        if kind in layer_types and heads % n_kv:
            raise UnsupportedModelError(
                f"config.json: num_attention_heads={heads} is not a multiple of the {n_kv} key/value heads of the "
                f"{kind} layers (num_key_value_heads={kv}{', doubled' if n_kv != kv else ''})")
    # the published config's own names for what transformers derives
    _agrees(c, "hybrid_layer_pattern", [int(t == "sliding_attention") for t in layer_types], "the layer types")
    _agrees(c, "moe_layer_freq", [int(t == "sparse") for t in mlp_types], "the MLP layer types")
    _agrees(c, "swa_num_attention_heads", heads, "num_attention_heads")
    _agrees(c, "swa_num_key_value_heads", 2 * kv, "twice num_key_value_heads")
    _agrees(c, "swa_head_dim", head_dim, "head_dim")
    _agrees(c, "swa_v_head_dim", v_head_dim, "v_head_dim")
    window = c.pos_int("sliding_window", 129, hi=MAX_POSITIONS)
    if "sliding_window_size" in c:  # transformers: the window is these previous tokens plus the query
        window = c.pos_int("sliding_window_size", hi=MAX_POSITIONS - 1) + 1
    rope = _rope(c, head_dim, set(layer_types))
    for key, kind in (("rope_theta", "full_attention"), ("swa_rope_theta", "sliding_attention")):
        if kind in rope:
            _agrees(c, key, rope[kind]["rope_theta"], f"rope_parameters[{kind!r}].rope_theta")
    for kind, p in rope.items():
        _agrees(c, "partial_rotary_factor", p["partial_rotary_factor"],
                f"rope_parameters[{kind!r}].partial_rotary_factor")
    eps = c.eps(1e-5)
    _agrees(c, "layernorm_epsilon", eps, "rms_norm_eps")
    scale = raw.get("attention_value_scale", 0.707)
    scale = 1.0 if scale is None else number(scale, "attention_value_scale", positive=True)

    moe_used = "sparse" in mlp_types
    n_experts = c.pos_int("n_routed_experts", 256, "num_local_experts", hi=MAX_EXPERTS)
    k = c.top_k("num_experts_per_tok", n_experts, 8)
    n_group = c.pos_int("n_group", 1, hi=MAX_EXPERTS)
    topk_group = c.pos_int("topk_group", 1, hi=MAX_EXPERTS)
    if moe_used:
        if n_experts % n_group:
            raise UnsupportedModelError(f"config.json: n_routed_experts={n_experts} is not divisible by "
                                        f"n_group={n_group}")
        if topk_group > n_group:
            raise UnsupportedModelError(f"config.json: topk_group={topk_group} exceeds n_group={n_group}")
        if n_experts // n_group < 2:
            raise UnsupportedModelError(f"config.json: n_group={n_group} leaves fewer than 2 experts per group "
                                        "(groups are scored by their two best experts)")
        if k > topk_group * (n_experts // n_group):
            raise UnsupportedModelError(f"config.json: num_experts_per_tok={k} exceeds the {topk_group} x "
                                        f"{n_experts // n_group} experts of the selected groups")
    routed_scale = raw.get("routed_scaling_factor", 1.0)  # an explicit null is 1.0 (the published config)
    routed_scale = 1.0 if routed_scale is None else number(routed_scale, "routed_scaling_factor", positive=True)
    mtp = c.int("num_nextn_predict_layers", 0, "num_mtp_layers", lo=0, hi=MAX_LAYERS)
    return Config(
        vocab_size=c.pos_int("vocab_size"),
        hidden_size=hidden,
        intermediate_size=c.pos_int("intermediate_size", 16384),
        moe_intermediate_size=c.pos_int("moe_intermediate_size", 2048),
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        v_scale=scale,
        attention_bias=c.bool("attention_bias", False),
        hidden_act=c.act(),
        rms_norm_eps=eps,
        max_position_embeddings=c.pos_int("max_position_embeddings", 131072, hi=MAX_POSITIONS),
        tie_word_embeddings=c.bool("tie_word_embeddings", False),
        sliding_window=window,
        layer_types=layer_types,
        mlp_layer_types=mlp_types,
        num_experts=n_experts,
        num_experts_per_tok=k,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=c.bool("norm_topk_prob", True),
        routed_scaling_factor=routed_scale,
        rope=rope,
        mtp_modules=mtp,
        weights=WeightFormat(raw.get("quantization_config"), c.where),
    )


def declare(cfg: Config) -> Model:
    h, eps = cfg.hidden_size, cfg.rms_norm_eps

    def attn(i: int):
        sliding = cfg.layer_types[i] == "sliding_attention"
        return attention(h, cfg.num_attention_heads, cfg.kv_heads(i), cfg.head_dim, eps, bias=cfg.attention_bias,
                         o_bias=False, window=cfg.sliding_window if sliding else None, sinks=sliding,
                         sinks_name=SINKS, v_head_dim=cfg.v_head_dim, v_scale=cfg.v_scale)

    def mlp(i: int):
        if cfg.mlp_layer_types[i] == "dense":
            return gated_mlp(h, cfg.intermediate_size, cfg.hidden_act)
        return moe(grouped_router(cfg.num_experts, h, cfg.num_experts_per_tok, scoring="sigmoid",
                                  n_group=cfg.n_group, topk_group=cfg.topk_group, normalize=cfg.norm_topk_prob,
                                  scale=cfg.routed_scaling_factor))

    kinds = sorted(cfg.rope)

    def rotary():
        tables = [Rotary(cfg.head_dim, cfg.rope[k], cfg.max_position_embeddings) for k in kinds]
        return LayerRotary(tables, [kinds.index(t) for t in cfg.layer_types])

    layers = [Layer(i, rms_norm(h, eps), rms_norm(h, eps), attn(i), mlp(i)) for i in range(cfg.num_hidden_layers)]
    return Model(cfg.vocab_size, h, layers, rms_norm(h, eps), cfg.tie_word_embeddings, rotary,
                 weights=cfg.weights)


def describe(cfg: Config) -> ModelDescription:
    spec = ExpertSpec(hidden=cfg.hidden_size, intermediate=cfg.moe_intermediate_size, act=cfg.hidden_act)
    model = declare(cfg)
    n_sliding = cfg.layer_types.count("sliding_attention")
    rot = {k: int(cfg.head_dim * p["partial_rotary_factor"]) for k, p in cfg.rope.items()}
    notes = [
        f"attention: {n_sliding} sliding-window layers (window {cfg.sliding_window}, "
        f"{2 * cfg.num_key_value_heads} key/value heads, learned sinks) and {cfg.num_hidden_layers - n_sliding} full "
        f"layers ({cfg.num_key_value_heads} key/value heads); q/k heads {cfg.head_dim} dims, v heads "
        f"{cfg.v_head_dim} dims scaled by {cfg.v_scale}",
        "RoPE: " + "; ".join(f"{k} theta {p['rope_theta']:g}, {2 * ((rot[k] + 1) // 2)} of {cfg.head_dim} dims"
                             for k, p in sorted(cfg.rope.items())),
    ]
    if n_sliding:
        notes.append(f"KV: each sliding-window layer keeps at most {model.state()['window_positions']} positions "
                     f"(the window, {MAX_DRAFT} for a speculative draft, room to append), full layers the whole "
                     "context")
    if cfg.mtp_modules:
        notes.append(f"{cfg.mtp_modules} multi-token-prediction layer(s) (model.mtp.*) are not used: generation "
                     "predicts one token per step")
    return model.describe(
        model_type=MODEL_TYPE, n_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
        **model.routed_experts(spec, EXPERT_TEMPLATE, PROJ_NAMES), max_position_embeddings=cfg.max_position_embeddings,
        attn_heads=cfg.num_attention_heads, notes=notes,
    )


def build(cfg: Config, w, experts) -> CausalLM:
    return declare(cfg).build(w, experts)
