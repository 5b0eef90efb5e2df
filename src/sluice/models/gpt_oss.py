"""GPT-OSS (``model_type: gpt_oss``): GQA with biases on q/k/v/o and learned attention sinks,
sliding-window and full attention alternating by ``layer_types``, yarn RoPE; a router with a
bias whose top-k *logits* are softmaxed; experts with a clamped SwiGLU and biases.

Experts are fused on disk, input-major (``y = x @ W``):
``mlp.experts.gate_up_proj`` [E, H, 2I] (gate/up interleaved along the last dim),
``gate_up_proj_bias`` [E, 2I], ``down_proj`` [E, I, H], ``down_proj_bias`` [E, H]. Each
expert is the contiguous e-th slice of each, streamed as it is (see ``experts/fused.py``).
Native MXFP4 checkpoints (``quantization_config.quant_method == "mxfp4"``) store the expert
matrices as ``*_blocks`` / ``*_scales`` instead; see ``_mxfp4_tensors``. Block-FP8 and
compressed-tensors checkpoints (``models/weight_format.py``) are refused by name: transformers'
FP8 experts have no biases (``FP8Experts`` asserts ``has_bias=False``), and compressed-tensors
quantizes linear modules, which GPT-OSS's fused [E, H, 2I] experts are not.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import UnsupportedModelError
from ..experts.spec import ExpertSpec, TensorRef
from ..layers.attention import MAX_DRAFT
from ..layers.rotary import SUPPORTED_ROPE_TYPES, Rotary, rope_parameters
from .base import CausalLM, ModelDescription
from .config import MAX_EXPERTS, MAX_POSITIONS, REQUIRED, RawConfig, check_rope
from .declare import Layer, Model
from .parts import attention, moe, rms_norm, topk_softmax_router
from .weight_format import METHODS

MODEL_TYPE = "gpt_oss"
LAYER_TYPES = ("sliding_attention", "full_attention")

# transformers' GptOssConfig defaults, used when config.json omits them
_DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}
_DEFAULT_THETA = 150000.0


@dataclass
class Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    sliding_window: int | None
    layer_types: list[str]
    num_experts: int
    num_experts_per_tok: int
    swiglu_alpha: float
    swiglu_limit: float
    rope: dict
    mxfp4: bool  # experts stored as MXFP4 blocks/scales


def _rope(raw: dict) -> dict:
    if raw.get("rope_parameters") or raw.get("rope_scaling"):
        params = rope_parameters({"rope_theta": _DEFAULT_THETA, **raw})
    else:
        params = {**_DEFAULT_ROPE, "rope_theta": raw.get("rope_theta", _DEFAULT_THETA)}
    rtype = params.get("rope_type")
    if rtype not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"config.json: RoPE type {rtype!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedModelError("config.json: partial_rotary_factor != 1 is not supported for gpt_oss "
                                    "(GPT-OSS rotates the whole head)")
    return params


def _quantization(raw: dict) -> bool:
    """True when the routed experts are stored as MXFP4; refuses any other quantization."""
    q = raw.get("quantization_config")
    if not q:
        return False
    if not isinstance(q, dict):
        raise UnsupportedModelError(f"config.json: quantization_config {q!r} is not supported")
    method = q.get("quant_method")
    if method in METHODS:
        raise UnsupportedModelError(
            f"config.json: quantization_config.quant_method={method!r} checkpoints are not supported for gpt_oss: "
            "its experts are fused, biased and input-major; transformers' FP8 experts carry no biases and "
            "compressed-tensors quantizes linear modules only (GPT-OSS ships MXFP4)")
    if method != "mxfp4":
        raise UnsupportedModelError(
            f"config.json: quantization_config.quant_method={method!r} is not supported for gpt_oss "
            "(supported: mxfp4, or an unquantized checkpoint)")
    skipped = q.get("modules_to_not_convert") or []
    n_layers = raw.get("num_hidden_layers") or 0
    if any(_skips(str(m), f"model.layers.{i}.mlp.experts") for m in skipped for i in range(n_layers)):
        raise UnsupportedModelError(
            f"config.json: quantization_config.modules_to_not_convert={skipped!r} keeps some experts unquantized; "
            "Sluice reads MXFP4 gpt_oss checkpoints whose routed experts are all MXFP4")
    return True


def _skips(pattern: str, module: str) -> bool:
    """Whether a ``modules_to_not_convert`` entry names ``module`` (as a prefix up to a module
    boundary, as a regex with that boundary, or as a suffix), so that module stays unquantized."""
    try:
        if re.match(rf"(?:{pattern})(?:(?<=\.)|(?=\.|$))", module):
            return True
    except re.error:
        pass
    return module.endswith(pattern)


def parse_config(raw: dict) -> Config:
    c = RawConfig(raw)
    n_layers = c.layers()
    hidden = c.pos_int("hidden_size")
    heads, kv, head_dim = c.heads(hidden)
    layer_types = c.get("layer_types", None)
    if layer_types is None:
        layer_types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers)]
    if not isinstance(layer_types, list) or len(layer_types) != n_layers:
        raise UnsupportedModelError(
            f"config.json: layer_types must list one type per layer ({n_layers}), got {layer_types!r}")
    bad = sorted({str(t) for t in layer_types if t not in LAYER_TYPES})
    if bad:
        raise UnsupportedModelError(
            f"config.json: layer_types {bad} are not supported (supported: {', '.join(LAYER_TYPES)})")
    window = raw["sliding_window"] if "sliding_window" in raw else 128  # an explicit null is not the default
    positive = isinstance(window, int) and not isinstance(window, bool) and window >= 1
    if "sliding_attention" in layer_types and not positive:
        raise UnsupportedModelError(
            f"config.json: sliding_window={window!r} with sliding_attention layers is not supported "
            "(need a positive integer)")
    n_experts = c.pos_int("num_local_experts", REQUIRED, "num_experts", hi=MAX_EXPERTS)
    k = c.top_k("num_experts_per_tok", n_experts, 4)
    mxfp4 = _quantization(raw)
    inter = c.pos_int("intermediate_size")
    if mxfp4 and (hidden % 32 or inter % 32):
        raise UnsupportedModelError(
            f"config.json: MXFP4 experts need hidden_size ({hidden}) and intermediate_size ({inter}) to be "
            "multiples of 32 (the MXFP4 block)")
    return Config(
        vocab_size=c.pos_int("vocab_size"),
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        rms_norm_eps=c.eps(1e-5),
        max_position_embeddings=c.pos_int("max_position_embeddings", 131072, hi=MAX_POSITIONS),
        tie_word_embeddings=c.bool("tie_word_embeddings", False),
        attention_bias=c.bool("attention_bias", True),
        sliding_window=window if "sliding_attention" in layer_types else None,
        layer_types=list(layer_types),
        num_experts=n_experts,
        num_experts_per_tok=k,
        swiglu_alpha=c.float("swiglu_alpha", 1.702),
        swiglu_limit=c.float("swiglu_limit", 7.0, positive=True),
        rope=check_rope(_rope(raw)),
        mxfp4=mxfp4,
    )


def declare(cfg: Config) -> Model:
    h, eps = cfg.hidden_size, cfg.rms_norm_eps

    def attn(i: int):
        window = cfg.sliding_window if cfg.layer_types[i] == "sliding_attention" else None
        return attention(h, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, eps,
                         bias=cfg.attention_bias, window=window, sinks=True, bias_in_tail=True)

    layers = [Layer(i, rms_norm(h, eps), rms_norm(h, eps), attn(i),
                    moe(topk_softmax_router(cfg.num_experts, h, cfg.num_experts_per_tok), router_name="router."))
              for i in range(cfg.num_hidden_layers)]
    return Model(cfg.vocab_size, h, layers, rms_norm(h, eps), cfg.tie_word_embeddings,
                 lambda: Rotary(cfg.head_dim, cfg.rope, cfg.max_position_embeddings))


def describe(cfg: Config) -> ModelDescription:
    h, inter = cfg.hidden_size, cfg.intermediate_size
    spec = ExpertSpec(hidden=h, intermediate=inter, variant="clamped_swiglu", bias=True,
                      limit=cfg.swiglu_limit, alpha=cfg.swiglu_alpha)

    def expert_tensors(layer: int, e: int) -> dict[str, TensorRef]:
        p = f"model.layers.{layer}.mlp.experts."
        refs = {"gate_up_bias": TensorRef(p + "gate_up_proj_bias", (2 * inter,), index=e),
                "down_bias": TensorRef(p + "down_proj_bias", (h,), index=e)}
        if cfg.mxfp4:
            refs.update(_mxfp4_tensors(p, e, h, inter))
        else:
            refs["gate_up_t"] = TensorRef(p + "gate_up_proj", (h, 2 * inter), index=e)
            refs["down_t"] = TensorRef(p + "down_proj", (inter, h), index=e)
        return refs

    model = declare(cfg)
    n_sliding = cfg.layer_types.count("sliding_attention")
    window_positions = model.state()["window_positions"]
    stored = ("MXFP4 blocks/scales (gate_up rows interleaved), computed in 4-bit form"
              if cfg.mxfp4 else "fused, input-major, gate/up interleaved")
    notes = [
        f"attention: {n_sliding} sliding-window layers (window {cfg.sliding_window}) and "
        f"{cfg.num_hidden_layers - n_sliding} full layers, learned sinks; RoPE {cfg.rope.get('rope_type')}",
        *([f"KV: each sliding-window layer keeps at most {window_positions} positions (the window, "
           f"{MAX_DRAFT} for a speculative draft, room to append), full layers the whole context"]
          if n_sliding else []),
        f"experts: a Hugging Face directory stores them {stored} and is streamed one expert slice at a time as "
        "stored; a container holds canonical de-interleaved records",
    ]
    return model.describe(
        model_type=MODEL_TYPE, n_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
        expert=spec, expert_tensors=expert_tensors,
        max_position_embeddings=cfg.max_position_embeddings, attn_heads=cfg.num_attention_heads, notes=notes,
        expert_format="mxfp4" if cfg.mxfp4 else None,
    )


def _mxfp4_tensors(p: str, e: int, h: int, inter: int) -> dict[str, TensorRef]:
    """MXFP4 experts as GPT-OSS checkpoints store them: ``*_blocks`` uint8 [E, out, in/32, 16]
    and ``*_scales`` uint8 [E, out, in/32], output-major; gate_up's 2I rows interleave gate and
    up. Exactly the parts of ``sluice.quant``'s mxfp4 format, read as they are (4.25 bits)."""
    return {
        "gate_up.blocks": TensorRef(p + "gate_up_proj_blocks", (2 * inter, h // 32, 16), index=e),
        "gate_up.scales": TensorRef(p + "gate_up_proj_scales", (2 * inter, h // 32), index=e),
        "down.blocks": TensorRef(p + "down_proj_blocks", (h, inter // 32, 16), index=e),
        "down.scales": TensorRef(p + "down_proj_scales", (h, inter // 32), index=e),
    }


def build(cfg: Config, w, experts) -> CausalLM:
    return declare(cfg).build(w, experts)
