"""Hostile GLM-4.7-Flash config.json fields: each refused at parse time with one message naming
the field (a ``sluice: error:`` line at the CLI), never misread."""

from __future__ import annotations

import json
import math
import warnings

import pytest

from conftest import tiny_config
from hostile_configs import assert_refused, assert_refused_at_cli, hostile_checkpoint
from sluice.models import get_family

gl = get_family("glm4_moe_lite")
OVERRIDES = dict(num_key_value_heads=4, head_dim=8, qk_rope_head_dim=8, n_routed_experts=16, num_experts_per_tok=4)

# edit -> what the message names; every one must be refused
CASES = {
    # mlp_layer_types (what transformers follows) and DeepSeek-V3's layer keys it ignores
    "layer_types_string": ({"mlp_layer_types": "sparse"}, "mlp_layer_types='sparse'"),
    "layer_types_unknown": ({"mlp_layer_types": ["dense", "moe", "sparse"]}, "mlp_layer_types=['dense', 'moe'"),
    "layer_types_short": ({"mlp_layer_types": ["dense", "sparse"]}, "mlp_layer_types has 2 entries"),
    "first_dense_disagrees": ({"first_k_dense_replace": 2}, "first_k_dense_replace=2"),
    "first_dense_negative": ({"first_k_dense_replace": -1}, "first_k_dense_replace=-1"),
    "first_dense_string": ({"first_k_dense_replace": "1"}, "first_k_dense_replace='1'"),
    "moe_layer_freq": ({"moe_layer_freq": 2}, "moe_layer_freq=2"),
    "sparse_without_experts": ({"n_routed_experts": 0}, "n_routed_experts=0"),
    # MLA shapes
    "head_dim_disagrees": ({"head_dim": 16}, "head_dim=16"),
    "kv_heads_differ": ({"num_key_value_heads": 2}, "num_key_value_heads=2"),
    "kv_lora_zero": ({"kv_lora_rank": 0}, "kv_lora_rank=0"),
    "q_lora_negative": ({"q_lora_rank": -4}, "q_lora_rank=-4"),
    "rope_dim_odd": ({"qk_rope_head_dim": 7, "head_dim": 7}, "qk_rope_head_dim=7 must be even"),
    "v_head_dim_float": ({"v_head_dim": 16.0}, "v_head_dim=16.0"),
    "partial_rotary": ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    "rope_interleave_string": ({"rope_interleave": "false"}, "rope_interleave='false'"),
    "rope_theta_nan": ({"rope_parameters": {"rope_type": "default", "rope_theta": math.nan}}, "rope_theta=nan"),
    # routing
    "softmax_scoring": ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
    "greedy_topk": ({"topk_method": "greedy"}, "topk_method='greedy'"),
    "groups_not_dividing": ({"n_group": 3}, "not divisible by n_group=3"),
    "topk_group_above_groups": ({"n_group": 2, "topk_group": 3}, "topk_group=3 exceeds n_group=2"),
    "scaling_nan": ({"routed_scaling_factor": math.nan}, "routed_scaling_factor=nan"),
    "scaling_negative": ({"routed_scaling_factor": -1.8}, "routed_scaling_factor=-1.8"),
    "norm_topk_string": ({"norm_topk_prob": "yes"}, "norm_topk_prob='yes'"),
    "shared_negative": ({"n_shared_experts": -1}, "n_shared_experts=-1"),
    "sliding_window": ({"sliding_window": 8}, "sliding_window=8"),
    "mtp_negative": ({"num_nextn_predict_layers": -1}, "num_nextn_predict_layers=-1"),
    # block FP8
    "fp8_other_format": ({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2",
                                                  "weight_block_size": [128, 128]}}, "fmt='e5m2'"),
    "fp8_no_block": ({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}}, "weight_block_size=None"),
}


@pytest.fixture(scope="module")
def raw():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tiny_config("glm4_moe_lite", **OVERRIDES).to_dict()


def test_clean_config_parses(raw):
    cfg = gl.parse_config(json.loads(json.dumps(raw)))
    assert cfg.moe_layers == [1, 2] and cfg.qk_rope_head_dim == 8
    # first_k_dense_replace that agrees with mlp_layer_types is accepted
    assert gl.parse_config({**json.loads(json.dumps(raw)), "first_k_dense_replace": 1}).moe_layers == [1, 2]


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_glm4_moe_lite_config(case, raw):
    assert_refused(gl.parse_config, raw, *CASES[case])


@pytest.mark.parametrize("case", ["layer_types_unknown", "first_dense_disagrees", "head_dim_disagrees"])
def test_refused_at_the_cli_in_one_line(case, family_models, tmp_path, capsys):
    """A real checkpoint directory whose config.json carries the field: one ``sluice: error:`` line."""
    drop = ("mlp_layer_types",) if case == "first_dense_disagrees" else ()  # the released shape
    path = hostile_checkpoint(family_models, tmp_path, "glm4_moe_lite",
                              lambda cfg: {k: v for k, v in {**cfg, **CASES[case][0]}.items() if k not in drop})
    assert_refused_at_cli(path, CASES[case][1], capsys)
