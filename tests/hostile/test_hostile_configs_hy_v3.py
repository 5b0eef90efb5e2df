"""Hostile Hy3 config.json fields: each refused at parse time with one message naming the
field (a ``sluice: error:`` line at the CLI), never misread."""

from __future__ import annotations

import json
import math
import warnings

import pytest

from conftest import tiny_config
from hostile_configs import assert_refused, assert_refused_at_cli, hostile_checkpoint
from sluice.models import get_family

hy = get_family("hy_v3")

# edit -> what the message names; every one must be refused
CASES = {
    # keys of the published config that transformers' HYV3 ignores, at values it would compute differently
    "softmax_router": ({"moe_router_use_sigmoid": False}, "moe_router_use_sigmoid=False"),
    "no_expert_bias": ({"moe_router_enable_expert_bias": False}, "moe_router_enable_expert_bias=False"),
    "no_route_norm": ({"route_norm": False}, "route_norm=False"),
    "qk_norm_off": ({"qk_norm": False}, "qk_norm=False"),
    "cla": ({"use_cla": True}, "use_cla=True"),
    "cla_factor": ({"cla_share_factor": 2}, "cla_share_factor=2"),
    "sliding_window": ({"sliding_window": 8}, "sliding_window=8"),
    "use_sliding_window": ({"use_sliding_window": True}, "use_sliding_window=True"),
    "groups": ({"n_group": 4}, "n_group=4"),
    "topk_group": ({"topk_group": 2}, "topk_group=2"),
    "expert_hidden_dim": ({"expert_hidden_dim": 64}, "expert_hidden_dim=64"),
    "first_k_dense_disagrees": ({"first_k_dense_replace": 2}, "first_k_dense_replace=2 disagrees"),
    "first_k_dense_negative": ({"first_k_dense_replace": -1}, "first_k_dense_replace=-1"),
    "first_k_dense_string": ({"first_k_dense_replace": "1"}, "first_k_dense_replace='1'"),
    "partial_rotary": ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
                       "partial_rotary_factor=0.5"),
    "mlp_bias": ({"mlp_bias": True}, "mlp_bias=True"),
    "mlp_bias_string": ({"mlp_bias": "no"}, "mlp_bias='no'"),
    "attention_bias_string": ({"attention_bias": "yes"}, "attention_bias='yes'"),
    "fp32_combine_string": ({"enable_moe_fp32_combine": "true"}, "enable_moe_fp32_combine='true'"),
    "lm_head_fp32_number": ({"enable_lm_head_fp32": 2}, "enable_lm_head_fp32=2"),
    # MLP layer types
    "mlp_types_short": ({"mlp_layer_types": ["dense", "sparse"]}, "mlp_layer_types=['dense', 'sparse']"),
    "mlp_types_string": ({"mlp_layer_types": "sparse"}, "mlp_layer_types='sparse'"),
    "mlp_types_unknown": ({"mlp_layer_types": ["dense", "moe", "sparse"]}, "mlp_layer_types has 'moe'"),
    # sizes, experts, routing
    "kv_not_dividing": ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
    "head_dim_zero": ({"head_dim": 0}, "head_dim=0"),
    "moe_intermediate_zero": ({"moe_intermediate_size": 0}, "moe_intermediate_size=0"),
    "intermediate_float": ({"intermediate_size": 96.0}, "intermediate_size=96.0"),
    "no_experts": ({"num_experts": 0, "num_local_experts": None}, "num_experts=0"),
    "experts_string": ({"num_experts": "8", "num_local_experts": None}, "num_experts='8'"),
    "no_shared_experts": ({"num_shared_experts": 0}, "num_shared_experts=0"),
    "shared_experts_float": ({"num_shared_experts": 1.5}, "num_shared_experts=1.5"),
    "scaling_nan": ({"router_scaling_factor": math.nan}, "router_scaling_factor=nan"),
    "scaling_negative": ({"router_scaling_factor": -2.0}, "router_scaling_factor=-2.0"),
    "scaling_string": ({"router_scaling_factor": "2.8"}, "router_scaling_factor='2.8'"),
    "mtp_negative": ({"num_nextn_predict_layers": -1}, "num_nextn_predict_layers=-1"),
    "rope_theta_nan": ({"rope_parameters": {"rope_type": "default", "rope_theta": math.nan}}, "rope_theta=nan"),
    "act_unknown": ({"hidden_act": "swiglu2"}, "hidden_act='swiglu2'"),
    # block FP8
    "fp8_other_format": ({"quantization_config": {"quant_method": "fp8", "fmt": "float8_e5m2",
                                                  "weight_block_size": [128, 128]}}, "fmt='float8_e5m2'"),
    "fp8_static": ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static",
                                            "weight_block_size": [128, 128]}}, "activation_scheme"),
}


@pytest.fixture(scope="module")
def raw():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tiny_config("hy_v3").to_dict()


def test_clean_config_parses(raw):
    cfg = hy.parse_config(json.loads(json.dumps(raw)))
    assert cfg.mlp_layer_types == ["dense", "sparse", "sparse"] and cfg.num_hidden_layers == 3


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_hy_v3_config(case, raw):
    assert_refused(hy.parse_config, raw, *CASES[case])


@pytest.mark.parametrize("case", ["first_k_dense_disagrees", "no_shared_experts", "partial_rotary"])
def test_refused_at_the_cli_in_one_line(case, family_models, tmp_path, capsys):
    """A real checkpoint directory whose config.json carries the field: one ``sluice: error:`` line."""
    path = hostile_checkpoint(family_models, tmp_path, "hy_v3", CASES[case][0])
    assert_refused_at_cli(path, CASES[case][1], capsys)
