"""Hostile GLM-4.5 (glm4_moe) config.json fields: each refused at parse time with one message
naming the field (a ``sluice: error:`` line at the CLI), never misread."""

from __future__ import annotations

import json
import math
import warnings

import pytest

from conftest import tiny_config
from families import REGISTRY
from hostile_configs import assert_refused, assert_refused_at_cli, hostile_checkpoint
from sluice.models import get_family

glm = get_family("glm4_moe")

# edit -> what the message names; every one must be refused
def _rope(**kw) -> dict:
    return {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, **kw}}


CT = {"quant_method": "compressed-tensors", "format": "float-quantized"}
CASES = {
    # keys transformers' GLM-4.5 ignores, at values it would silently compute differently
    "softmax_scoring": ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
    "greedy_topk": ({"topk_method": "greedy"}, "topk_method='greedy'"),
    "moe_layer_freq": ({"moe_layer_freq": 2}, "moe_layer_freq=2"),
    "sliding_window": ({"sliding_window": 8}, "sliding_window=8"),
    "use_sliding_window": ({"use_sliding_window": True}, "use_sliding_window=True"),
    "mlp_layer_types": ({"mlp_layer_types": ["dense", "dense", "sparse"]}, "mlp_layer_types="),
    "experts_disagree": ({"num_local_experts": 8}, "disagree"),
    # experts, groups, routing
    "no_experts": ({"n_routed_experts": 0, "num_local_experts": None}, "n_routed_experts=0"),
    "experts_string": ({"n_routed_experts": "16", "num_local_experts": None}, "n_routed_experts='16'"),
    "groups_not_dividing": ({"n_group": 3}, "not divisible by n_group=3"),
    "topk_group_above": ({"topk_group": 5}, "topk_group=5 exceeds"),
    "group_of_one": ({"n_routed_experts": 16, "n_group": 16, "topk_group": 8}, "fewer than 2 experts"),
    "top_k_above_groups": ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 exceeds"),
    "n_group_zero": ({"n_group": 0}, "n_group=0"),
    "shared_negative": ({"n_shared_experts": -1}, "n_shared_experts=-1"),
    "scaling_nan": ({"routed_scaling_factor": math.nan}, "routed_scaling_factor=nan"),
    "scaling_zero": ({"routed_scaling_factor": 0}, "routed_scaling_factor=0"),
    "norm_topk_string": ({"norm_topk_prob": "true"}, "norm_topk_prob='true'"),
    "dense_negative": ({"first_k_dense_replace": -1}, "first_k_dense_replace=-1"),
    "dense_float": ({"first_k_dense_replace": 1.0}, "first_k_dense_replace=1.0"),
    # attention
    "bias_string": ({"attention_bias": "yes"}, "attention_bias='yes'"),
    "qk_norm_number": ({"use_qk_norm": 2}, "use_qk_norm=2"),
    "kv_heads_not_dividing": ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
    # partial RoPE
    "rotary_factor_zero": (_rope(partial_rotary_factor=0), "partial_rotary_factor=0"),
    "top_level_factor_string": ({"rope_parameters": None, "partial_rotary_factor": "half"},
                                "partial_rotary_factor='half'"),
    "rotary_factor_above_one": (_rope(partial_rotary_factor=1.5), "partial_rotary_factor=1.5"),
    "rotary_factor_odd_dims": (_rope(partial_rotary_factor=0.1875), "rotates 3 of head_dim=16"),
    "rope_theta_nan": (_rope(rope_theta=math.nan), "rope_theta=nan"),
    "rope_type_unknown": ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "longrope"),
    # MTP
    "mtp_negative": ({"num_nextn_predict_layers": -1}, "num_nextn_predict_layers=-1"),
    "mtp_string": ({"num_nextn_predict_layers": "1"}, "num_nextn_predict_layers='1'"),
    # weight formats: a compressed-tensors config without its weights' scheme
    "compressed_tensors": ({"quantization_config": CT}, "quantization_config.config_groups=None"),
    "fp8_no_block": ({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}},
                     "weight_block_size=None"),
    "fp8_static": ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static",
                                            "weight_block_size": [128, 128]}}, "activation_scheme"),
}


@pytest.fixture(scope="module")
def raw():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tiny_config("glm4_moe", **REGISTRY["glm4_moe"].overrides).to_dict()


def test_clean_config_parses(raw):
    cfg = glm.parse_config(json.loads(json.dumps(raw)))
    assert cfg.rotary_dim == 8 and cfg.moe_layers == [1, 2] and cfg.n_group == 4


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_glm4_moe_config(case, raw):
    assert_refused(glm.parse_config, raw, *CASES[case])


@pytest.mark.parametrize("case", ["mlp_layer_types", "rotary_factor_odd_dims", "compressed_tensors"])
def test_refused_at_the_cli_in_one_line(case, family_models, tmp_path, capsys):
    """A real checkpoint directory whose config.json carries the field: one ``sluice: error:`` line."""
    path = hostile_checkpoint(family_models, tmp_path, "glm4_moe", CASES[case][0])
    assert_refused_at_cli(path, CASES[case][1], capsys)
