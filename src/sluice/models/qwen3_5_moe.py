"""Qwen3.5 / Qwen3.6 MoE (``model_type: qwen3_5_moe``, 35B-A3B to 397B-A17B; the text model
alone is ``qwen3_5_moe_text``).

The text model is Qwen3-Next's (``models/qwen3_next.py``, reused: gated full attention with
partial RoPE, Gated DeltaNet, softmax top-k routing with a sigmoid-gated shared expert,
zero-centred norms) with three differences, as transformers 5.24 computes them
(modeling_qwen3_5_moe.py, the oracle):

- Gated DeltaNet's projections are split: ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
  ``in_proj_a`` (``layers.gated_delta.SplitGatedDeltaNet``);
- every layer is an MoE block and the top-k weights are always renormalised (the config has no
  ``mlp_only_layers``, ``decoder_sparse_step``, ``norm_topk_prob``: set to another value they
  are refused, since transformers would ignore them);
- interleaved multimodal RoPE (``mrope_section``): for text every token's temporal, height and
  width positions are its own position, so the three rows are equal and the interleaving
  leaves plain partial RoPE (tests/models/test_qwen3_5_moe.py proves it against transformers).

The published checkpoints are the multimodal wrapper: ``text_config`` holds the text model's
config, its tensors are under ``model.language_model.`` (``lm_head.weight`` at the top), and
the vision tower (``model.visual.*``) is never read. Requests with images or video are refused
by the server (text content parts only). Multi-token-prediction weights (``mtp.*``) are not
used (transformers ignores them too). FP8 and INT4 checkpoints are read as every family reads
them (``models/weight_format.py``), the wrapper's top-level ``quantization_config`` applying to the
text model.
"""

from __future__ import annotations

from ..errors import ConfigError, UnsupportedModelError
from . import qwen3_next
from .base import CausalLM, ModelDescription
from .config import MAX_LAYERS, RawConfig
from .weight_format import WeightFormat, text_quantization

MODEL_TYPE = "qwen3_5_moe"
ALIASES = ("qwen3_5_moe_text",)
TEXT_MODEL_TYPE = "qwen3_5_moe_text"
WRAPPER_PREFIX = "model.language_model."  # the text model's tensors in the multimodal checkpoint

Config = qwen3_next.Config

# transformers' Qwen3.5 text defaults where they differ from Qwen3-Next's
_DEFAULTS = {"num_experts": 256, "num_experts_per_tok": 8}

# keys Qwen3.5's text model does not read (transformers ignores them): the value it computes
# with; another value would be silently different
_IGNORED = {
    "mlp_only_layers": ([],),  # every layer is an MoE block
    "decoder_sparse_step": (1,),
    "norm_topk_prob": (True,),  # the top-k weights are always renormalised
    "attn_output_gate": (True,),  # full attention always has its sigmoid output gate
}


def _text_config(raw: dict) -> tuple[dict, str, str, list[str]]:
    """(the text model's config, where its errors point, its tensor prefix, notes) of a wrapper
    (``text_config``) or of a text-only config."""
    if raw.get("model_type") == TEXT_MODEL_TYPE:
        return raw, "config.json", "model.", []
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"config.json: model_type {MODEL_TYPE!r} needs a text_config object (the text model's "
                          f"config), got {text!r}")
    inner = text.get("model_type", TEXT_MODEL_TYPE)
    if inner != TEXT_MODEL_TYPE:
        raise UnsupportedModelError(f"config.json: text_config.model_type={inner!r} is not supported (expected "
                                    f"{TEXT_MODEL_TYPE!r})")
    outer, own = raw.get("tie_word_embeddings", False), text.get("tie_word_embeddings", False)
    if outer != own:
        raise UnsupportedModelError(f"config.json: tie_word_embeddings={outer!r} and text_config.tie_word_embeddings="
                                    f"{own!r} disagree")
    notes = ["multimodal checkpoint: the text model only (the vision tower, model.visual.*, is not read; "
             "requests with images or video are refused)"]
    return text, "config.json text_config", WRAPPER_PREFIX, notes


def _check_mrope(rope: dict, where: str) -> None:
    """``mrope_section`` (three counts of rotary frequencies: temporal, height, width) and
    ``mrope_interleaved`` change nothing for text (the three position rows are equal), but a
    malformed value would fail in transformers: refused here."""
    section = rope.get("mrope_section")
    if section is not None and (not isinstance(section, list) or len(section) != 3 or any(
            isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in section)):
        raise ConfigError(f"{where}: rope_parameters.mrope_section={section!r} is invalid: expected a list of "
                          "three non-negative integers")
    inter = rope.get("mrope_interleaved")
    if inter is not None and not isinstance(inter, bool):
        raise ConfigError(f"{where}: rope_parameters.mrope_interleaved={inter!r} is invalid: expected true or false")


def parse_config(raw: dict) -> Config:
    if not isinstance(raw, dict):
        raise ConfigError(f"config.json: must be a JSON object, got {type(raw).__name__}")
    text, where, prefix, notes = _text_config(raw)
    quantization = text_quantization(raw, text) if text is not raw else raw.get("quantization_config")
    weights = WeightFormat(quantization, checkpoint_name=lambda m: _renamed(m, prefix))
    c = RawConfig(text, where)
    for key, allowed in _IGNORED.items():
        c.refuse(key, allowed, f"transformers' Qwen3.5 computes as if it were {allowed[0]!r}; another value "
                 "would be silently different")
    params = text.get("rope_parameters")
    if isinstance(params, dict):
        _check_mrope(params, where)
    mtp = c.int("mtp_num_hidden_layers", 0, lo=0, hi=MAX_LAYERS)
    if mtp:
        notes = [*notes, f"{mtp} multi-token-prediction layer(s) (mtp.*) are not used: generation predicts one "
                 "token per step"]
    cfg = qwen3_next.parse_config({**_DEFAULTS, **text, "quantization_config": None}, dense_layers=False, where=where)
    cfg.model_type, cfg.split_projections, cfg.text_prefix, cfg.notes = MODEL_TYPE, True, prefix, notes
    cfg.weights = weights
    return cfg


def declare(cfg: Config):
    return qwen3_next.declare(cfg)


def describe(cfg: Config) -> ModelDescription:
    return qwen3_next.describe(cfg)


def _renamed(name: str, prefix: str) -> str:
    """A text-model tensor's name in the checkpoint (the wrapper's ``model.language_model.``)."""
    return prefix + name[len("model."):] if name.startswith("model.") else name


def tensor_aliases(cfg: Config) -> dict[str, str]:
    """The wrapper stores the text model's tensors under ``model.language_model.`` (the head
    stays ``lm_head.weight``): each spine tensor's name there."""
    if cfg.text_prefix == "model.":
        return {}
    return {name: _renamed(name, cfg.text_prefix) for name in declare(cfg).spine() if name.startswith("model.")}


def build(cfg: Config, w, experts) -> CausalLM:
    return qwen3_next.build(cfg, w, experts)
