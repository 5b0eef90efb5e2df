"""Hunyuan-A13B (``model_type: hunyuan_v1_moe``; Tencent Hunyuan-A13B-Pretrain / -Instruct).

GQA with per-head q/k RMSNorm (``query_layernorm`` / ``key_layernorm``) applied AFTER RoPE,
RoPE over the whole head with NTK-alpha base stretching (the checkpoints' ``rope_scaling``
``{"type": "dynamic", "alpha": 1000.0, ...}``: base ``theta * alpha ** (d / (d - 2))``, the
same at every length), every layer an MoE block: a softmax router ``mlp.gate.wg`` with the
chosen probabilities renormalised, top-k per layer (``moe_topk`` may be a list), an always-on
shared MLP ``mlp.shared_mlp`` (no gate) of ``intermediate_size``, and routed experts of the
same size (``mlp.experts.<e>.gate_proj/up_proj/down_proj``).

Semantics follow transformers 5.24 (modeling_hunyuan_v1_moe.py, the oracle). Keys of the
original Hunyuan config.json that transformers ignores but that would change the computation
(cross-layer KV sharing ``use_cla``, MLA, no shared MLP, several shared experts, expert sizes
other than ``intermediate_size``, unnormalised top-k, ...) are refused at their non-default
values. A list of per-layer expert counts is refused: transformers' config holds one integer.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError, UnsupportedModelError
from ..experts.spec import ExpertSpec
from ..layers.rotary import Rotary, rope_parameters
from .base import CausalLM, ModelDescription
from .config import MAX_EXPERTS, MAX_POSITIONS, RawConfig, check_rope, number
from .declare import Layer, Model
from .parts import attention, gated_mlp, moe, rms_norm, softmax_router
from .standard import PROJ_NAMES
from .weight_format import PLAIN, WeightFormat

MODEL_TYPE = "hunyuan_v1_moe"
EXPERT_TEMPLATE = "model.layers.{layer}.mlp.experts.{e}.{name}"  # + ".weight"

# keys of the original Hunyuan config.json that transformers' HunYuanMoEV1 ignores: the value
# it computes with (anything else is refused)
_IGNORED = {
    "use_qk_norm": (True, 1),  # query_layernorm / key_layernorm always apply
    "use_rotary_pos_emb": (True, 1),
    "use_mixed_mlp_moe": (True, 1),  # the shared MLP always runs
    "use_cla": (False, 0),  # cross-layer attention (KV shared between layers)
    "use_mla": (False, 0),
    "mlp_bias": (False,),  # the MLPs and experts have no biases
    "moe_layer_num_skipped": (0,),  # every layer is an MoE block
    "norm_topk_prob": (True,),  # the chosen probabilities are always renormalised
    "routed_scaling_factor": (1, 1.0),
    "group_limited_greedy": (False,),
    "n_group": (1,),
    "topk_group": (1,),
    "use_sliding_window": (False,),
    "moe_drop_tokens": (False,),
    "moe_random_routing_dropped_token": (False,),
}


@dataclass
class Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the shared MLP's and each expert's
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_act: str
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    num_experts: int
    moe_topk: list[int]  # per layer
    rope: dict
    weights: WeightFormat = PLAIN


def _uniform(c: RawConfig, key: str, want, n_layers: int, why: str) -> None:
    """``key`` (an int or a per-layer list) must be ``want`` in every layer, else refused."""
    v = c.raw.get(key)
    if v is None:
        return
    values = v if isinstance(v, list) else [v]
    if isinstance(v, list) and len(v) != n_layers:
        raise ConfigError(f"config.json: {key} has {len(v)} entries, expected one per layer "
                          f"(num_hidden_layers={n_layers})")
    for i, x in enumerate(values):
        if isinstance(x, bool) or not isinstance(x, int) or x < 0:
            raise c.bad(key, v, "a non-negative integer or a list of them, one per layer")
        if x != want:
            where = f" at layer {i}" if isinstance(v, list) else ""
            raise UnsupportedModelError(f"config.json: {key}={x!r}{where} is not supported ({why})")


def _top_k(c: RawConfig, n_layers: int, n_experts: int) -> list[int]:
    """``moe_topk`` (alias ``num_experts_per_tok``): one integer or one per layer, 1..n_experts."""
    key = "moe_topk" if "moe_topk" in c else "num_experts_per_tok"
    v = c.raw.get(key, 1)
    if not isinstance(v, list):
        return [c.top_k(key, n_experts, 1)] * n_layers
    if len(v) != n_layers:
        raise ConfigError(f"config.json: {key} has {len(v)} entries, expected one per layer "
                          f"(num_hidden_layers={n_layers})")
    for x in v:
        if isinstance(x, bool) or not isinstance(x, int) or not 1 <= x <= n_experts:
            raise ConfigError(f"config.json: {key}={v!r} is invalid: expected integers from 1 to the "
                              f"{n_experts} experts, one per layer")
    return list(v)


def _rope(c: RawConfig, raw: dict, head_dim: int, max_pos: int) -> dict:
    """RoPE as transformers' Hunyuan computes it: "dynamic" with an ``alpha`` is NTK-alpha
    (fixed frequencies); "dynamic" without one is dynamic NTK (``factor``)."""
    rope = check_rope(rope_parameters(raw))
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError(f"config.json: partial_rotary_factor={rope['partial_rotary_factor']!r} is "
                                    "not supported (Hunyuan rotates the whole head)")
    alpha = rope.get("alpha")
    if alpha is not None:
        number(alpha, "rope_scaling.alpha", positive=True)
        if rope["rope_type"] not in ("dynamic", "ntk_alpha"):
            raise UnsupportedModelError(f"config.json: rope_scaling.alpha={alpha!r} with RoPE type "
                                        f"{rope['rope_type']!r} is not supported (alpha applies to 'dynamic' only)")
        rope["rope_type"] = "ntk_alpha"
    elif rope["rope_type"] in ("dynamic", "linear") and rope.get("factor") is None:
        raise ConfigError(f"config.json: RoPE type {rope['rope_type']!r} needs a factor (or, for 'dynamic', "
                          "an alpha)")
    if rope["rope_type"] in ("dynamic", "ntk_alpha") and head_dim <= 2:
        raise UnsupportedModelError(f"config.json: head_dim={head_dim} is too small for NTK RoPE (needs > 2)")
    try:
        Rotary(head_dim, rope, max_pos, ntk=True)  # refuses unsupported RoPE types now, at load
    except UnsupportedModelError as e:
        raise UnsupportedModelError(f"config.json: {e}") from None
    return rope


def parse_config(raw: dict) -> Config:
    c = RawConfig(raw)
    n_layers = c.layers()
    hidden = c.pos_int("hidden_size")
    heads, kv, head_dim = c.heads(hidden)
    if head_dim % 2:
        raise ConfigError(f"config.json: head_dim={head_dim} is invalid: RoPE rotates dims in pairs (must be even)")
    for key, allowed in _IGNORED.items():
        c.refuse(key, allowed, "transformers' Hunyuan computes as if it were "
                 f"{allowed[0]!r}; another value would be silently different")
    if c.raw.get("sliding_window") is not None:
        raise UnsupportedModelError(f"config.json: sliding_window={c.raw['sliding_window']!r} is not supported "
                                    "(Hunyuan attends to the whole context)")
    if "attention_head_dim" in c and c.pos_int("attention_head_dim") != head_dim:
        raise UnsupportedModelError(f"config.json: attention_head_dim={c.raw['attention_head_dim']!r} differs "
                                    f"from head_dim={head_dim} (transformers sizes the heads by head_dim)")
    if isinstance(c.raw.get("num_experts"), list):
        raise UnsupportedModelError(
            f"config.json: num_experts={c.raw['num_experts']!r} per layer is not supported (transformers' "
            "HunYuanMoEV1Config holds one expert count for every layer)")
    n_experts = c.pos_int("num_experts", 1, "num_local_experts", hi=MAX_EXPERTS)
    intermediate = c.pos_int("intermediate_size")
    _uniform(c, "moe_intermediate_size", intermediate, n_layers,
             f"transformers sizes every expert by intermediate_size={intermediate}")
    _uniform(c, "num_shared_expert", 1, n_layers, "transformers has exactly one shared MLP per layer")
    max_pos = c.pos_int("max_position_embeddings", 2048, hi=MAX_POSITIONS)
    return Config(
        vocab_size=c.pos_int("vocab_size"),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        hidden_act=c.act(),
        rms_norm_eps=c.eps(1e-5),
        max_position_embeddings=max_pos,
        tie_word_embeddings=c.bool("tie_word_embeddings", False),
        attention_bias=c.bool("attention_bias", False),
        num_experts=n_experts,
        moe_topk=_top_k(c, n_layers, n_experts),
        rope=_rope(c, raw, head_dim, max_pos),
        weights=WeightFormat(raw.get("quantization_config"), c.where),
    )


def declare(cfg: Config) -> Model:
    h, eps, inter = cfg.hidden_size, cfg.rms_norm_eps, cfg.intermediate_size
    layers = [Layer(i, rms_norm(h, eps), rms_norm(h, eps),
                    attention(h, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, eps,
                              bias=cfg.attention_bias, qk_norm="head", norm_after_rope=True,
                              norm_names=("query_layernorm", "key_layernorm")),
                    moe(softmax_router(cfg.num_experts, h, cfg.moe_topk[i], normalize=True), router_name="gate.wg.",
                        shared=gated_mlp(h, inter, cfg.hidden_act, prefix=""), shared_name="shared_mlp."))
              for i in range(cfg.num_hidden_layers)]
    return Model(cfg.vocab_size, h, layers, rms_norm(h, eps), cfg.tie_word_embeddings,
                 lambda: Rotary(cfg.head_dim, cfg.rope, cfg.max_position_embeddings, ntk=True),
                 weights=cfg.weights)


def describe(cfg: Config) -> ModelDescription:
    spec = ExpertSpec(hidden=cfg.hidden_size, intermediate=cfg.intermediate_size, act=cfg.hidden_act)
    notes = []
    rope = cfg.rope
    if rope["rope_type"] == "ntk_alpha":
        notes.append(f"NTK-alpha RoPE: base {rope['rope_theta']!r} stretched by alpha={rope['alpha']!r}")
    elif rope["rope_type"] == "dynamic":
        notes.append(f"dynamic NTK RoPE (factor {rope['factor']!r}) rescales only beyond max_position_embeddings="
                     f"{cfg.max_position_embeddings}, which the context never exceeds")
    if len(set(cfg.moe_topk)) > 1:
        notes.append(f"experts per token vary by layer ({min(cfg.moe_topk)}..{max(cfg.moe_topk)}); plans count "
                     f"{max(cfg.moe_topk)} in every layer")
    model = declare(cfg)
    return model.describe(
        model_type=MODEL_TYPE, n_experts=cfg.num_experts, top_k=max(cfg.moe_topk),
        **model.routed_experts(spec, EXPERT_TEMPLATE, PROJ_NAMES),
        max_position_embeddings=cfg.max_position_embeddings, attn_heads=cfg.num_attention_heads, notes=notes,
    )


def build(cfg: Config, w, experts) -> CausalLM:
    return declare(cfg).build(w, experts)
