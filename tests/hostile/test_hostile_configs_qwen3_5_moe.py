"""Hostile Qwen3.5 config.json fields (the multimodal wrapper and its text_config): each refused at
parse time with one message naming the field (a ``sluice: error:`` line at the CLI), never misread."""

from __future__ import annotations

import json
import math

import pytest

from families import REGISTRY
from hostile_configs import assert_refused, assert_refused_at_cli, hostile_checkpoint
from sluice.errors import ConfigError, UnsupportedModelError
from sluice.models import get_family

q35 = get_family("qwen3_5_moe")

ROPE = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}

# text_config edit -> what the message names; every one must be refused
TEXT_CASES = {
    # keys transformers' Qwen3.5 text model ignores, at values it would silently compute differently
    "dense_layers": ({"mlp_only_layers": [1]}, "mlp_only_layers=[1]"),
    "sparse_step": ({"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
    "no_renorm": ({"norm_topk_prob": False}, "norm_topk_prob=False"),
    "no_output_gate": ({"attn_output_gate": False}, "attn_output_gate=False"),
    # what Qwen3-Next's blocks read
    "layer_types_short": ({"layer_types": ["linear_attention"]}, "layer_types must list 3"),
    "layer_type_unknown": ({"layer_types": ["linear_attention", "sliding_attention", "full_attention"]},
                           "sliding_attention"),
    "interval_zero": ({"layer_types": None, "full_attention_interval": 0}, "full_attention_interval=0"),
    "value_heads_not_multiple": ({"linear_num_value_heads": 3}, "linear_num_value_heads=3"),
    "key_heads_zero": ({"linear_num_key_heads": 0}, "linear_num_key_heads=0"),
    "key_head_dim_string": ({"linear_key_head_dim": "16"}, "linear_key_head_dim='16'"),
    "conv_kernel_float": ({"linear_conv_kernel_dim": 4.0}, "linear_conv_kernel_dim=4.0"),
    "no_experts": ({"num_experts": 0}, "num_experts=0"),
    "top_k_above_experts": ({"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
    "no_shared_expert": ({"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size=0"),
    "moe_intermediate_negative": ({"moe_intermediate_size": -1}, "moe_intermediate_size=-1"),
    "heads_zero": ({"num_attention_heads": 0}, "num_attention_heads=0"),
    "eps_nan": ({"rms_norm_eps": math.nan}, "rms_norm_eps=nan"),
    "tie_string": ({"tie_word_embeddings": "no"}, "tie_word_embeddings='no'"),
    "mtp_negative": ({"mtp_num_hidden_layers": -1}, "mtp_num_hidden_layers=-1"),
    # RoPE: the interleaved MRoPE sections do nothing for text, but a malformed one is refused
    "mrope_section_short": ({"rope_parameters": {**ROPE, "mrope_section": [2, 2]}}, "mrope_section=[2, 2]"),
    "mrope_section_string": ({"rope_parameters": {**ROPE, "mrope_section": "2,1,1"}}, "mrope_section='2,1,1'"),
    "mrope_section_negative": ({"rope_parameters": {**ROPE, "mrope_section": [2, -1, 1]}}, "mrope_section"),
    "mrope_interleaved_string": ({"rope_parameters": {**ROPE, "mrope_interleaved": "yes"}},
                                 "mrope_interleaved='yes'"),
    "partial_rotary_above_one": ({"rope_parameters": {**ROPE, "partial_rotary_factor": 2}}, "partial_rotary_factor=2"),
    "rope_theta_negative": ({"rope_parameters": {**ROPE, "rope_theta": -1}}, "rope_theta=-1"),
    "rope_type_unknown": ({"rope_parameters": {**ROPE, "rope_type": "mrope3d"}}, "mrope3d"),
}

# wrapper-level edit -> what the message names
WRAPPER_CASES = {
    "no_text_config": ({"text_config": None}, "text_config"),
    "text_config_string": ({"text_config": "qwen3_5_moe_text"}, "text_config"),
    "tie_disagrees": ({"tie_word_embeddings": True}, "tie_word_embeddings=True"),
    "fp8_block": ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [0, 128]}},
                  "weight_block_size=[0, 128]"),
    "quant_method": ({"quantization_config": {"quant_method": "awq"}}, "quant_method='awq'"),
    "two_quant_configs": ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
                           "text_config": None}, "quantization_config differs"),
}


@pytest.fixture(scope="module")
def raw():
    return json.loads(json.dumps(REGISTRY["qwen3_5_moe"].config().to_dict()))


def _copy(raw):
    return json.loads(json.dumps(raw))


def _in_text_config(change: dict):
    """An edit of the wrapper's config: ``change`` merged into its text_config."""
    return lambda cfg: {**cfg, "text_config": {**cfg["text_config"], **change}}


def test_clean_config_parses(raw):
    cfg = q35.parse_config(_copy(raw))
    assert cfg.split_projections and cfg.text_prefix == "model.language_model." and cfg.moe_layers == [0, 1, 2]
    text = q35.parse_config(_copy(raw)["text_config"])  # the text model's config alone
    assert text.text_prefix == "model." and text.num_experts_per_tok == 4


@pytest.mark.parametrize("case", list(TEXT_CASES))
def test_hostile_qwen3_5_moe_text_config(case, raw):
    change, expected = TEXT_CASES[case]
    assert_refused(q35.parse_config, raw, _in_text_config(change), expected, prefix="config.json")
    assert_refused(q35.parse_config, raw["text_config"], change, expected)  # the text-only checkpoint's config.json


@pytest.mark.parametrize("case", list(WRAPPER_CASES))
def test_hostile_qwen3_5_moe_wrapper(case, raw):
    change, expected = WRAPPER_CASES[case]
    wrapped = {**_copy(raw), **change}
    if change.get("text_config", 0) is None and "quantization_config" in change:  # both levels, different
        wrapped["text_config"] = {**_copy(raw)["text_config"], "quantization_config": {"quant_method": "fp8",
                                                                                     "weight_block_size": [64, 64]}}
    with pytest.raises((ConfigError, UnsupportedModelError)) as e:
        q35.parse_config(wrapped)
    assert expected in str(e.value) and str(e.value).startswith("config.json: "), str(e.value)


def test_other_text_model_type_refused(raw):
    wrapped = _copy(raw)
    wrapped["text_config"]["model_type"] = "qwen3_next"
    with pytest.raises(UnsupportedModelError, match="text_config.model_type='qwen3_next'"):
        q35.parse_config(wrapped)


@pytest.mark.parametrize("case", ["dense_layers", "mrope_section_string"])
def test_refused_at_the_cli_in_one_line(case, family_models, tmp_path, capsys):
    """A real wrapper checkpoint whose text_config carries the field: one ``sluice: error:`` line."""
    change, expected = TEXT_CASES[case]
    path = hostile_checkpoint(family_models, tmp_path, "qwen3_5_moe", _in_text_config(change))
    assert_refused_at_cli(path, expected, capsys)
