"""Hostile MiniMax-M2 config.json fields: each refused at parse time with one message naming
the field (a ``sluice: error:`` line at the CLI), never misread."""

from __future__ import annotations

import json
import math
import warnings

import pytest

from conftest import tiny_config
from hostile_configs import assert_refused, assert_refused_at_cli, hostile_checkpoint
from sluice.models import get_family

mm = get_family("minimax_m2")

# edit -> what the message names; every one must be refused
CASES = {
    # keys transformers' MiniMax-M2 ignores, at values it would silently compute differently
    "qk_norm_off": ({"use_qk_norm": False}, "use_qk_norm=False"),
    "qk_norm_per_head": ({"qk_norm_type": "per_head"}, "qk_norm_type='per_head'"),
    "softmax_scoring": ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
    "no_routing_bias": ({"use_routing_bias": False}, "use_routing_bias=False"),
    "shared_experts": ({"shared_intermediate_size": 128}, "shared_intermediate_size=128"),
    "n_shared_experts": ({"n_shared_experts": 1}, "n_shared_experts=1"),
    "no_renorm": ({"norm_topk_prob": False}, "norm_topk_prob=False"),
    "scaling_factor": ({"routed_scaling_factor": 2.5}, "routed_scaling_factor=2.5"),
    "groups": ({"n_group": 4}, "n_group=4"),
    "topk_group": ({"topk_group": 2}, "topk_group=2"),
    "attention_bias": ({"attention_bias": True}, "attention_bias=True"),
    "sliding_window": ({"sliding_window": 8}, "sliding_window=8"),
    "use_sliding_window": ({"use_sliding_window": True}, "use_sliding_window=True"),
    "residual_alpha": ({"layernorm_full_attention_alpha": 3.5}, "layernorm_full_attention_alpha=3.5"),
    "lightning_layers": ({"attn_type_list": [1, 0, 1]}, "attn_type_list has 0 at layer 1"),
    "attn_types_not_a_list": ({"attn_type_list": "full"}, "attn_type_list='full'"),
    "attn_type_two": ({"attn_type_list": [1, 2, 1]}, "attn_type_list=[1, 2, 1]"),
    # rotary_dim / partial RoPE
    "rotary_dim_zero": ({"rotary_dim": 0}, "rotary_dim=0"),
    "rotary_dim_negative": ({"rotary_dim": -8}, "rotary_dim=-8"),
    "rotary_dim_odd": ({"rotary_dim": 7}, "rotary_dim=7 must be even"),
    "rotary_dim_above_head": ({"rotary_dim": 32}, "rotary_dim=32"),
    "rotary_dim_float": ({"rotary_dim": 8.0}, "rotary_dim=8.0"),
    "rotary_dim_string": ({"rotary_dim": "8"}, "rotary_dim='8'"),
    "rotary_factor_disagrees": (
        {"rotary_dim": 8, "rope_parameters": {"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 1.0}},
        "disagree"),
    "rotary_factor_odd_dims": (
        {"rotary_dim": None, "rope_parameters": {"rope_type": "default", "rope_theta": 5e6,
                                                 "partial_rotary_factor": 0.1875}}, "rotates 3 of head_dim=16"),
    "rope_theta_nan": ({"rope_parameters": {"rope_type": "default", "rope_theta": math.nan}}, "rope_theta=nan"),
    # experts and MTP
    "no_experts": ({"num_local_experts": 0, "num_experts": 0}, "num_local_experts=0"),
    "experts_string": ({"num_local_experts": "8", "num_experts": None}, "num_local_experts='8'"),
    "use_mtp_string": ({"use_mtp": "yes"}, "use_mtp='yes'"),
    "mtp_negative": ({"use_mtp": True, "num_mtp_modules": -1}, "num_mtp_modules=-1"),
    # block FP8
    "fp8_other_format": ({"quantization_config": {"quant_method": "fp8", "fmt": "float8_e5m2",
                                                  "weight_block_size": [128, 128]}}, "fmt='float8_e5m2'"),
    "fp8_no_block": ({"quantization_config": {"quant_method": "fp8", "fmt": "float8_e4m3fn"}},
                     "weight_block_size=None"),
    "fp8_static": ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static",
                                            "weight_block_size": [128, 128]}}, "activation_scheme"),
}


@pytest.fixture(scope="module")
def raw():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tiny_config("minimax_m2", rotary_dim=8).to_dict()


def test_clean_config_parses(raw):
    cfg = mm.parse_config(json.loads(json.dumps(raw)))
    assert cfg.rotary_dim == 8 and cfg.num_hidden_layers == 3


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_minimax_m2_config(case, raw):
    assert_refused(mm.parse_config, raw, *CASES[case])


@pytest.mark.parametrize("case", ["lightning_layers", "rotary_dim_odd", "qk_norm_per_head"])
def test_refused_at_the_cli_in_one_line(case, family_models, tmp_path, capsys):
    """A real checkpoint directory whose config.json carries the field: one ``sluice: error:`` line."""
    path = hostile_checkpoint(family_models, tmp_path, "minimax_m2", CASES[case][0])
    assert_refused_at_cli(path, CASES[case][1], capsys)
