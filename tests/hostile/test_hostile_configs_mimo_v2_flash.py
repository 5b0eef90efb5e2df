"""Hostile MiMo-V2-Flash config.json fields: each refused at parse time with one message naming
the field (a ``sluice: error:`` line at the CLI), never misread. The published config.json
carries keys of Xiaomi's own code that transformers ignores (``hybrid_layer_pattern``,
``swa_*``, ``rope_theta``, ...): they are refused where they disagree with what transformers
computes."""

from __future__ import annotations

import json
import math
import warnings

import pytest

from conftest import tiny_config
from hostile_configs import assert_refused, assert_refused_at_cli, hostile_checkpoint
from sluice.models import get_family

mf = get_family("mimo_v2_flash")

ROPE = {"full_attention": {"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}

# edit -> what the message names; every one must be refused
CASES = {
    # keys transformers ignores, at values it would silently compute differently
    "full_sinks": ({"add_full_attention_sink_bias": True}, "add_full_attention_sink_bias=True"),
    "no_swa_sinks": ({"add_swa_attention_sink_bias": False}, "add_swa_attention_sink_bias=False"),
    "softmax_scoring": ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
    "greedy_topk": ({"topk_method": "greedy"}, "topk_method='greedy'"),
    "shared_experts": ({"n_shared_experts": 1}, "n_shared_experts=1"),
    "rope_scaling": ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling="),
    "pattern_disagrees": ({"hybrid_layer_pattern": [0, 0, 1]}, "hybrid_layer_pattern=[0, 0, 1]"),
    "moe_freq_disagrees": ({"moe_layer_freq": [1, 1, 1]}, "moe_layer_freq=[1, 1, 1]"),
    "swa_heads": ({"swa_num_attention_heads": 8}, "swa_num_attention_heads=8"),
    "swa_kv_heads": ({"swa_num_key_value_heads": 2}, "swa_num_key_value_heads=2"),
    "swa_head_dim": ({"swa_head_dim": 32}, "swa_head_dim=32"),
    "swa_v_head_dim": ({"swa_v_head_dim": 16}, "swa_v_head_dim=16"),
    "rope_theta_disagrees": ({"rope_theta": 10000}, "rope_theta=10000"),
    "swa_rope_theta_disagrees": ({"swa_rope_theta": 5e6}, "swa_rope_theta=5000000.0"),
    "partial_factor_disagrees": ({"partial_rotary_factor": 0.25}, "partial_rotary_factor=0.25"),
    "layernorm_epsilon_disagrees": ({"layernorm_epsilon": 1e-6}, "layernorm_epsilon=1e-06"),
    "fused_qkv": ({"attention_projection_layout": "fused_qkv"}, "attention_projection_layout='fused_qkv'"),
    # layer kinds
    "layer_type_unknown": ({"layer_types": ["full_attention", "chunked_attention", "sliding_attention"]},
                           "'chunked_attention'"),
    "layer_types_short": ({"layer_types": ["full_attention"]}, "layer_types=['full_attention']"),
    "mlp_type_unknown": ({"mlp_layer_types": ["dense", "moe", "sparse"]}, "'moe'"),
    "mlp_types_not_a_list": ({"mlp_layer_types": "dense"}, "mlp_layer_types='dense'"),
    # attention shapes
    "v_head_dim_zero": ({"v_head_dim": 0}, "v_head_dim=0"),
    "head_dim_string": ({"head_dim": "16"}, "head_dim='16'"),
    "swa_kv_heads_do_not_divide": ({"num_attention_heads": 6, "num_key_value_heads": 2},
                                   "num_attention_heads=6"),
    "kv_heads_zero": ({"num_key_value_heads": 0}, "num_key_value_heads=0"),
    "window_zero": ({"sliding_window": 0}, "sliding_window=0"),
    "window_size_negative": ({"sliding_window_size": -1}, "sliding_window_size=-1"),
    "value_scale_nan": ({"attention_value_scale": math.nan}, "attention_value_scale=nan"),
    "value_scale_string": ({"attention_value_scale": "0.7"}, "attention_value_scale='0.7'"),
    "value_scale_negative": ({"attention_value_scale": -0.7}, "attention_value_scale=-0.7"),
    "attention_bias_string": ({"attention_bias": "no"}, "attention_bias='no'"),
    # RoPE per layer kind
    "rope_flat": ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "rope_parameters"),
    "rope_kind_missing": ({"rope_parameters": {"full_attention": ROPE["full_attention"]}}, "rope_parameters="),
    "rope_yarn": ({"rope_parameters": {**ROPE, "full_attention": {"rope_type": "yarn", "rope_theta": 1e4,
                                                                  "factor": 4.0}}}, "rope_type='yarn'"),
    "rope_theta_zero": ({"rope_parameters": {**ROPE, "sliding_attention": {"rope_type": "default",
                                                                           "rope_theta": 0}}}, "rope_theta=0"),
    "rope_partial_above_one": ({"rope_parameters": {**ROPE, "full_attention": {
        "rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.5}}}, "partial_rotary_factor=1.5"),
    "rope_partial_rotates_nothing": ({"rope_parameters": {**ROPE, "full_attention": {
        "rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.01}}}, "partial_rotary_factor=0.01"),
    # routing
    "experts_zero": ({"n_routed_experts": 0}, "n_routed_experts=0"),
    "groups_do_not_divide": ({"n_group": 3}, "n_group=3"),
    "topk_group_above_groups": ({"n_group": 2, "topk_group": 4}, "topk_group=4"),
    "one_expert_per_group": ({"n_group": 8, "topk_group": 8}, "n_group=8"),
    "top_k_above_kept_groups": ({"n_group": 4, "topk_group": 1, "num_experts_per_tok": 3},
                                "num_experts_per_tok=3 exceeds"),
    "routed_scale_zero": ({"routed_scaling_factor": 0}, "routed_scaling_factor=0"),
    "norm_topk_string": ({"norm_topk_prob": "yes"}, "norm_topk_prob='yes'"),
    "mtp_negative": ({"num_nextn_predict_layers": -1}, "num_nextn_predict_layers=-1"),
    "fp8_static": ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static",
                                            "weight_block_size": [128, 128]}}, "activation_scheme"),
    "fp8_no_block": ({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}}, "weight_block_size=None"),
}


@pytest.fixture(scope="module")
def raw():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tiny_config("mimo_v2_flash", v_head_dim=8).to_dict()


def test_clean_config_parses(raw):
    cfg = mf.parse_config(json.loads(json.dumps(raw)))
    assert cfg.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    assert cfg.mlp_layer_types == ["dense", "sparse", "sparse"] and cfg.sliding_window == 129


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_mimo_v2_flash_config(case, raw):
    assert_refused(mf.parse_config, raw, *CASES[case])


@pytest.mark.parametrize("case", ["pattern_disagrees", "full_sinks", "rope_yarn"])
def test_refused_at_the_cli_in_one_line(case, family_models, tmp_path, capsys):
    """A real checkpoint directory whose config.json carries the field: one ``sluice: error:`` line."""
    path = hostile_checkpoint(family_models, tmp_path, "mimo_v2_flash", CASES[case][0])
    assert_refused_at_cli(path, CASES[case][1], capsys)
