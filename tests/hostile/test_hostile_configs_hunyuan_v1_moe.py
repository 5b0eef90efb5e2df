"""Hostile Hunyuan (hunyuan_v1_moe) config.json fields: each refused at parse time with one
message naming the field (a ``sluice: error:`` line at the CLI), never misread."""

from __future__ import annotations

import json
import math
import warnings

import pytest

from conftest import tiny_config
from hostile_configs import assert_refused, assert_refused_at_cli, hostile_checkpoint
from sluice.models import get_family

hy = get_family("hunyuan_v1_moe")
ALPHA = {"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0}

# edit -> what the message names; every one must be refused
CASES = {
    # keys of the original Hunyuan config.json that transformers ignores, at values it would
    # silently compute differently
    "qk_norm_off": ({"use_qk_norm": False}, "use_qk_norm=False"),
    "no_rope": ({"use_rotary_pos_emb": False}, "use_rotary_pos_emb=False"),
    "no_shared_mlp": ({"use_mixed_mlp_moe": False}, "use_mixed_mlp_moe=False"),
    "cross_layer_attention": ({"use_cla": True, "cla_share_factor": 2}, "use_cla=True"),
    "mla": ({"use_mla": True}, "use_mla=True"),
    "mlp_bias": ({"mlp_bias": True}, "mlp_bias=True"),
    "skipped_moe_layers": ({"moe_layer_num_skipped": 1}, "moe_layer_num_skipped=1"),
    "no_renorm": ({"norm_topk_prob": False}, "norm_topk_prob=False"),
    "scaling_factor": ({"routed_scaling_factor": 2.5}, "routed_scaling_factor=2.5"),
    "group_limited": ({"group_limited_greedy": True}, "group_limited_greedy=True"),
    "topk_group": ({"topk_group": 2}, "topk_group=2"),
    "sliding_window": ({"sliding_window": 8}, "sliding_window=8"),
    "use_sliding_window": ({"use_sliding_window": True}, "use_sliding_window=True"),
    "drop_tokens": ({"moe_drop_tokens": True}, "moe_drop_tokens=True"),
    "attention_head_dim_differs": ({"attention_head_dim": 32}, "attention_head_dim=32"),
    "attention_head_dim_zero": ({"attention_head_dim": 0}, "attention_head_dim=0"),
    # shared experts and expert sizes (transformers: one shared MLP, every MLP intermediate_size)
    "two_shared_experts": ({"num_shared_expert": 2}, "num_shared_expert=2"),
    "shared_experts_per_layer": ({"num_shared_expert": [1, 2, 1]}, "num_shared_expert=2 at layer 1"),
    "shared_experts_short_list": ({"num_shared_expert": [1, 1]}, "num_shared_expert has 2 entries"),
    "shared_experts_string": ({"num_shared_expert": "1"}, "num_shared_expert='1'"),
    "moe_intermediate_differs": ({"moe_intermediate_size": 64}, "moe_intermediate_size=64"),
    "moe_intermediate_per_layer": ({"moe_intermediate_size": [32, 32, 16]}, "moe_intermediate_size=16 at layer 2"),
    "moe_intermediate_negative": ({"moe_intermediate_size": -32}, "moe_intermediate_size=-32"),
    # experts and top-k
    "experts_per_layer": ({"num_experts": [8, 8, 4]}, "num_experts=[8, 8, 4]"),
    "no_experts": ({"num_experts": 0}, "num_experts=0"),
    "experts_string": ({"num_experts": "8"}, "num_experts='8'"),
    "top_k_list_short": ({"moe_topk": [2, 2]}, "moe_topk has 2 entries"),
    "top_k_list_zero": ({"moe_topk": [2, 0, 2]}, "moe_topk=[2, 0, 2]"),
    "top_k_list_above_experts": ({"moe_topk": [2, 9, 2]}, "moe_topk=[2, 9, 2]"),
    "top_k_list_float": ({"moe_topk": [2, 2.0, 2]}, "moe_topk=[2, 2.0, 2]"),
    "top_k_float": ({"moe_topk": 2.0}, "moe_topk=2.0"),
    # attention
    "head_dim_odd": ({"head_dim": 15}, "head_dim=15"),
    "kv_heads_do_not_divide": ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
    "attention_bias_string": ({"attention_bias": "false"}, "attention_bias='false'"),
    # RoPE: NTK-alpha, dynamic NTK, linear
    "alpha_zero": ({"rope_parameters": {**ALPHA, "alpha": 0}}, "alpha=0"),
    "alpha_negative": ({"rope_parameters": {**ALPHA, "alpha": -1.0}}, "alpha=-1.0"),
    "alpha_nan": ({"rope_parameters": {**ALPHA, "alpha": math.nan}}, "alpha=nan"),
    "alpha_string": ({"rope_parameters": {**ALPHA, "alpha": "1000"}}, "alpha='1000'"),
    "alpha_with_linear": ({"rope_parameters": {**ALPHA, "rope_type": "linear", "factor": 2.0}},
                          "alpha=1000.0 with RoPE type 'linear'"),
    "dynamic_without_factor": ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}}, "needs a factor"),
    "dynamic_factor_negative": ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": -2.0}},
                                "factor=-2.0"),
    "linear_without_factor": ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}}, "needs a factor"),
    "partial_rotary": ({"rope_parameters": {**ALPHA, "partial_rotary_factor": 0.5}}, "partial_rotary_factor=0.5"),
    "rope_theta_nan": ({"rope_parameters": {**ALPHA, "rope_theta": math.nan}}, "rope_theta=nan"),
    "rope_type_unknown": ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "'longrope'"),
    "rope_scaling_not_an_object": ({"rope_parameters": None, "rope_scaling": "dynamic"}, "rope_scaling='dynamic'"),
    "ntk_head_dim_two": ({"head_dim": 2, "rope_parameters": ALPHA}, "head_dim=2"),
}


@pytest.fixture(scope="module")
def raw():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tiny_config("hunyuan_v1_moe", intermediate_size=32, moe_intermediate_size=32,
                           rope_parameters=ALPHA).to_dict()


def test_clean_config_parses(raw):
    cfg = hy.parse_config(json.loads(json.dumps(raw)))
    assert cfg.rope["rope_type"] == "ntk_alpha" and cfg.moe_topk == [2, 2, 2] and cfg.num_hidden_layers == 3


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_hunyuan_config(case, raw):
    assert_refused(hy.parse_config, raw, *CASES[case])


@pytest.mark.parametrize("case", ["cross_layer_attention", "experts_per_layer", "alpha_zero"])
def test_refused_at_the_cli_in_one_line(case, family_models, tmp_path, capsys):
    """A real checkpoint directory whose config.json carries the field: one ``sluice: error:`` line."""
    path = hostile_checkpoint(family_models, tmp_path, "hunyuan_v1_moe", CASES[case][0])
    assert_refused_at_cli(path, CASES[case][1], capsys)
