"""MiniMax-M2 (``model_type: minimax_m2``; M2, M2.1, M2.5 and M2.7 ship this architecture).

GQA with q/k RMSNorm over the whole projection (all heads together, before the heads are
split), partial RoPE on the first ``rotary_dim`` dims of each head, every layer an MoE block
``block_sparse_moe``: sigmoid scores, the selection-only ``e_score_correction_bias`` on the
MoE block itself (not on its gate), top-k without groups, the chosen sigmoid scores
renormalised (no scaling factor), no shared experts; experts ``w1`` (gate), ``w3`` (up),
``w2`` (down). Block-FP8 checkpoints (``weight_scale_inv``) stay FP8: the attention
projections and the experts (``models/weight_format.py``, ``quant/fp8.py``).

Semantics follow transformers 5.24 (modeling_minimax_m2.py, the oracle). Keys transformers
ignores but that would change the computation (MiniMax-01's lightning attention layers, other
qk-norm kinds, shared experts, a sliding window, ...) are refused at their non-default values.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UnsupportedModelError
from ..experts.spec import ExpertSpec
from ..layers.rotary import Rotary, rope_parameters
from .base import CausalLM, ModelDescription
from .config import MAX_EXPERTS, MAX_LAYERS, MAX_POSITIONS, REQUIRED, RawConfig, check_rope
from .declare import Layer, Model
from .parts import attention, grouped_router, moe, rms_norm
from .weight_format import WeightFormat

MODEL_TYPE = "minimax_m2"
ROLE_NAMES = {"gate": "w1", "up": "w3", "down": "w2"}  # the checkpoints' expert projection names
EXPERT_TEMPLATE = "model.layers.{layer}.block_sparse_moe.experts.{e}.{name}"  # + ".weight" (+ its scales)

# keys of MiniMax-01 (model_type "minimax") and the original MiniMax-M2 config.json that
# transformers' MiniMaxM2 ignores: the value it computes with (anything else is refused)
_IGNORED = {
    "use_qk_norm": (True,),  # transformers always applies q_norm / k_norm
    "qk_norm_type": ("per_layer",),  # over the whole projection; "per_head" would differ
    "scoring_func": ("sigmoid",),
    "use_routing_bias": (True,),  # e_score_correction_bias always applies
    "shared_intermediate_size": (0,),  # no shared experts
    "n_shared_experts": (0,),
    "num_shared_experts": (0,),
    "norm_topk_prob": (True,),  # the chosen weights are always renormalised
    "routed_scaling_factor": (1, 1.0),
    "n_group": (1,),
    "topk_group": (1,),
    "attention_bias": (False,),  # q/k/v/o have no biases
    "use_sliding_window": (False,),
    "layernorm_full_attention_alpha": (1, 1.0),  # MiniMax-01 residual scaling
    "layernorm_full_attention_beta": (1, 1.0),
    "layernorm_linear_attention_alpha": (1, 1.0),
    "layernorm_linear_attention_beta": (1, 1.0),
    "layernorm_mlp_alpha": (1, 1.0),
    "layernorm_mlp_beta": (1, 1.0),
}


@dataclass
class Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # each expert's (MiniMax-M2 has no dense MLP)
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    hidden_act: str
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    num_experts: int
    num_experts_per_tok: int
    mtp_layers: int
    rope: dict
    weights: WeightFormat


def _rope(c: RawConfig, raw: dict, head_dim: int) -> tuple[dict, int]:
    """The RoPE parameters and the rotated dims per head: ``rotary_dim`` (the original configs)
    or ``partial_rotary_factor`` (as transformers saves them; it derives one from the other)."""
    rope = rope_parameters({"rope_theta": 5e6, **raw})
    if "rotary_dim" in c:
        rd = c.pos_int("rotary_dim", hi=head_dim)
        if rd % 2:
            raise UnsupportedModelError(f"config.json: rotary_dim={rd} must be even (dims are rotated in pairs)")
        factor = rd / head_dim
        given = rope.get("partial_rotary_factor")
        if given is not None and given != factor:
            raise UnsupportedModelError(
                f"config.json: rotary_dim={rd} and partial_rotary_factor={given!r} disagree (head_dim={head_dim})")
        rope["partial_rotary_factor"] = factor
    rope = check_rope(rope)
    dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    if dim % 2 or dim < 2:
        raise UnsupportedModelError(f"config.json: partial_rotary_factor={rope['partial_rotary_factor']!r} rotates "
                                    f"{dim} of head_dim={head_dim} dims (must be a positive even number)")
    return rope, dim


def parse_config(raw: dict) -> Config:
    c = RawConfig(raw)
    n_layers = c.layers()
    hidden = c.pos_int("hidden_size")
    heads, kv, head_dim = c.heads(hidden)
    for key, allowed in _IGNORED.items():
        c.refuse(key, allowed, "transformers' MiniMax-M2 computes as if it were "
                 f"{allowed[0]!r}; another value would be silently different")
    if c.raw.get("sliding_window") is not None:
        raise UnsupportedModelError(f"config.json: sliding_window={c.raw['sliding_window']!r} is not supported "
                                    "(MiniMax-M2 attends to the whole context)")
    types = c.int_list("attn_type_list", [1] * n_layers, lo=0, hi=1)
    if 0 in types:
        raise UnsupportedModelError(
            f"config.json: attn_type_list has 0 at layer {types.index(0)}: MiniMax-01's lightning (linear) "
            "attention layers are not supported (MiniMax-M2 has full attention in every layer)")
    n_experts = c.pos_int("num_local_experts", REQUIRED, "num_experts", hi=MAX_EXPERTS)
    use_mtp = c.bool("use_mtp", False)
    mtp = c.int("num_mtp_modules", 0, lo=0, hi=MAX_LAYERS) if use_mtp else 0
    rope, rotary_dim = _rope(c, raw, head_dim)
    max_pos = c.pos_int("max_position_embeddings", 196608, hi=MAX_POSITIONS)
    Rotary(head_dim, rope, max_pos)  # refuses unsupported RoPE types now, at load
    return Config(
        vocab_size=c.pos_int("vocab_size"),
        hidden_size=hidden,
        intermediate_size=c.pos_int("intermediate_size"),
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        hidden_act=c.act(),
        rms_norm_eps=c.eps(1e-6),
        max_position_embeddings=max_pos,
        tie_word_embeddings=c.bool("tie_word_embeddings", False),
        num_experts=n_experts,
        num_experts_per_tok=c.top_k("num_experts_per_tok", n_experts),
        mtp_layers=mtp,
        rope=rope,
        weights=WeightFormat(raw.get("quantization_config"), c.where),
    )


def declare(cfg: Config) -> Model:
    h, eps = cfg.hidden_size, cfg.rms_norm_eps
    # the bias sits on the MoE block (block_sparse_moe.e_score_correction_bias), beside its gate
    router = grouped_router(cfg.num_experts, h, cfg.num_experts_per_tok, weight="gate.weight", scoring="sigmoid",
                            n_group=1, topk_group=1, normalize=True, scale=1.0)
    layers = [Layer(i, rms_norm(h, eps), rms_norm(h, eps),
                    attention(h, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, eps,
                              qk_norm="full"),
                    moe(router, prefix="block_sparse_moe.", router_name=""))
              for i in range(cfg.num_hidden_layers)]
    return Model(cfg.vocab_size, h, layers, rms_norm(h, eps), cfg.tie_word_embeddings,
                 lambda: Rotary(cfg.head_dim, cfg.rope, cfg.max_position_embeddings),
                 weights=cfg.weights)


def describe(cfg: Config) -> ModelDescription:
    spec = ExpertSpec(hidden=cfg.hidden_size, intermediate=cfg.intermediate_size, act=cfg.hidden_act)
    model = declare(cfg)
    notes = [f"partial RoPE: {cfg.rotary_dim} of {cfg.head_dim} dims per head"]
    if cfg.mtp_layers:
        notes.append(f"{cfg.mtp_layers} multi-token-prediction module(s) are not used: generation predicts one "
                     "token per step")
    return model.describe(
        model_type=MODEL_TYPE, n_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
        **model.routed_experts(spec, EXPERT_TEMPLATE, ROLE_NAMES), max_position_embeddings=cfg.max_position_embeddings,
        attn_heads=cfg.num_attention_heads, notes=notes,
    )


def build(cfg: Config, w, experts) -> CausalLM:
    return declare(cfg).build(w, experts)
