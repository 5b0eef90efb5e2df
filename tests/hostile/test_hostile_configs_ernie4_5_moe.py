"""Hostile ERNIE-4.5 MoE config.json fields: each refused at parse time with one message naming
the field (a ``sluice: error:`` line at the CLI), never misread."""

from __future__ import annotations

import json
import math
import warnings

import pytest

from conftest import tiny_config
from hostile_configs import assert_refused, assert_refused_at_cli, hostile_checkpoint
from sluice.models import get_family

em = get_family("ernie4_5_moe")

# edit -> what the message names; every one must be refused
CASES = {
    # keys of the Paddle configs transformers' ERNIE ignores, at values it would silently compute differently
    "layer_norm": ({"use_rmsnorm": False}, "use_rmsnorm=False"),
    "sigmoid_gate": ({"moe_gate_act": "sigmoid"}, "moe_gate_act='sigmoid'"),
    "sigmoid_scoring": ({"scoring_func": "sigmoid"}, "scoring_func='sigmoid'"),
    "no_aux_free_bias": ({"moe_use_aux_free": False}, "moe_use_aux_free=False"),
    "no_renorm": ({"moe_norm_gate_logits": False}, "moe_norm_gate_logits=False"),
    "group_experts": ({"moe_group_experts": True}, "moe_group_experts=True"),
    "hard_gate": ({"moe_use_hard_gate": True}, "moe_use_hard_gate=True"),
    "sliding_window": ({"sliding_window": 8}, "sliding_window=8"),
    "use_sliding_window": ({"use_sliding_window": True}, "use_sliding_window=True"),
    # RoPE: the whole head, GPT-J pairs
    "partial_rotary": ({"rope_parameters": {"rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 0.5}},
                       "partial_rotary_factor=0.5"),
    "rope_dynamic": ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 5e5, "factor": 2.0}},
                     "RoPE type 'dynamic'"),
    "rope_theta_nan": ({"rope_parameters": {"rope_type": "default", "rope_theta": math.nan}}, "rope_theta=nan"),
    "rope_theta_top_level_zero": ({"rope_parameters": None, "rope_theta": 0}, "rope_theta=0"),
    # experts and routing
    "no_experts": ({"moe_num_experts": 0}, "moe_num_experts=0"),
    "experts_string": ({"moe_num_experts": "8"}, "moe_num_experts='8'"),
    "experts_per_modality": ({"moe_num_experts": [8, 8]}, "moe_num_experts=[8, 8]"),  # ERNIE-4.5-VL
    "top_k_zero": ({"moe_k": 0}, "moe_k=0"),
    "top_k_above": ({"moe_k": 9}, "moe_k=9"),
    "expert_width_zero": ({"moe_intermediate_size": 0}, "moe_intermediate_size=0"),
    "expert_width_per_modality": ({"moe_intermediate_size": [32, 16]}, "moe_intermediate_size=[32, 16]"),
    "shared_negative": ({"moe_num_shared_experts": -1}, "moe_num_shared_experts=-1"),
    "shared_string": ({"moe_num_shared_experts": "2"}, "moe_num_shared_experts='2'"),
    "shared_too_wide": ({"moe_num_shared_experts": 1 << 20}, "moe_num_shared_experts=1048576"),
    "norm_min_nan": ({"moe_norm_min": math.nan}, "moe_norm_min=nan"),
    "norm_min_negative": ({"moe_norm_min": -1.0}, "moe_norm_min=-1.0"),
    "norm_min_string": ({"moe_norm_min": "1e-12"}, "moe_norm_min='1e-12'"),
    # the MoE layer schedule
    "start_negative": ({"moe_layer_start_index": -1}, "moe_layer_start_index=-1"),
    "start_float": ({"moe_layer_start_index": 1.5}, "moe_layer_start_index=1.5"),
    "start_per_modality": ({"moe_layer_start_index": [1, 1]}, "moe_layer_start_index=[1, 1]"),  # ERNIE-4.5-VL
    "end_below_minus_one": ({"moe_layer_end_index": -2}, "moe_layer_end_index=-2"),
    "end_bool": ({"moe_layer_end_index": True}, "moe_layer_end_index=True"),
    "interval_zero": ({"moe_layer_interval": 0}, "moe_layer_interval=0"),
    "no_moe_layer": ({"moe_layer_start_index": 5}, "make none of the 3 layers an MoE layer"),
    "empty_range": ({"moe_layer_start_index": 2, "moe_layer_end_index": 1}, "make none of the 3 layers"),
    # the rest
    "use_bias_string": ({"use_bias": "false"}, "use_bias='false'"),
    "tie_string": ({"tie_word_embeddings": "yes"}, "tie_word_embeddings='yes'"),
    "mtp_negative": ({"num_nextn_predict_layers": -1}, "num_nextn_predict_layers=-1"),
    "dense_width_zero": ({"intermediate_size": 0}, "intermediate_size=0"),
    "head_dim_zero": ({"head_dim": 0}, "head_dim=0"),
    "act_unknown": ({"hidden_act": "swiglu_oai"}, "hidden_act='swiglu_oai'"),
}


@pytest.fixture(scope="module")
def raw():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tiny_config("ernie4_5_moe", num_experts_per_tok=4, moe_num_shared_experts=1).to_dict()


def test_clean_config_parses(raw):
    cfg = em.parse_config(json.loads(json.dumps(raw)))
    assert cfg.moe_layers == [1, 2] and cfg.num_hidden_layers == 3 and cfg.num_shared_experts == 1


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_ernie4_5_moe_config(case, raw):
    assert_refused(em.parse_config, raw, *CASES[case])


@pytest.mark.parametrize("case", ["no_aux_free_bias", "start_per_modality", "no_moe_layer"])
def test_refused_at_the_cli_in_one_line(case, family_models, tmp_path, capsys):
    """A real checkpoint directory whose config.json carries the field: one ``sluice: error:`` line."""
    path = hostile_checkpoint(family_models, tmp_path, "ernie4_5_moe", CASES[case][0])
    assert_refused_at_cli(path, CASES[case][1].replace("3 layers", "4 layers"), capsys)  # the registry has 4
