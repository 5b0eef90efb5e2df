"""Hostile DeepSeek-V4 config.json fields: each refused at parse time with one message naming
the field (a ``sluice: error:`` line at the CLI), never misread."""

from __future__ import annotations

import math

import pytest

from hostile_configs import assert_refused, assert_refused_at_cli, copy, hostile_checkpoint, registry_config
from sluice.models import get_family

v4 = get_family("deepseek_v4")
TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
NESTED = {"main": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25},
          "compress": {"rope_type": "default", "rope_theta": 1.6e5, "partial_rotary_factor": 0.25}}

# edit -> what the message names; every one must be refused
CASES = {
    # keys transformers' DeepSeek-V4 ignores, at values it would compute differently
    "kv_heads": ({"num_key_value_heads": 2}, "num_key_value_heads=2"),
    "shared_experts": ({"n_shared_experts": 2}, "n_shared_experts=2"),
    "no_renorm": ({"norm_topk_prob": False}, "norm_topk_prob=False"),
    "attention_bias": ({"attention_bias": True}, "attention_bias=True"),
    "mlp_bias": ({"mlp_bias": True}, "mlp_bias=True"),
    "topk_method": ({"topk_method": "greedy"}, "topk_method='greedy'"),
    # stored forms other than the published FP8 spine with FP4 / FP8 experts
    "mxfp4": ({"quantization_config": {"quant_method": "mxfp4"}}, "quant_method='mxfp4'"),
    "fp4_experts": ({"expert_dtype": "fp4"}, "expert_dtype='fp4' without a quantization_config"),
    "expert_dtype_unknown": ({"expert_dtype": "int4", "quantization_config": {
        "quant_method": "fp8", "weight_block_size": [128, 128]}}, "expert_dtype='int4'"),
    "fp4_float_scales": ({"expert_dtype": "fp4", "quantization_config": {
        "quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "float"}}, "scale_fmt='float' with FP4"),
    "fp8_e5m2": ({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}},
                 "fmt='e5m2'"),
    "fp8_no_block": ({"quantization_config": {"quant_method": "fp8", "scale_fmt": "ue8m0"}}, "weight_block_size"),
    # layer schedules
    "types_short": ({"layer_types": TYPES[:2]}, "layer_types="),
    "types_string": ({"layer_types": "sliding_attention"}, "layer_types='sliding_attention'"),
    "types_unknown": ({"layer_types": ["full_attention"] + TYPES[1:]}, "layer_types has 'full_attention'"),
    "ratios_unknown": ({"layer_types": None, "compress_ratios": [0, 4, 64]}, "compress_ratios=[0, 4, 64]"),
    "ratios_bool": ({"layer_types": None, "compress_ratios": [0, True, 128]}, "compress_ratios=[0, True, 128]"),
    "mlp_types_unknown": ({"mlp_layer_types": ["hash_moe", "dense", "moe"]}, "mlp_layer_types has 'dense'"),
    "hash_layers_negative": ({"mlp_layer_types": None, "num_hash_layers": -1}, "num_hash_layers=-1"),
    "rates_key": ({"compress_rates": {"sliding_attention": 4}}, "compress_rates.sliding_attention=4"),
    "rates_zero": ({"compress_rates": {"compressed_sparse_attention": 0}},
                   "compress_rates.compressed_sparse_attention=0"),
    "rates_string": ({"compress_rates": "4"}, "compress_rates='4'"),
    "rate_legacy_float": ({"compress_rate_hca": 12.5}, "compress_rates.heavily_compressed_attention=12.5"),
    # attention shape
    "groups_not_dividing": ({"o_groups": 3}, "o_groups=3"),
    "rope_dims_odd": ({"partial_rotary_factor": 7 / 32}, "rope width of 7"),
    "rope_dims_none": ({"partial_rotary_factor": 0.01}, "rope width of 0"),
    "index_dim_narrow": ({"index_head_dim": 4}, "index_head_dim=4"),
    "window_zero": ({"sliding_window": 0}, "sliding_window=0"),
    "topk_zero": ({"index_topk": 0}, "index_topk=0"),
    "index_heads_string": ({"index_n_heads": "8"}, "index_n_heads='8'"),
    # hyper-connections
    "streams_zero": ({"hc_mult": 0}, "hc_mult=0"),
    "sinkhorn_zero": ({"hc_sinkhorn_iters": 0}, "hc_sinkhorn_iters=0"),
    "hc_eps_nan": ({"hc_eps": math.nan}, "hc_eps=nan"),
    # routing and experts
    "scoring_softmax": ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
    "scale_nan": ({"routed_scaling_factor": math.nan}, "routed_scaling_factor=nan"),
    "limit_negative": ({"swiglu_limit": -1.0}, "swiglu_limit=-1.0"),
    "limit_string": ({"swiglu_limit": "10"}, "swiglu_limit='10'"),
    "mtp_negative": ({"num_nextn_predict_layers": -1}, "num_nextn_predict_layers=-1"),
    # RoPE
    "rope_llama3": ({"rope_parameters": {**NESTED, "compress": {**NESTED["compress"], "rope_type": "llama3"}}},
                    "rope_type='llama3'"),
    "rope_partial_differs": ({"rope_parameters": {**NESTED, "main": {**NESTED["main"], "partial_rotary_factor": 0.5}}},
                             "partial_rotary_factor=0.5"),
    "rope_theta_nan": ({"rope_parameters": {**NESTED, "main": {**NESTED["main"], "rope_theta": math.nan}}},
                       "rope_theta=nan"),
    "rope_leftover": ({"rope_parameters": {**NESTED, "rope_theta": -1}}, "rope_parameters.rope_theta=-1"),
    "compress_theta_negative": ({"rope_parameters": None, "compress_rope_theta": -5}, "compress_rope_theta=-5"),
}


@pytest.fixture(scope="module")
def raw():
    return registry_config("deepseek_v4", layer_types=TYPES, mlp_layer_types=["hash_moe", "moe", "moe"],
                           num_hidden_layers=3)


def test_clean_config_parses(raw):
    cfg = v4.parse_config(copy(raw))
    assert cfg.layer_types == TYPES and cfg.mlp_layer_types == ["hash_moe", "moe", "moe"] and cfg.rope_dim == 8


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_deepseek_v4_config(case, raw):
    change, expected = CASES[case]
    assert_refused(v4.parse_config, raw, lambda r: {k: v for k, v in {**r, **change}.items() if v is not None},
                   expected)


@pytest.mark.parametrize("case", ["kv_heads", "fp4_experts", "ratios_unknown", "groups_not_dividing"])
def test_refused_at_the_cli_in_one_line(case, family_models, tmp_path, capsys):
    """A real checkpoint directory whose config.json carries the field: one ``sluice: error:`` line."""
    change = CASES[case][0]
    path = hostile_checkpoint(family_models, tmp_path, "deepseek_v4",
                              lambda r: {k: v for k, v in {**r, **change}.items() if v is not None})
    assert_refused_at_cli(path, CASES[case][1], capsys)


def test_legacy_keys_as_transformers_reads_them(raw):
    """The published config's spelling: per-layer ``compress_ratios`` (longer than the layers),
    ``num_hash_layers``, ``qk_rope_head_dim``, flat YaRN ``rope_scaling`` with ``type``."""
    from transformers import AutoConfig

    legacy = {k: v for k, v in raw.items() if k not in ("layer_types", "mlp_layer_types", "rope_parameters",
                                                          "partial_rotary_factor", "compress_rates")}
    legacy.update(compress_ratios=[0, 4, 128, 4, 0], num_hash_layers=2, qk_rope_head_dim=8, rope_theta=10000,
                  compress_rope_theta=160000, rope_scaling={"type": "yarn", "factor": 16, "beta_fast": 32,
                                                            "beta_slow": 1, "original_max_position_embeddings": 64})
    cfg = v4.parse_config(copy(legacy))
    ref = AutoConfig.for_model("deepseek_v4", **{k: v for k, v in legacy.items() if k != "model_type"})
    assert cfg.layer_types == ref.layer_types and cfg.mlp_layer_types == ref.mlp_layer_types
    assert cfg.rope_dim == ref.qk_rope_head_dim == 8
    assert cfg.compress_rates == ref.compress_rates
    for label in ("main", "compress"):
        for key, value in ref.rope_parameters[label].items():
            assert cfg.rope[label][key] == value, (label, key)
