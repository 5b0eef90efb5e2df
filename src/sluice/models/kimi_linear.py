"""Kimi Linear (``model_type: kimi_linear``): a hybrid of Kimi Delta Attention (gated delta
rule with a per-channel decay, ``layers/gated_delta.py``) and Multi-head Latent Attention
without positional encoding (``layers/mla.py``, its rope sub-head used unrotated), sigmoid
group-limited routing with ``e_score_correction_bias`` and ``routed_scaling_factor``,
shared experts, dense layers first (``first_k_dense_replace`` / ``mlp_layer_types``).

Reads both the original config layout (``linear_attn_config``, ``model_max_length``,
``num_experts_per_token``, ...) and the one transformers writes. Semantics follow
transformers 5.24; keys that transformers ignores but that would change the computation
are refused when set to anything but the value transformers implements.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UnsupportedModelError
from ..experts.spec import ExpertSpec
from ..layers.gated_delta import SNAPSHOTS
from ..layers.mla import MLA
from ..units import format_size
from .base import CausalLM, ModelDescription
from .config import MAX_EXPERTS, MAX_HEAD_DIM, MAX_HEADS, MAX_POSITIONS, RawConfig
from .declare import Layer, Model
from .parts import gated_mlp, grouped_router, kimi_delta, mla, moe, rms_norm
from .weight_format import PLAIN, WeightFormat

MODEL_TYPE = "kimi_linear"
LAYER_TYPES = ("linear_attention", "full_attention")
MLP_TYPES = ("dense", "sparse")
LATENT_NORM_EPS = 1e-6  # transformers builds the MLA latent norms with the default eps, not rms_norm_eps

# Keys of the original config that transformers' kimi_linear does not read: the value it
# implements, and what it means. Any other value is refused.
_IGNORED_BY_TRANSFORMERS = {
    "moe_router_activation_func": ("sigmoid", "transformers routes with sigmoid scores"),
    "mla_use_nope": (True, "transformers' Kimi Linear MLA applies no rotary embedding"),
    "moe_layer_freq": (1, "transformers makes every layer from first_k_dense_replace on an MoE layer"),
    "mla_use_output_gate": (False, "transformers' Kimi Linear MLA has no output gate"),
    "use_full_rank_gate": (False, "transformers' KDA forget gate is low-rank (f_a, f_b)"),
}


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
    num_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    layer_types: list[str]
    mlp_layer_types: list[str]
    linear_head_dim: int
    linear_num_heads: int
    linear_conv_kernel_dim: int
    raw: dict
    weights: WeightFormat = PLAIN

    @property
    def moe_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.mlp_layer_types) if t == "sparse"]

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def full_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]


def _types(value, n: int, allowed: tuple[str, ...], key: str) -> list[str]:
    if not isinstance(value, list) or len(value) != n:
        raise UnsupportedModelError(f"config.json: {key} must list {n} layer types, got {value!r}")
    bad = sorted({str(t) for t in value if t not in allowed})
    if bad:
        raise UnsupportedModelError(f"config.json: {key} value(s) {bad} are not supported (supported: "
                                    f"{', '.join(allowed)})")
    return list(value)


def parse_config(raw: dict) -> Config:
    c = RawConfig(raw)
    for key, (implemented, why) in _IGNORED_BY_TRANSFORMERS.items():
        if key in raw and raw[key] != implemented:
            raise UnsupportedModelError(f"config.json: {key}={raw[key]!r} is not supported ({why})")
    for key in ("gate_lower_bound",):
        if raw.get(key) is not None or (raw.get("linear_attn_config") or {}).get(key) is not None:
            raise UnsupportedModelError(f"config.json: {key} is not supported (transformers' KDA has no gate bound)")
    n_layers = c.layers()
    heads, kv_heads, _ = c.heads(0, head_dim=False)
    if kv_heads != heads:
        raise UnsupportedModelError(f"config.json: num_key_value_heads={kv_heads} differs from num_attention_heads="
                                    f"{heads} (MLA has no key/value head groups)")
    lin = raw.get("linear_attn_config") or {}
    if not isinstance(lin, dict):
        raise UnsupportedModelError("config.json: linear_attn_config must be an object")
    if lin.get("use_full_rank_gate"):
        raise UnsupportedModelError("config.json: linear_attn_config.use_full_rank_gate is not supported "
                                    "(transformers' KDA forget gate is low-rank)")
    layer_types = raw.get("layer_types")
    if layer_types is None:
        if "full_attn_layers" in lin and "kda_layers" in lin:
            layer_types = [None] * n_layers
            try:
                for i in lin["full_attn_layers"]:
                    layer_types[i - 1] = "full_attention"  # 1-based in the original config
                for i in lin["kda_layers"]:
                    layer_types[i - 1] = "linear_attention"
            except (TypeError, IndexError):
                raise UnsupportedModelError("config.json: linear_attn_config layer lists are malformed") from None
        else:
            layer_types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n_layers)]
    layer_types = _types(layer_types, n_layers, LAYER_TYPES, "layer_types")
    mlp_types = raw.get("mlp_layer_types")
    if mlp_types is None:
        first_dense = c.int("first_k_dense_replace", 1, lo=0)
        mlp_types = ["dense" if i < first_dense else "sparse" for i in range(n_layers)]
    mlp_types = _types(mlp_types, n_layers, MLP_TYPES, "mlp_layer_types")
    n_experts = c.pos_int("num_experts", 256, "num_local_experts", "n_routed_experts", hi=MAX_EXPERTS)
    n_group = c.int("num_expert_group", 1, "n_group")
    topk_group = c.int("topk_group", 1)
    k = c.top_k("num_experts_per_token", n_experts, 8, "num_experts_per_tok")
    if n_group < 1 or n_experts % n_group or not 1 <= topk_group <= n_group:
        raise UnsupportedModelError(f"config.json: {n_experts} experts cannot be routed in {n_group} groups "
                                    f"keeping {topk_group}")
    if n_group > 1 and topk_group < n_group and n_experts // n_group < 2:
        raise UnsupportedModelError("config.json: group-limited routing needs at least 2 experts per group")
    if raw.get("use_grouped_topk") is False and 1 < n_group and topk_group < n_group:
        raise UnsupportedModelError("config.json: use_grouped_topk=false with expert groups is not supported "
                                    "(transformers always limits routing to the top groups)")
    n_shared = c.int("num_shared_experts", 1, "n_shared_experts", hi=MAX_EXPERTS)
    if n_shared < 1:
        raise UnsupportedModelError(f"config.json: num_shared_experts={n_shared} is not supported "
                                    "(transformers' Kimi Linear always has a shared expert)")
    lin_cfg = RawConfig(lin, "config.json: linear_attn_config")
    cfg = Config(
        vocab_size=c.pos_int("vocab_size"),
        hidden_size=c.pos_int("hidden_size"),
        intermediate_size=c.pos_int("intermediate_size"),
        moe_intermediate_size=c.pos_int("moe_intermediate_size", 1024),
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        hidden_act=c.act(),
        rms_norm_eps=c.eps(1e-5),
        max_position_embeddings=c.pos_int("model_max_length", 1048576, "max_position_embeddings", hi=MAX_POSITIONS),
        tie_word_embeddings=c.bool("tie_word_embeddings", False),
        attention_bias=c.bool("attention_bias", False),
        q_lora_rank=c.pos_int("q_lora_rank", None),
        kv_lora_rank=c.pos_int("kv_lora_rank", 512),
        qk_nope_head_dim=c.pos_int("qk_nope_head_dim", 128, hi=MAX_HEAD_DIM),
        qk_rope_head_dim=c.pos_int("qk_rope_head_dim", 64, hi=MAX_HEAD_DIM),
        v_head_dim=c.pos_int("v_head_dim", 128, hi=MAX_HEAD_DIM),
        num_experts=n_experts,
        num_experts_per_tok=k,
        n_shared_experts=n_shared,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=c.bool("moe_renormalize", True, "norm_topk_prob"),
        routed_scaling_factor=c.float("routed_scaling_factor", 2.446, positive=True),
        layer_types=layer_types,
        mlp_layer_types=mlp_types,
        linear_head_dim=lin_cfg.pos_int("head_dim", c.pos_int("linear_head_dim", 128, hi=MAX_HEAD_DIM),
                                        hi=MAX_HEAD_DIM),
        linear_num_heads=lin_cfg.pos_int("num_heads", c.pos_int("linear_num_heads", 32, hi=MAX_HEADS), hi=MAX_HEADS),
        linear_conv_kernel_dim=lin_cfg.pos_int("short_conv_kernel_size", c.pos_int("linear_conv_kernel_dim", 4,
                                                                                   hi=MAX_HEAD_DIM), hi=MAX_HEAD_DIM),
        raw=raw,
        weights=WeightFormat(raw.get("quantization_config"), c.where),
    )
    if not cfg.moe_layers:
        raise UnsupportedModelError("config.json: no MoE layer (a dense model) is not supported by the MoE engine")
    return cfg


def _prefix(i: int) -> str:
    return f"model.layers.{i}."


def tensor_aliases(cfg: Config) -> dict[str, str]:
    """Dense MLPs are ``mlp.*`` in the original checkpoints, ``block_sparse_moe.*`` as transformers saves
    them (their weights and, in FP8 checkpoints, their scales)."""
    dense = tuple(f"{_prefix(i)}mlp." for i, t in enumerate(cfg.mlp_layer_types) if t == "dense")
    return {name: name.replace(".mlp.", ".block_sparse_moe.", 1) for name in declare(cfg).spine()
            if name.startswith(dense)}


class NoPEMLA(MLA):
    """MLA whose rope sub-head is used as is: Kimi Linear's full-attention layers."""

    def _rope(self, x, cos, sin):
        return x


def declare(cfg: Config) -> Model:
    h, eps = cfg.hidden_size, cfg.rms_norm_eps

    def attn(i: int):
        if cfg.layer_types[i] == "linear_attention":
            return kimi_delta(h, heads=cfg.linear_num_heads, head_dim=cfg.linear_head_dim,
                              kernel=cfg.linear_conv_kernel_dim, act=cfg.hidden_act, eps=eps)
        return mla(h, cfg.num_attention_heads, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
                   qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
                   v_head_dim=cfg.v_head_dim, bias=cfg.attention_bias,
                   scale=(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5, interleave=False,
                   norm_eps=LATENT_NORM_EPS, cls=NoPEMLA, bias_inline=False)

    def mlp(i: int):
        if cfg.mlp_layer_types[i] == "sparse":
            router = grouped_router(cfg.num_experts, h, cfg.num_experts_per_tok, scoring="sigmoid",
                                    n_group=cfg.n_group, topk_group=cfg.topk_group, group_score="top2_sum",
                                    normalize=cfg.norm_topk_prob, scale=cfg.routed_scaling_factor)
            shared = gated_mlp(h, cfg.moe_intermediate_size * cfg.n_shared_experts, cfg.hidden_act, prefix="")
            return moe(router, prefix="block_sparse_moe.", shared=shared)
        return gated_mlp(h, cfg.intermediate_size, cfg.hidden_act)

    layers = [Layer(i, rms_norm(h, eps), rms_norm(h, eps), attn(i), mlp(i)) for i in range(cfg.num_hidden_layers)]
    return Model(cfg.vocab_size, h, layers, rms_norm(h, eps), cfg.tie_word_embeddings, weights=cfg.weights)


def describe(cfg: Config) -> ModelDescription:
    spec = ExpertSpec(hidden=cfg.hidden_size, intermediate=cfg.moe_intermediate_size, act=cfg.hidden_act)
    model = declare(cfg)
    fixed = model.state()["state_bytes_fixed"]
    n_lin, n_full = len(cfg.linear_layers), len(cfg.full_layers)
    return model.describe(
        model_type=MODEL_TYPE, n_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
        **model.routed_experts(spec, "model.layers.{layer}.block_sparse_moe.experts.{e}.{name}",
                               {"gate": "w1", "up": "w3", "down": "w2"}),
        max_position_embeddings=cfg.max_position_embeddings, attn_heads=cfg.num_attention_heads,
        notes=[f"hybrid attention: {n_lin} Kimi Delta Attention layer(s) with a fixed-size recurrent state "
               f"({format_size(fixed)} with {SNAPSHOTS} snapshots kept for prefix reuse) and "
               f"{n_full} MLA layer(s) without positional encoding, with a latent cache"],
    )


def build(cfg: Config, w, experts) -> CausalLM:
    return declare(cfg).build(w, experts)
