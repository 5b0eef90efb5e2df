"""ERNIE-4.5 MoE (``model_type: ernie4_5_moe``; ERNIE-4.5-21B-A3B and 300B-A47B, their Base,
PT and Thinking checkpoints).

GQA with GPT-J style RoPE over the whole head (dims 2i and 2i+1 rotated together); the MLP of
layer i is an MoE block when ``(i + 1) % moe_layer_interval == 0`` and ``moe_layer_start_index
<= i <= moe_layer_end_index`` (-1: the last layer), a dense SwiGLU MLP otherwise. The router
(``mlp.gate``) is a softmax over the experts in fp32; the top-k experts are selected by the
probabilities plus the selection-only ``mlp.moe_statics.e_score_correction_bias`` ([1, E] as
stored), weighted by their own probabilities renormalised by their sum clamped below at
``moe_norm_min``; shared experts (``moe_num_shared_experts`` x ``moe_intermediate_size``, one
SwiGLU MLP) are added ungated. ``use_bias`` puts a bias on every projection of attention, the
dense and shared MLPs and the head (``lm_head.bias``, also when the head is tied), never on
the routed experts or the router (transformers has none there).

Precision, as transformers 5.24 computes it (modeling_ernie4_5_moe.py): the router's linear,
softmax, biased top-k and renormalisation run in fp32 with the gate weight and the bias kept
in fp32 (``_keep_in_fp32_modules_strict``); Sluice computes every router in fp32 from the
stored weight, whatever its dtype. Multi-token-prediction weights (``mtp_*``,
``num_nextn_predict_layers``) are not used, as in transformers. Keys of the original Paddle
configs that transformers ignores but that would change the computation are refused at
their non-default values.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UnsupportedModelError
from ..experts.spec import ExpertSpec
from ..layers.rotary import Rotary, rope_parameters
from .base import CausalLM, ModelDescription
from .config import MAX_DIM, MAX_EXPERTS, MAX_LAYERS, MAX_POSITIONS, RawConfig, check_rope
from .declare import Layer, Model
from .parts import attention, gated_mlp, moe, rms_norm, softmax_router
from .standard import PROJ_NAMES
from .weight_format import PLAIN, WeightFormat

MODEL_TYPE = "ernie4_5_moe"
EXPERT_TEMPLATE = "model.layers.{layer}.mlp.experts.{e}.{name}"  # per expert, gate/up/down_proj (+ ".weight")
BIAS = "moe_statics.e_score_correction_bias"  # under mlp.; [1, E]
GATE_BIAS = "gate." + BIAS  # where transformers keeps it in memory (its conversion mapping renames it)

# keys of the original (Paddle) ERNIE-4.5 configs that transformers' Ernie4_5_Moe ignores:
# the value it computes as if it were (anything else is refused)
_IGNORED = {
    "use_rmsnorm": (True,),  # RMSNorm (False: LayerNorm)
    "moe_gate_act": ("softmax",),
    "scoring_func": ("softmax",),
    "moe_use_aux_free": (True,),  # the correction bias always selects
    "moe_norm_gate_logits": (True,),  # the chosen weights are always renormalised
    "moe_group_experts": (False,),
    "moe_use_hard_gate": (False,),
    "use_sliding_window": (False,),
    "sliding_window": (),  # any value: transformers attends to the whole context
}


@dataclass
class Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense layers'
    moe_intermediate_size: int  # each routed expert's
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_act: str
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    use_bias: bool
    num_experts: int
    num_experts_per_tok: int
    num_shared_experts: int
    norm_min: float
    moe_layers: list[int]
    mtp_layers: int
    rope: dict
    weights: WeightFormat = PLAIN


def moe_schedule(n_layers: int, start: int, end: int, interval: int) -> list[int]:
    """The MoE layers: ``(i + 1) % interval == 0`` and ``start <= i <= end`` (end -1: the last layer)."""
    end = n_layers - 1 if end == -1 else end
    return [i for i in range(n_layers) if (i + 1) % interval == 0 and start <= i <= end]


def parse_config(raw: dict) -> Config:
    c = RawConfig(raw)
    n_layers = c.layers()
    hidden = c.pos_int("hidden_size")
    heads, kv, head_dim = c.heads(hidden)
    for key, allowed in _IGNORED.items():
        c.refuse(key, allowed, "transformers' ERNIE-4.5 MoE computes as if it were "
                 f"{allowed[0] if allowed else None!r}; another value would be silently different")
    n_experts = c.pos_int("moe_num_experts", 64, "num_experts", hi=MAX_EXPERTS)
    top_k = c.top_k("moe_k", n_experts, 6, "num_experts_per_tok")
    start = c.int("moe_layer_start_index", 1, lo=0, hi=MAX_LAYERS)
    end = c.int("moe_layer_end_index", -1, lo=-1, hi=MAX_LAYERS)
    interval = c.pos_int("moe_layer_interval", 1, hi=MAX_LAYERS)
    layers = moe_schedule(n_layers, start, end, interval)
    if not layers:
        raise UnsupportedModelError(
            f"config.json: moe_layer_start_index={start}, moe_layer_end_index={end}, moe_layer_interval={interval} "
            f"make none of the {n_layers} layers an MoE layer (a dense model: Sluice runs MoE models)")
    moe_inter = c.pos_int("moe_intermediate_size", 1536)
    shared = c.int("moe_num_shared_experts", 2, lo=0, hi=MAX_EXPERTS)
    if shared * moe_inter > MAX_DIM:
        raise UnsupportedModelError(f"config.json: moe_num_shared_experts={shared} x moe_intermediate_size="
                                    f"{moe_inter} is a shared MLP wider than {MAX_DIM}")
    rope = check_rope(rope_parameters({"rope_theta": 500000.0, **raw}))
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError(
            f"config.json: partial_rotary_factor={rope['partial_rotary_factor']!r} is not supported "
            "(ERNIE-4.5 rotates the whole head; transformers' ERNIE cannot rotate part of it)")
    max_pos = c.pos_int("max_position_embeddings", 131072, hi=MAX_POSITIONS)
    try:
        Rotary(head_dim, rope, max_pos)  # refuses unsupported RoPE types now, at load
    except UnsupportedModelError as e:
        raise UnsupportedModelError(f"config.json: {e}") from None
    return Config(
        vocab_size=c.pos_int("vocab_size"),
        hidden_size=hidden,
        intermediate_size=c.pos_int("intermediate_size", 12288),
        moe_intermediate_size=moe_inter,
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        hidden_act=c.act(),
        rms_norm_eps=c.eps(1e-5),
        max_position_embeddings=max_pos,
        tie_word_embeddings=c.bool("tie_word_embeddings", True),
        use_bias=c.bool("use_bias", False),
        num_experts=n_experts,
        num_experts_per_tok=top_k,
        num_shared_experts=shared,
        norm_min=c.float("moe_norm_min", 1e-12, lo=0.0),
        moe_layers=layers,
        mtp_layers=c.int("num_nextn_predict_layers", 0, lo=0, hi=MAX_LAYERS),
        rope=rope,
        weights=WeightFormat(raw.get("quantization_config"), c.where),
    )


def declare(cfg: Config) -> Model:
    h, eps, bias, act = cfg.hidden_size, cfg.rms_norm_eps, cfg.use_bias, cfg.hidden_act
    e = cfg.num_experts

    def mlp(i: int):
        if i not in cfg.moe_layers:
            return gated_mlp(h, cfg.intermediate_size, act, bias=bias)
        router = softmax_router(e, h, cfg.num_experts_per_tok, True, weight="gate.weight", correction=BIAS,
                                correction_shape=(1, e), norm_min=cfg.norm_min)
        shared = (gated_mlp(h, cfg.moe_intermediate_size * cfg.num_shared_experts, act, prefix="", bias=bias)
                  if cfg.num_shared_experts else None)
        return moe(router, router_name="", shared=shared)

    layers = [Layer(i, rms_norm(h, eps), rms_norm(h, eps),
                    attention(h, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, eps, bias=bias,
                              rope="pairs"), mlp(i))
              for i in range(cfg.num_hidden_layers)]
    return Model(cfg.vocab_size, h, layers, rms_norm(h, eps), cfg.tie_word_embeddings,
                 lambda: Rotary(cfg.head_dim, cfg.rope, cfg.max_position_embeddings), head_bias=bias,
                 weights=cfg.weights)


def describe(cfg: Config) -> ModelDescription:
    spec = ExpertSpec(hidden=cfg.hidden_size, intermediate=cfg.moe_intermediate_size, act=cfg.hidden_act)
    notes = []
    if cfg.mtp_layers:
        notes.append(f"{cfg.mtp_layers} multi-token-prediction layer(s) are not used: generation predicts one "
                     "token per step")
    model = declare(cfg)
    return model.describe(
        model_type=MODEL_TYPE, n_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
        **model.routed_experts(spec, EXPERT_TEMPLATE, PROJ_NAMES),
        max_position_embeddings=cfg.max_position_embeddings, attn_heads=cfg.num_attention_heads, notes=notes,
    )


def tensor_aliases(cfg: Config) -> dict[str, str]:
    """The correction bias is ``mlp.moe_statics.*`` in the published checkpoints (and as transformers
    saves them), ``mlp.gate.moe_statics.*`` in transformers' modules (a state dict saved as is)."""
    return {f"model.layers.{i}.mlp.{BIAS}": f"model.layers.{i}.mlp.{GATE_BIAS}" for i in cfg.moe_layers}


def build(cfg: Config, w, experts) -> CausalLM:
    return declare(cfg).build(w, experts)
