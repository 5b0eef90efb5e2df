"""Qwen3-Next (``model_type: qwen3_next``): a hybrid of Gated DeltaNet linear attention and
gated full attention (sigmoid output gate, per-head (1 + w) q/k norms, partial rotary),
zero-centred (1 + w) RMSNorm, softmax top-k routing with a sigmoid-gated shared expert,
dense layers via ``mlp_only_layers`` / ``decoder_sparse_step``.

Multi-token-prediction weights (``mtp.*``) are not used (transformers ignores them too).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import UnsupportedModelError
from ..experts.spec import ExpertSpec
from ..layers.gated_delta import SNAPSHOTS
from ..layers.rotary import Rotary, rope_parameters
from ..units import format_size
from .base import CausalLM, ModelDescription
from .config import MAX_DIM, MAX_EXPERTS, MAX_HEAD_DIM, MAX_HEADS, MAX_LAYERS, MAX_POSITIONS, RawConfig, check_rope
from .declare import Layer, Model
from .parts import gated_attention, gated_delta, gated_mlp, moe, rms_norm, softmax_router
from .standard import PROJ_NAMES
from .weight_format import PLAIN, WeightFormat

MODEL_TYPE = "qwen3_next"
LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass
class Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
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
    num_experts_per_tok: int
    norm_topk_prob: bool
    moe_layers: list[int]
    layer_types: list[str]
    linear_conv_kernel_dim: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    rope: dict
    raw: dict
    model_type: str = MODEL_TYPE
    split_projections: bool = False  # Qwen3.5: in_proj_qkv/z/b/a instead of in_proj_qkvz/ba
    text_prefix: str = "model."  # where the text model's tensors are (Qwen3.5's wrapper: model.language_model.)
    notes: list[str] = field(default_factory=list)  # what the description adds (e.g. weights not read)
    weights: WeightFormat = PLAIN

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def full_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def conv_channels(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + \
            self.linear_num_value_heads * self.linear_value_head_dim


def parse_config(raw: dict, *, dense_layers: bool = True, where: str = "config.json") -> Config:
    """``dense_layers=False``: every layer is an MoE block and the top-k weights are always
    renormalised (Qwen3.5, which has no ``intermediate_size``, ``mlp_only_layers``,
    ``decoder_sparse_step`` nor ``norm_topk_prob``; its family refuses them)."""
    c = RawConfig(raw, where)
    n_layers = c.layers()
    hidden = c.pos_int("hidden_size")
    heads, kv, head_dim = c.heads(hidden)
    layer_types = c.get("layer_types", None)
    if layer_types is None:
        interval = c.pos_int("full_attention_interval", 4, hi=MAX_LAYERS)
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
    if not isinstance(layer_types, list) or len(layer_types) != n_layers:
        raise UnsupportedModelError(f"{where}: layer_types must list {n_layers} layer types, got {layer_types!r}")
    bad = sorted({str(t) for t in layer_types if t not in LAYER_TYPES})
    if bad:
        raise UnsupportedModelError(f"{where}: layer type(s) {bad} are not supported (supported: "
                                    f"{', '.join(LAYER_TYPES)})")
    n_experts = c.int("num_experts", 512, lo=0, hi=MAX_EXPERTS)
    if n_experts <= 0:
        raise UnsupportedModelError(f"{where}: num_experts=0 (a dense model) is not supported by the MoE engine")
    if dense_layers:
        step = c.pos_int("decoder_sparse_step", 1, hi=MAX_LAYERS)
        mlp_only = set(c.int_list("mlp_only_layers", (), lo=0))
        moe = [i for i in range(n_layers) if i not in mlp_only and (i + 1) % step == 0]
    else:
        moe = list(range(n_layers))
    if not moe:
        raise UnsupportedModelError(f"{where}: no MoE layer (a dense model) is not supported by the MoE engine")
    nk = c.pos_int("linear_num_key_heads", 16, hi=MAX_HEADS)
    nv = c.pos_int("linear_num_value_heads", 32, hi=MAX_HEADS)
    if nv % nk:
        raise UnsupportedModelError(
            f"{where}: linear_num_value_heads={nv} must be a multiple of linear_num_key_heads={nk}")
    shared = c.int("shared_expert_intermediate_size", 512, hi=MAX_DIM)
    if shared <= 0:
        raise UnsupportedModelError(f"{where}: shared_expert_intermediate_size={shared} is not supported "
                                    "(Qwen3-Next always has a shared expert)")
    rope = rope_parameters(raw)
    rope.setdefault("partial_rotary_factor", 0.25)  # transformers' default for this family
    check_rope(rope)
    cfg = Config(
        vocab_size=c.pos_int("vocab_size"),
        hidden_size=hidden,
        intermediate_size=c.pos_int("intermediate_size") if dense_layers else 0,
        moe_intermediate_size=c.pos_int("moe_intermediate_size", 512),
        shared_expert_intermediate_size=shared,
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        hidden_act=c.act(),
        rms_norm_eps=c.eps(1e-6),
        max_position_embeddings=c.pos_int("max_position_embeddings", 32768, hi=MAX_POSITIONS),
        tie_word_embeddings=c.bool("tie_word_embeddings", False),
        attention_bias=c.bool("attention_bias", False),
        num_experts=n_experts,
        num_experts_per_tok=c.top_k("num_experts_per_tok", n_experts, 10),
        norm_topk_prob=c.bool("norm_topk_prob", True) if dense_layers else True,
        moe_layers=moe,
        layer_types=list(layer_types),
        linear_conv_kernel_dim=c.pos_int("linear_conv_kernel_dim", 4, hi=MAX_HEAD_DIM),
        linear_key_head_dim=c.pos_int("linear_key_head_dim", 128, hi=MAX_HEAD_DIM),
        linear_value_head_dim=c.pos_int("linear_value_head_dim", 128, hi=MAX_HEAD_DIM),
        linear_num_key_heads=nk,
        linear_num_value_heads=nv,
        rope=rope,
        raw=raw,
        weights=WeightFormat(raw.get("quantization_config"), where),
    )
    try:  # refuse an unknown RoPE type at load, not at build
        Rotary(cfg.head_dim, rope, cfg.max_position_embeddings)
    except UnsupportedModelError as e:
        raise UnsupportedModelError(f"{where}: rope_parameters: {e}") from None
    return cfg


def declare(cfg: Config) -> Model:
    h, eps = cfg.hidden_size, cfg.rms_norm_eps

    def attn(i: int):
        if cfg.layer_types[i] == "linear_attention":
            return gated_delta(h, n_k=cfg.linear_num_key_heads, n_v=cfg.linear_num_value_heads,
                               dk=cfg.linear_key_head_dim, dv=cfg.linear_value_head_dim,
                               kernel=cfg.linear_conv_kernel_dim, act=cfg.hidden_act, eps=eps,
                               split=cfg.split_projections)
        return gated_attention(h, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, eps,
                               bias=cfg.attention_bias)

    def mlp(i: int):
        if i in cfg.moe_layers:
            return moe(softmax_router(cfg.num_experts, h, cfg.num_experts_per_tok, cfg.norm_topk_prob),
                       shared=gated_mlp(h, cfg.shared_expert_intermediate_size, cfg.hidden_act, prefix=""),
                       shared_name="shared_expert.", shared_gate=h)
        return gated_mlp(h, cfg.intermediate_size, cfg.hidden_act)

    layers = [Layer(i, rms_norm(h, eps, 1.0), rms_norm(h, eps, 1.0), attn(i), mlp(i))
              for i in range(cfg.num_hidden_layers)]
    rotary = (lambda: Rotary(cfg.head_dim, cfg.rope, cfg.max_position_embeddings)) if cfg.full_layers else \
        (lambda: None)
    return Model(cfg.vocab_size, h, layers, rms_norm(h, eps, 1.0), cfg.tie_word_embeddings, rotary, weights=cfg.weights)


def describe(cfg: Config) -> ModelDescription:
    spec = ExpertSpec(hidden=cfg.hidden_size, intermediate=cfg.moe_intermediate_size, act=cfg.hidden_act)
    model = declare(cfg)
    fixed = model.state()["state_bytes_fixed"]
    n_lin, n_full = len(cfg.linear_layers), len(cfg.full_layers)
    return model.describe(
        model_type=cfg.model_type, n_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
        **model.routed_experts(spec, cfg.text_prefix + "layers.{layer}.mlp.experts.{e}.{name}", PROJ_NAMES),
        max_position_embeddings=cfg.max_position_embeddings, attn_heads=cfg.num_attention_heads,
        notes=[f"hybrid attention: {n_lin} Gated DeltaNet layer(s) with a fixed-size recurrent state "
               f"({format_size(fixed)} with {SNAPSHOTS} snapshots kept for prefix reuse) and "
               f"{n_full} full-attention layer(s) with a KV cache", *cfg.notes],
    )


def build(cfg: Config, w, experts) -> CausalLM:
    return declare(cfg).build(w, experts)
