"""Hostile DeepSeek sparse attention config.json fields (``deepseek_v32``, ``glm_moe_dsa``): each
refused at parse time with one message naming the field (a ``sluice: error:`` line at the CLI),
never misread."""

from __future__ import annotations

import pytest

from hostile_configs import assert_refused, assert_refused_at_cli, hostile_checkpoint, registry_config
from sluice.models import get_family

# edit -> what the message names; every one must be refused, on both families
SHARED = {
    # the indexer
    "index_topk_zero": ({"index_topk": 0}, "index_topk=0"),
    "index_topk_string": ({"index_topk": "8"}, "index_topk='8'"),
    "index_topk_bool": ({"index_topk": True}, "index_topk=True"),
    "index_heads_zero": ({"index_n_heads": 0}, "index_n_heads=0"),
    "index_heads_float": ({"index_n_heads": 16.0}, "index_n_heads=16.0"),
    "index_head_dim_negative": ({"index_head_dim": -16}, "index_head_dim=-16"),
    "index_head_dim_below_rope": ({"index_head_dim": 2}, "index_head_dim=2 is not supported"),
    # what transformers' sparse attention always has, or ignores
    "no_low_rank_query": ({"q_lora_rank": None}, "q_lora_rank=None"),
    "rope_not_interleaved": ({"rope_interleave": False}, "rope_interleave=False"),
    "layer_types_full": ({"layer_types": ["full_attention"] * 3}, "layer_types=['full_attention'"),
    "layer_types_short": ({"layer_types": ["indexed_attention"]}, "layer_types=['indexed_attention']"),
    "layer_types_string": ({"layer_types": "indexed_attention"}, "layer_types='indexed_attention'"),
    # MoE layers, experts, routing
    "mlp_types_unknown": ({"mlp_layer_types": ["dense", "moe", "sparse"]}, "mlp_layer_types=['dense', 'moe'"),
    "mlp_types_short": ({"mlp_layer_types": ["dense", "sparse"]}, "mlp_layer_types has 2 entries"),
    "first_dense_negative": ({"mlp_layer_types": None, "first_k_dense_replace": -1}, "first_k_dense_replace=-1"),
    "moe_layer_freq": ({"moe_layer_freq": 2}, "moe_layer_freq=2"),
    "num_experts_string": ({"num_experts": "16"}, "num_experts='16'"),
    "softmax_scoring": ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
    "greedy_topk": ({"topk_method": "greedy"}, "topk_method='greedy'"),
    "kv_heads_differ": ({"num_key_value_heads": 2}, "num_key_value_heads=2"),
    "kv_lora_zero": ({"kv_lora_rank": 0}, "kv_lora_rank=0"),
    "sliding_window": ({"sliding_window": 8}, "sliding_window=8"),
}
# GLM-5's per-layer indexer modes
GLM = {
    "indexer_types_unknown": ({"indexer_types": ["full", "sparse", "full"]}, "indexer_types=['full', 'sparse'"),
    "indexer_types_short": ({"indexer_types": ["full", "shared"]}, "indexer_types has 2 entries"),
    "indexer_types_first_shared": ({"indexer_types": ["shared", "full", "full"]}, "starts with a \"shared\" layer"),
    "indexer_types_string": ({"indexer_types": "FSF"}, "indexer_types='FSF'"),
    "pattern_bad_letter": ({"indexer_types": None, "index_topk_pattern": "FXF"}, "index_topk_pattern='FXF'"),
    "pattern_first_shared": ({"indexer_types": None, "index_topk_pattern": "SFF"}, "index_topk_pattern starts"),
    "pattern_number": ({"indexer_types": None, "index_topk_pattern": 5}, "index_topk_pattern=5"),
    "freq_string": ({"indexer_types": None, "index_topk_freq": "2"}, "index_topk_freq='2'"),
    "offset_float": ({"indexer_types": None, "index_skip_topk_offset": 1.5}, "index_skip_topk_offset=1.5"),
    "schedule_first_shared": ({"indexer_types": None, "index_topk_freq": 2, "index_skip_topk_offset": 0},
                              "indexer_types starts with a \"shared\" layer"),
}
CASES = [(f, c) for f in ("deepseek_v32", "glm_moe_dsa") for c in SHARED] + [("glm_moe_dsa", c) for c in GLM]


@pytest.fixture(scope="module")
def raws():
    return {f: registry_config(f) for f in ("deepseek_v32", "glm_moe_dsa")}


def _parse(family: str, raw: dict):
    return get_family(family).parse_config(raw)


def test_clean_configs_parse(raws):
    ds, glm = _parse("deepseek_v32", raws["deepseek_v32"]), _parse("glm_moe_dsa", raws["glm_moe_dsa"])
    assert (ds.index_topk, ds.indexer_types, ds.moe_layers) == (8, ("full",) * 3, [1, 2])
    assert (glm.index_topk, glm.indexer_types, glm.index_interleave) == (18, ("full", "shared", "full"), True)
    # without indexer_types: transformers' schedule (every layer full by default), or the pattern
    bare = {**raws["glm_moe_dsa"], "indexer_types": None}
    assert _parse("glm_moe_dsa", bare).indexer_types == ("full",) * 3
    assert _parse("glm_moe_dsa", {**bare, "index_topk_pattern": "FFSF"}).indexer_types == ("full", "full", "shared")


@pytest.mark.parametrize("family,case", CASES)
def test_hostile_dsa_config(family, case, raws):
    assert_refused(get_family(family).parse_config, raws[family], *{**SHARED, **GLM}[case])


@pytest.mark.parametrize("family,case", [("deepseek_v32", "index_head_dim_below_rope"),
                                         ("glm_moe_dsa", "indexer_types_first_shared")])
def test_refused_at_the_cli_in_one_line(family, case, family_models, tmp_path, capsys):
    """A real checkpoint directory whose config.json carries the field: one ``sluice: error:`` line."""
    edit, expected = {**SHARED, **GLM}[case]
    assert_refused_at_cli(hostile_checkpoint(family_models, tmp_path, family, edit), expected, capsys)
