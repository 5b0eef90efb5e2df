"""Kimi K2.5 / K2.6 (``model_type: kimi_k25``): the text model of a multimodal wrapper.

The wrapper's ``text_config`` is a DeepSeek-V3 config (``model_type`` ``deepseek_v3``, or
``kimi_k2``, which transformers rewrites to it), its tensors are named under
``language_model.`` (``language_model.model.layers.N.*``, ``language_model.lm_head.weight``)
and its released routed experts are compressed-tensors INT4 (``quant/int4.py``). The vision
tower (``vision_tower.*``) and projector (``mm_projector.*``) are never read: Sluice runs text.

Mapping (transformers 5.24, ``Kimi_K25Config`` / ``Kimi_K25ForConditionalGeneration``): the
text model is ``models/deepseek_v3.py`` on ``text_config``; the head is tied to the embedding
by the wrapper's own ``tie_word_embeddings`` (default true), as transformers ties it, whatever
the text config says; a ``quantization_config`` at the top level applies to the text model
(one in ``text_config`` too must then be the same).
"""

from __future__ import annotations

from dataclasses import replace

from ..errors import UnsupportedModelError
from . import deepseek_v3
from .base import CausalLM, ModelDescription
from .config import RawConfig

MODEL_TYPE = "kimi_k25"
PREFIX = "language_model."
TEXT_TYPES = ("deepseek_v3", "kimi_k2")
WHERE = "config.json text_config"


def parse_config(raw: dict) -> deepseek_v3.Config:
    c = RawConfig(raw)
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise UnsupportedModelError(f"config.json: text_config={text!r} is not supported (kimi_k25 needs the "
                                    "text model's config as an object)")
    text_type = text.get("model_type", "deepseek_v3")
    if text_type not in TEXT_TYPES:
        raise UnsupportedModelError(f"{WHERE}: model_type={text_type!r} is not supported (expected one of "
                                    f"{', '.join(TEXT_TYPES)})")
    text = dict(text)
    top_q, text_q = raw.get("quantization_config"), text.get("quantization_config")
    if top_q is not None and text_q is not None and top_q != text_q:
        raise UnsupportedModelError("config.json: quantization_config differs from text_config.quantization_config "
                                    "(which one the text model uses would be a guess)")
    if top_q is not None:
        text["quantization_config"] = top_q
    text["tie_word_embeddings"] = c.bool("tie_word_embeddings", True)  # the wrapper ties the head
    cfg = deepseek_v3.parse_config(text, WHERE)
    return replace(cfg, model_type=MODEL_TYPE, prefix=PREFIX)


def describe(cfg: deepseek_v3.Config) -> ModelDescription:
    desc = deepseek_v3.describe(cfg)
    desc.notes.append(f"multimodal wrapper: the text model (deepseek_v3, tensors under {PREFIX!r}); the vision "
                      "tower and projector are not read")
    return desc


def build(cfg: deepseek_v3.Config, w, experts) -> CausalLM:
    return deepseek_v3.build(cfg, w, experts)
