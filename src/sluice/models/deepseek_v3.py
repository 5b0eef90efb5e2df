"""DeepSeek-V3 (``model_type: deepseek_v3``; Kimi K2 ships the same architecture, and Kimi
K2.5 / K2.6, ``kimi_k25``, wrap it as the text model of a multimodal model).

Multi-head Latent Attention with a compressed latent cache (``layers/mla.py``), RoPE on a
rope sub-head (interleaved pairs by default, YaRN with the mscale softmax correction),
sigmoid group-limited routing with ``e_score_correction_bias`` for selection only
(``layers/routing.py``), shared experts, ``first_k_dense_replace`` dense layers (and
``moe_layer_freq``), block-scaled FP8 checkpoints (``quant/fp8.py``) kept in FP8, and
compressed-tensors INT4 experts (Kimi K2-Thinking, K2.5: ``quant/int4.py``) kept in INT4, read as
every family reads them (``models/weight_format.py``).

Semantics follow transformers 5.24 (the oracle). Where transformers ignores a config key
that would change the computation, Sluice refuses that key's non-default values instead
of guessing (the list is in ``docs/families.md``).

``kimi_k25`` (transformers' ``Kimi_K25Config`` / ``Kimi_K25ForConditionalGeneration``): the
wrapper's ``text_config`` is this family's config (``model_type`` ``deepseek_v3``, or ``kimi_k2``,
which transformers rewrites to it), its tensors are named under ``language_model.``
(``language_model.model.layers.N.*``, ``language_model.lm_head.weight``), the vision tower
(``vision_tower.*``) and projector (``mm_projector.*``) are never read. The head is tied to the
embedding by the wrapper's own ``tie_word_embeddings`` (default true), as transformers ties it;
a top-level ``quantization_config`` applies to the text model (one in ``text_config`` too must
be the same).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..errors import UnsupportedModelError
from ..experts.spec import ExpertSpec
from ..layers.rotary import Rotary, rope_parameters
from .base import CausalLM, ModelDescription
from .config import MAX_EXPERTS, MAX_LAYERS, MAX_POSITIONS, REQUIRED, RawConfig, check_rope
from .declare import Layer, Model
from .parts import gated_mlp, grouped_router, mla, moe, rms_norm
from .standard import PROJ_NAMES
from .weight_format import WeightFormat, text_quantization

MODEL_TYPE = "deepseek_v3"
ALIASES = ("kimi_k2", "kimi_k25")  # Kimi K2 ships the DeepSeek-V3 architecture; K2.5/K2.6 wrap it
WRAPPER = "kimi_k25"
WRAPPER_PREFIX = "language_model."
TEXT_TYPES = ("deepseek_v3", "kimi_k2")

# transformers' DeepseekV3Config defaults, used only when config.json lacks the key
_DEFAULTS = dict(n_shared_experts=1, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
                 qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4,
                 first_k_dense_replace=3, norm_topk_prob=True, rope_interleave=True, rms_norm_eps=1e-6,
                 max_position_embeddings=4096)


@dataclass
class Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    hidden_act: str
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
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
    softmax_scale: float
    weights: WeightFormat  # how the checkpoint stores its linears and routed experts
    model_type: str
    family: str = MODEL_TYPE  # the family module that parsed it (GLM-4.7-Flash reuses this one)
    prefix: str = ""  # of every tensor name (a multimodal wrapper's ``language_model.``)


def _raw_or_default(raw: dict, key: str, defaults: dict):
    """The key's value, ``None`` if config.json sets it to null, transformers' default if absent."""
    return raw[key] if key in raw else defaults[key]


def _positive_int(c: RawConfig, key: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UnsupportedModelError(f"{c.where}: {key}={value!r} is not supported (expected a positive integer)")
    return value


def _moe_layers(c: RawConfig, n_layers: int, n_experts: int) -> list[int]:
    """DeepSeek-V3's MoE layers: from ``first_k_dense_replace`` on, every ``moe_layer_freq``-th."""
    first_dense = c.int("first_k_dense_replace", _DEFAULTS["first_k_dense_replace"], lo=0, null=0)
    freq = c.int("moe_layer_freq", 1)
    if freq < 1:
        raise UnsupportedModelError(f"{c.where}: moe_layer_freq={freq} is not supported")
    return [i for i in range(n_layers) if n_experts and i >= first_dense and i % freq == 0]


def _parse_wrapper(raw: dict) -> Config:
    """A ``kimi_k25`` config.json: its text model (see the module docstring)."""
    c = RawConfig(raw)
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise UnsupportedModelError(f"config.json: text_config={text!r} is not supported ({WRAPPER} needs the "
                                    "text model's config as an object)")
    where = "config.json text_config"
    text_type = text.get("model_type", MODEL_TYPE)
    if text_type not in TEXT_TYPES:
        raise UnsupportedModelError(f"{where}: model_type={text_type!r} is not supported (expected one of "
                                    f"{', '.join(TEXT_TYPES)})")
    text = dict(text)
    text["quantization_config"] = text_quantization(raw, text)
    text["tie_word_embeddings"] = c.bool("tie_word_embeddings", True)  # the wrapper ties the head
    text["model_type"] = WRAPPER
    cfg = parse_config(text, where)
    return replace(cfg, prefix=WRAPPER_PREFIX, weights=cfg.weights.with_names(lambda m: WRAPPER_PREFIX + m))


def parse_config(raw: dict, where: str = "config.json") -> Config:
    if isinstance(raw, dict) and raw.get("model_type") == WRAPPER and where == "config.json":
        return _parse_wrapper(raw)
    return parse_mla_config(raw, _DEFAULTS, MODEL_TYPE, "DeepSeek-V3", _moe_layers, where)


def parse_mla_config(raw: dict, defaults: dict, family: str, name: str, moe_layers,
                     where: str = "config.json") -> Config:
    """The config of a DeepSeek-V3-style model (MLA, grouped sigmoid routing with the correction
    bias, shared experts) of ``family`` (``name`` in messages; ``where`` names the config object):
    ``defaults`` are its transformers config's defaults (used only where config.json lacks the
    key), ``moe_layers(c, n_layers, n_experts)`` its MoE layer indices."""
    c = RawConfig(raw, where)
    n_layers = c.layers()
    heads, kv_heads, _ = c.heads(0, head_dim=False)
    if kv_heads != heads:
        raise UnsupportedModelError(
            f"{c.where}: num_key_value_heads={kv_heads} with num_attention_heads={heads} is not supported (MLA "
            f"expands one key/value per query head; transformers' {name} needs them equal too)")
    c.refuse("scoring_func", ("sigmoid",), f"{name} routing scores experts with a sigmoid; transformers "
             "ignores scoring_func, so another value would be silently different")
    c.refuse("topk_method", ("noaux_tc",), f"{name} selects experts with noaux_tc (bias-corrected group "
             "top-k); transformers ignores topk_method")
    for key in ("use_sliding_window", "sliding_window"):
        c.refuse(key, (False,), f"{name} attends to the whole context")

    n_experts = c.int("n_routed_experts", defaults.get("n_routed_experts", 0), "num_local_experts", lo=0,
                      hi=MAX_EXPERTS)
    k_default = defaults.get("num_experts_per_tok", REQUIRED)
    k = c.top_k("num_experts_per_tok", n_experts, k_default) if n_experts else c.int("num_experts_per_tok", 0)
    n_group = raw.get("n_group", defaults["n_group"]) or 1
    topk_group = raw.get("topk_group", defaults["topk_group"]) or 1
    n_group = _positive_int(c, "n_group", n_group)
    topk_group = _positive_int(c, "topk_group", topk_group)
    if n_experts:
        if n_experts % n_group:
            raise UnsupportedModelError(f"{c.where}: n_routed_experts={n_experts} is not divisible by "
                                        f"n_group={n_group}")
        if topk_group > n_group:
            raise UnsupportedModelError(f"{c.where}: topk_group={topk_group} exceeds n_group={n_group}")
        if n_group > 1 and n_experts // n_group < 2:
            raise UnsupportedModelError(f"{c.where}: n_group={n_group} leaves fewer than 2 experts per group "
                                        "(groups are scored by their two best experts)")
        if k > topk_group * (n_experts // n_group):
            raise UnsupportedModelError(f"{c.where}: num_experts_per_tok={k} exceeds the {topk_group} x "
                                        f"{n_experts // n_group} experts of the selected groups")
    moe = moe_layers(c, n_layers, n_experts)

    q_lora = _raw_or_default(raw, "q_lora_rank", defaults)
    if q_lora is not None:
        q_lora = _positive_int(c, "q_lora_rank", q_lora)
    dn = _positive_int(c, "qk_nope_head_dim", _raw_or_default(raw, "qk_nope_head_dim", defaults))
    dr = _positive_int(c, "qk_rope_head_dim", _raw_or_default(raw, "qk_rope_head_dim", defaults))
    if dr % 2:
        raise UnsupportedModelError(f"{c.where}: qk_rope_head_dim={dr} must be even")
    dv = _positive_int(c, "v_head_dim", _raw_or_default(raw, "v_head_dim", defaults))
    max_pos = c.pos_int("max_position_embeddings", defaults["max_position_embeddings"], hi=MAX_POSITIONS)
    rope = check_rope(rope_parameters(raw))
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError(
            f"{c.where}: partial_rotary_factor={rope['partial_rotary_factor']!r} is not supported (MLA "
            "rotates the whole qk_rope_head_dim part)")
    if rope.get("rope_type", "default") != "default" and rope.get("factor") is None:
        raise UnsupportedModelError(f"{c.where}: RoPE type {rope.get('rope_type')!r} without a 'factor' is not "
                                    "supported (transformers requires it too)")
    Rotary(dr, rope, max_pos)  # refuses unsupported RoPE types now, at load
    act = c.act()
    scale = (dn + dr) ** -0.5
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        # the YaRN attention-temperature correction, applied to the softmax scale (squared)
        factor = float(rope["factor"])
        m = 1.0 if factor <= 1 else 0.1 * float(rope["mscale_all_dim"]) * math.log(factor) + 1.0
        scale = scale * m * m
    weights = WeightFormat(raw.get("quantization_config"), c.where)
    n_shared = c.int("n_shared_experts", defaults["n_shared_experts"], lo=0, hi=MAX_EXPERTS, null=0)
    hidden, moe_inter = c.pos_int("hidden_size"), c.pos_int("moe_intermediate_size")
    return Config(
        vocab_size=c.pos_int("vocab_size"),
        hidden_size=hidden,
        intermediate_size=c.pos_int("intermediate_size"),
        moe_intermediate_size=moe_inter,
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        hidden_act=act,
        rms_norm_eps=c.eps(defaults["rms_norm_eps"]),
        max_position_embeddings=max_pos,
        tie_word_embeddings=c.bool("tie_word_embeddings", False),
        attention_bias=c.bool("attention_bias", False),
        q_lora_rank=q_lora,
        kv_lora_rank=_positive_int(c, "kv_lora_rank", _raw_or_default(raw, "kv_lora_rank", defaults)),
        qk_nope_head_dim=dn,
        qk_rope_head_dim=dr,
        v_head_dim=dv,
        rope_interleave=c.bool("rope_interleave", defaults["rope_interleave"]),
        n_routed_experts=n_experts,
        n_shared_experts=int(n_shared),
        num_experts_per_tok=k,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=c.bool("norm_topk_prob", defaults["norm_topk_prob"]),
        routed_scaling_factor=c.float("routed_scaling_factor", defaults["routed_scaling_factor"], positive=True),
        moe_layers=moe,
        mtp_layers=c.int("num_nextn_predict_layers", 0, "num_mtp_layers", lo=0, hi=MAX_LAYERS),
        rope=rope,
        softmax_scale=scale,
        weights=weights,
        model_type=raw.get("model_type", family),
        family=family,
    )


def mla_args(cfg: Config) -> dict:
    """``parts.mla``'s arguments for ``cfg``'s attention (DeepSeek-V3.2's sparse attention adds its own)."""
    # q_a_layernorm / kv_a_layernorm use the RMSNorm default eps, not rms_norm_eps
    return dict(q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
                qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, bias=cfg.attention_bias,
                scale=cfg.softmax_scale, interleave=cfg.rope_interleave, norm_eps=1e-6)


def declare(cfg: Config, attention=None) -> Model:
    """The model; ``attention(i)``: layer i's attention part (default: MLA on every layer)."""
    h, eps = cfg.hidden_size, cfg.rms_norm_eps
    attn = mla(h, cfg.num_attention_heads, **mla_args(cfg))

    def mlp(i: int):
        if i in cfg.moe_layers:
            router = grouped_router(cfg.n_routed_experts, h, cfg.num_experts_per_tok, scoring="sigmoid",
                                    n_group=cfg.n_group, topk_group=cfg.topk_group, normalize=cfg.norm_topk_prob,
                                    scale=cfg.routed_scaling_factor)
            shared = gated_mlp(h, cfg.moe_intermediate_size * cfg.n_shared_experts, cfg.hidden_act, prefix="") \
                if cfg.n_shared_experts else None
            return moe(router, shared=shared)
        return gated_mlp(h, cfg.intermediate_size, cfg.hidden_act)

    layers = [Layer(i, rms_norm(h, eps), rms_norm(h, eps), attn if attention is None else attention(i), mlp(i))
              for i in range(cfg.num_hidden_layers)]
    return Model(cfg.vocab_size, h, layers, rms_norm(h, eps), cfg.tie_word_embeddings,
                 lambda: Rotary(cfg.qk_rope_head_dim, cfg.rope, cfg.max_position_embeddings),
                 weights=cfg.weights, prefix=cfg.prefix)


def describe(cfg: Config, model: Model | None = None, more_notes: tuple[str, ...] = ()) -> ModelDescription:
    """``model``: the declaration, when a family declares its own (DeepSeek-V3.2); ``more_notes``: its notes."""
    h, dr, rank = cfg.hidden_size, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    spec = ExpertSpec(hidden=h, intermediate=cfg.moe_intermediate_size, act=cfg.hidden_act)
    model = model or declare(cfg)
    notes = []
    if cfg.mtp_layers:
        n = cfg.num_hidden_layers
        notes.append(f"{cfg.mtp_layers} multi-token-prediction layer(s) ({cfg.prefix}model.layers.{n}"
                     f"{'..' + str(n + cfg.mtp_layers - 1) if cfg.mtp_layers > 1 else ''}.*) are not used: "
                     "generation predicts one token per step")
    notes.append(f"MLA latent cache: {rank} + {dr} floats per position per layer (not full K/V)")
    notes.extend(more_notes)
    if cfg.model_type != cfg.family:
        notes.append(f"model_type {cfg.model_type!r} read as {cfg.family}")
    if cfg.prefix:
        notes.append(f"multimodal wrapper: the text model (tensors under {cfg.prefix!r}); the vision tower and "
                     "projector are not read")
    return model.describe(
        model_type=cfg.model_type, n_experts=cfg.n_routed_experts, top_k=cfg.num_experts_per_tok,
        **model.routed_experts(spec, cfg.prefix + "model.layers.{layer}.mlp.experts.{e}.{name}", PROJ_NAMES),
        max_position_embeddings=cfg.max_position_embeddings, attn_heads=cfg.num_attention_heads, notes=notes,
    )


def build(cfg: Config, w, experts) -> CausalLM:
    return declare(cfg).build(w, experts)
