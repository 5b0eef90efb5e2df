"""Hostile dots.llm1 config.json fields: each refused at parse time with one message naming
the field (a ``sluice: error:`` line at the CLI), never misread."""

from __future__ import annotations

import json
import math
import warnings

import pytest

from families import REGISTRY
from hostile_configs import assert_refused, assert_refused_at_cli, hostile_checkpoint
from sluice.errors import CheckpointError, ConfigError, UnsupportedModelError
from sluice.models import get_family

d1 = get_family("dots1")
ROPE = {"rope_type": "default", "rope_theta": 10000.0}

# edit -> what the message names; every one must be refused
CASES = {
    # keys transformers' Dots1 ignores, at values it would silently compute differently
    "softmax_scoring": ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
    "greedy_topk": ({"topk_method": "greedy"}, "topk_method='greedy'"),
    "moe_layer_freq": ({"moe_layer_freq": 2}, "moe_layer_freq=2"),
    "use_sliding_window": ({"use_sliding_window": True}, "use_sliding_window=True"),
    "rope_interleave": ({"rope_interleave": True}, "rope_interleave=True"),
    "mlp_bias": ({"mlp_bias": True}, "mlp_bias=True"),
    "qk_norm_off": ({"use_qk_norm": False}, "use_qk_norm=False"),
    "mtp_layers": ({"num_nextn_predict_layers": 1}, "num_nextn_predict_layers=1"),
    "partial_rotary": ({"rope_parameters": {**ROPE, "partial_rotary_factor": 0.5}},
                       "partial_rotary_factor=0.5"),
    "quantized": ({"quantization_config": {"quant_method": "compressed-tensors"}}, "quantization_config"),
    # sliding windows and layer types
    "layer_types_short": ({"layer_types": ["full_attention"]},
                          "layer_types must list one type per layer (3)"),
    "layer_types_string": ({"layer_types": "full_attention"}, "layer_types must list one type per layer"),
    "layer_type_unknown": ({"layer_types": ["full_attention", "chunked_attention", "full_attention"]},
                           "layer_types ['chunked_attention'] are not supported"),
    "sliding_without_window": ({"sliding_window": None},
                               "sliding_window=None with sliding_attention at layer 2"),
    "window_zero": ({"sliding_window": 0}, "sliding_window=0"),
    "window_negative": ({"sliding_window": -8}, "sliding_window=-8"),
    "window_string": ({"sliding_window": "8"}, "sliding_window='8'"),
    "window_float": ({"sliding_window": 8.0}, "sliding_window=8.0"),
    "max_window_layers_negative": ({"max_window_layers": -1}, "max_window_layers=-1"),
    "max_window_layers_string": ({"max_window_layers": "2"}, "max_window_layers='2'"),
    # experts and routing
    "no_experts": ({"n_routed_experts": 0, "num_local_experts": None}, "n_routed_experts=0"),
    "one_expert": ({"n_routed_experts": 1, "num_local_experts": None, "num_experts_per_tok": 1, "n_group": 1,
                    "topk_group": 1}, "n_routed_experts=1"),
    "experts_string": ({"n_routed_experts": "16", "num_local_experts": None}, "n_routed_experts='16'"),
    "experts_missing": ({"n_routed_experts": None, "num_local_experts": None}, "'n_routed_experts'"),
    "top_k_missing": ({"num_experts_per_tok": None}, "missing required key 'num_experts_per_tok'"),
    "top_k_above_experts": ({"num_experts_per_tok": 17}, "num_experts_per_tok=17"),
    "shared_zero": ({"n_shared_experts": 0}, "n_shared_experts=0"),
    "shared_missing": ({"n_shared_experts": None}, "'n_shared_experts'"),
    "shared_float": ({"n_shared_experts": 2.0}, "n_shared_experts=2.0"),
    "groups_not_dividing": ({"n_group": 3}, "n_routed_experts=16 is not divisible by n_group=3"),
    "groups_zero": ({"n_group": 0}, "n_group=0"),
    "topk_group_above_groups": ({"topk_group": 5}, "topk_group=5 exceeds n_group=4"),
    "one_expert_per_group": ({"n_group": 16, "topk_group": 8}, "n_group=16 leaves fewer than 2 experts"),
    "top_k_above_kept_groups": ({"topk_group": 1, "num_experts_per_tok": 5},
                                "num_experts_per_tok=5 exceeds the 1 x 4"),
    "dense_negative": ({"first_k_dense_replace": -1}, "first_k_dense_replace=-1"),
    "dense_string": ({"first_k_dense_replace": "1"}, "first_k_dense_replace='1'"),
    "scaling_zero": ({"routed_scaling_factor": 0}, "routed_scaling_factor=0"),
    "scaling_nan": ({"routed_scaling_factor": math.nan}, "routed_scaling_factor=nan"),
    "scaling_string": ({"routed_scaling_factor": "2.5"}, "routed_scaling_factor='2.5'"),
    "renorm_string": ({"norm_topk_prob": "yes"}, "norm_topk_prob='yes'"),
    # attention, MLP, RoPE
    "bias_string": ({"attention_bias": "no"}, "attention_bias='no'"),
    "head_dim_zero": ({"head_dim": 0}, "head_dim=0"),
    "kv_heads_not_dividing": ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
    "moe_intermediate_zero": ({"moe_intermediate_size": 0}, "moe_intermediate_size=0"),
    "activation_unknown": ({"hidden_act": "swish_42"}, "hidden_act='swish_42'"),
    "rope_dynamic": ({"rope_parameters": {**ROPE, "rope_type": "dynamic", "factor": 2.0}},
                     "RoPE type 'dynamic' is not supported"),
    "rope_theta_nan": ({"rope_parameters": {**ROPE, "rope_theta": math.nan}}, "rope_theta=nan"),
    "positions_zero": ({"max_position_embeddings": 0}, "max_position_embeddings=0"),
}


@pytest.fixture(scope="module")
def raw():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return REGISTRY["dots1"].config().to_dict()


def test_clean_config_parses(raw):
    cfg = d1.parse_config(json.loads(json.dumps(raw)))
    assert cfg.layer_types == ["full_attention", "full_attention", "sliding_attention"] and cfg.n_group == 4


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_dots1_config(case, raw):
    assert_refused(d1.parse_config, raw, *CASES[case], errors=(ConfigError, UnsupportedModelError, CheckpointError))


@pytest.mark.parametrize("case", ["sliding_without_window", "softmax_scoring", "groups_not_dividing"])
def test_refused_at_the_cli_in_one_line(case, family_models, tmp_path, capsys):
    """A real checkpoint directory whose config.json carries the field: one ``sluice: error:`` line."""
    path = hostile_checkpoint(family_models, tmp_path, "dots1", CASES[case][0])
    assert_refused_at_cli(path, CASES[case][1], capsys)
