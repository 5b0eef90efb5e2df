"""Hostile GLM-5.3-Flash config.json fields (the wrapper's text_config, the wrapper itself): each
refused with one message naming the field, never misread; quantized checkpoints whose scales of
the parts this family adds are missing or misshapen, refused naming the tensor."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file, save_file

from families import _stored_config
from hostile_configs import assert_refused, assert_refused_at_cli, hostile_checkpoint, registry_config
from sluice.errors import UnsupportedModelError
from sluice.models import get_family

g5 = get_family("glm5_next")
FP8, INT4 = _stored_config("fp8", (128, 128), []), _stored_config("int4", (128, 128), [])

TEXT_CASES = {
    # what transformers refuses too
    "kv_heads_differ": ({"num_key_value_heads": 2}, "num_key_value_heads=2"),
    "no_low_rank_query": ({"q_lora_rank": None}, "q_lora_rank=None"),
    "rope_dim": ({"qk_rope_head_dim": 8}, "qk_rope_head_dim=8"),
    "topk_not_multiple_of_pool": ({"index_topk": 10}, "index_topk=10"),
    "pool_zero": ({"index_kpool": 0}, "index_kpool=0"),
    "shared_after_kda": ({"indexer_types": ["full", "shared", "shared", "full"]}, "indexer_types[1]=\"shared\""),
    "shared_after_shared": ({"layer_types": ["indexed_attention"] * 4, "indexer_types": ["full", "full", "shared",
                                                                                          "shared"]},
                            "indexer_types[3]=\"shared\""),
    # what Sluice does not compute
    "no_tail": ({"index_kpool_always_select_tail": False}, "index_kpool_always_select_tail=false"),
    "no_shared_expert": ({"n_shared_experts": 0}, "n_shared_experts=0"),
    "dense_only": ({"mlp_layer_types": ["dense"] * 4}, "no \"sparse\" layer"),
    # malformed
    "layer_type_unknown": ({"layer_types": ["linear_attention", "sliding_attention", "indexed_attention",
                                            "linear_attention"]}, "'sliding_attention'"),
    "layer_types_short": ({"layer_types": ["linear_attention"]}, "layer_types="),
    "mlp_type_unknown": ({"mlp_layer_types": ["dense", "sparse", "moe", "sparse"]}, "'moe'"),
    "indexer_type_unknown": ({"indexer_types": ["full", "full", "partial", "full"]}, "'partial'"),
    "pattern_letter": ({"indexer_types": None, "index_topk_pattern": "FSXF"}, "index_topk_pattern='FSXF'"),
    "bound_string": ({"linear_lower_bound": "-5"}, "linear_lower_bound='-5'"),
    "bound_nan": ({"linear_lower_bound": float("nan")}, "linear_lower_bound=nan"),
    "linear_attn_config_list": ({"linear_attn_config": [1]}, "linear_attn_config=[1]"),
    "linear_heads_zero": ({"linear_attn_config": {"num_heads": 0}}, "num_heads=0"),
    "streams_zero": ({"hc_mult": 0}, "hc_mult=0"),
    "sinkhorn_eps_negative": ({"hc_eps": -1.0}, "hc_eps=-1.0"),
    "swiglu_limit_zero": ({"swiglu_limit": 0}, "swiglu_limit=0"),
    "groups_uneven": ({"n_group": 3}, "8 experts cannot be routed in 3 groups"),
    "one_expert_per_group": ({"n_group": 8, "topk_group": 2}, "at least 2 experts per group"),
    "top_k_above_experts": ({"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
    "no_experts": ({"n_routed_experts": 0}, "n_routed_experts=0"),
}

WRAPPER_CASES = {
    "text_config_list": ({"text_config": [1]}, "text_config=[1]"),
    "tie_disagrees": ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    # a malformed quantization_config (the wrapper's top-level one applies to the text model)
    "fp8_block_string": ({"quantization_config": {**FP8, "weight_block_size": "128"}}, "weight_block_size='128'"),
    "quantization_list": ({"quantization_config": [FP8]}, "quantization_config must be an object"),
    "quantization_disagrees": (lambda cfg: {**cfg, "quantization_config": FP8, "text_config": {
        **cfg["text_config"], "quantization_config": {**FP8, "weight_block_size": [64, 64]}}},
        "quantization_config differs from text_config.quantization_config"),
    "fp8_embeddings": ({"quantization_config": {**FP8, "modules_to_convert": ["embed_tokens"]}},
                       "modules_to_convert is not supported"),
    "int4_covers_spine": ({"quantization_config": {**INT4, "config_groups": {"group_0": {
        **INT4["config_groups"]["group_0"], "targets": ["Linear"]}}}}, "INT4 is read for routed experts only"),
}


@pytest.fixture(scope="module")
def raw():
    return registry_config("glm5_next")


def _in_text_config(change: dict):
    return lambda cfg: {**cfg, "text_config": {**cfg["text_config"], **change}}


def test_clean_config_parses(raw):
    cfg = g5.parse_config(raw)
    assert cfg.indexer_types == ["full", "full", "shared", "full"] and cfg.index_kpool == 4
    text = g5.parse_config(raw["text_config"])  # a text_config on its own: the same model, no wrapper note
    assert text.notes == [] and cfg.notes and {**vars(text), "notes": cfg.notes} == vars(cfg)


@pytest.mark.parametrize("case", list(TEXT_CASES))
def test_hostile_glm5_next_text_config(case, raw):
    change, expected = TEXT_CASES[case]
    assert_refused(g5.parse_config, raw, _in_text_config(change), expected, prefix="config.json")
    assert_refused(g5.parse_config, raw["text_config"], change, expected)


@pytest.mark.parametrize("case", list(WRAPPER_CASES))
def test_hostile_glm5_next_wrapper(case, raw):
    assert_refused(lambda r: g5.describe(g5.parse_config(r)), raw, WRAPPER_CASES[case][0], WRAPPER_CASES[case][1])


def test_other_text_model_type_refused(raw):
    with pytest.raises(UnsupportedModelError, match="text_config.model_type='qwen3_5_moe_text'"):
        g5.parse_config(_in_text_config({"model_type": "qwen3_5_moe_text"})(raw))


@pytest.mark.parametrize("case", ["no_tail", "rope_dim"])
def test_refused_at_the_cli_in_one_line(case, family_models, tmp_path, capsys):
    change, expected = TEXT_CASES[case]
    path = hostile_checkpoint(family_models, tmp_path, "glm5_next", _in_text_config(change))
    assert_refused_at_cli(path, expected, capsys)


# -- quantized checkpoints: the parts GLM-5.3-Flash adds (KDA's low-rank gates, the pooled DSA
# indexer's weights_proj, which transformers quantizes here; the routed experts' INT4 scales)
# missing or misshapen ---------------------------------------------------------------------------

P = "model.language_model."


def _tampered(family_models, tmp_path, kind: str, name: str, change) -> str:
    """The registry checkpoint stored as ``kind`` with tensor ``name`` changed (None: removed)."""
    src = family_models.hf("glm5_next", kind)
    dst = tmp_path / f"g5-{kind}"
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).symlink_to(f)
    tensors = load_file(str(src / "model.safetensors"))
    assert name in tensors, name
    if change is None:
        del tensors[name]
    else:
        tensors[name] = change(tensors[name])
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


@pytest.mark.parametrize("kind,name,change,expected", [
    ("fp8", P + "layers.1.self_attn.indexer.weights_proj.weight_scale_inv", None, "is missing"),
    ("fp8", P + "layers.0.self_attn.f_a_proj.weight_scale_inv", lambda t: t.flatten(), "has shape"),
    ("fp8", P + "layers.3.self_attn.g_b_proj.weight_scale_inv", None, "is missing"),
    ("ct-fp8", P + "layers.2.self_attn.kv_b_proj.weight_scale", lambda t: t[:1], "has shape"),
    ("int4", P + "layers.1.mlp.experts.2.gate_proj.weight_scale", lambda t: t.float(), "the format stores BF16"),
])
def test_hostile_quantized_files(family_models, tmp_path, kind, name, change, expected):
    """Each refused at load in one line naming the tensor, never read as a plain weight."""
    import sluice
    from sluice.errors import SluiceError

    path = _tampered(family_models, tmp_path, kind, name, change)
    with pytest.raises(SluiceError) as e:
        sluice.load(path, memory="2GiB", progress=False)
    msg = str(e.value)
    assert expected in msg and repr(name) in msg and "\n" not in msg, msg
