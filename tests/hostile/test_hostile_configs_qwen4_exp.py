"""Hostile Qwen3.8-Flash-Next config.json fields (the wrapper's text_config) and checkpoints whose
row tables or hash constants disagree with the config, and quantized checkpoints whose scales or
packed words are missing or misshapen: each refused with one message naming the field or the
tensor, never misread."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file, save_file

from families import _stored_config
from hostile_configs import assert_refused, assert_refused_at_cli, hostile_checkpoint, registry_config
from sluice.errors import CheckpointError, UnsupportedModelError
from sluice.models import get_family

q4 = get_family("qwen4_exp")
FP8, INT4 = _stored_config("fp8", (128, 128), []), _stored_config("int4", (128, 128), [])

TEXT_CASES = {
    # keys the text model does not read, at values it would compute differently
    "dense_layers": ({"mlp_only_layers": [1]}, "mlp_only_layers=[1]"),
    "no_output_gate": ({"attn_output_gate": False}, "attn_output_gate=False"),
    "layer_type_unknown": ({"layer_types": ["linear_attention", "sliding_attention", "linear_attention"]},
                           "sliding_attention"),
    "gate_act_unknown": ({"output_gate_type": "gelu"}, "output_gate_type='gelu'"),
    "gate_act_number": ({"output_gate_type": 3}, "output_gate_type=3"),
    # hyper-connections
    "one_stream": ({"hc_count": 1}, "hc_count=1"),
    "rank_zero": ({"hc_lowrank": 0}, "hc_lowrank=0"),
    # QSA
    "qsa_partial": ({"indexer_budget": None}, "missing ['indexer_budget']"),
    "qsa_two_key_heads": ({"indexer_kv_heads": 2}, "indexer_kv_heads=2"),
    "qsa_budget_not_multiple": ({"indexer_budget": 10}, "indexer_budget=10"),
    "qsa_ratio_zero": ({"indexer_compress_ratio": 0}, "indexer_compress_ratio=0"),
    "qsa_head_below_rope": ({"indexer_head_dim": 4}, "indexer_head_dim=4"),
    "qsa_absent": ({k: None for k in ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget",
                                      "indexer_compress_ratio")}, "without a QSA indexer"),
    # PLE
    "ple_on_attention": ({"ple_layer_ids": [2]}, "ple_layer_ids [2]"),
    "ple_layer_zero": ({"ple_layer_ids": [0]}, "ple_layer_ids=[0]"),
    "ple_layer_past_end": ({"ple_layer_ids": [4]}, "ple_layer_ids=[4]"),
    "ple_dim_not_multiple": ({"ple_embed_dim": 30}, "ple_embed_dim=30"),
    "ngram_one": ({"ngram_size": 1}, "ngram_size=1"),
    "ngram_string": ({"ngram_size": "3"}, "ngram_size='3'"),
    "no_eos": ({"eos_token_id": None}, "eos_token_id=None"),
    "eos_outside_vocab": ({"eos_token_id": 256}, "eos_token_id=256"),
    "eos_list_empty": ({"eos_token_id": []}, "eos_token_id=[]"),
    "vocab_base_one": ({"ngram_vocab_size_base": 1}, "ngram_vocab_size_base=1"),
    "divisor_zero": ({"make_ngram_vocab_size_divisible_by": 0}, "make_ngram_vocab_size_divisible_by=0"),
    "seed_negative": ({"seed": -1}, "seed=-1"),
    "no_experts": ({"num_experts": 0}, "num_experts=0"),
    "top_k_above_experts": ({"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
}

WRAPPER_CASES = {
    "no_text_config": ({"text_config": None}, "text_config"),
    "tie_disagrees": ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    # a malformed quantization_config (the wrapper's top-level one applies to the text model)
    "fp8_block_string": ({"quantization_config": {**FP8, "weight_block_size": "128"}}, "weight_block_size='128'"),
    "quantization_list": ({"quantization_config": [FP8]}, "quantization_config must be an object"),
    "quantization_disagrees": (lambda cfg: {**cfg, "quantization_config": FP8, "text_config": {
        **cfg["text_config"], "quantization_config": {**FP8, "weight_block_size": [64, 64]}}},
        "quantization_config differs from text_config.quantization_config"),
    # transformers' FP8 embeddings: the PLE n-gram tables are read by row in their plain form only
    "fp8_ngram_tables": ({"quantization_config": {**FP8, "modules_to_convert": ["ple_embedding.ngram_embedding"]}},
                         "PLE n-gram tables"),
    "int4_covers_spine": ({"quantization_config": {**INT4, "config_groups": {"group_0": {
        **INT4["config_groups"]["group_0"], "targets": ["Linear"]}}}}, "INT4 is read for routed experts only"),
}


@pytest.fixture(scope="module")
def raw():
    return registry_config("qwen4_exp")


def _in_text_config(change: dict):
    return lambda cfg: {**cfg, "text_config": {**cfg["text_config"], **change}}


def test_clean_config_parses(raw):
    cfg = q4.parse_config(raw)
    assert cfg.text_prefix == "model.language_model." and cfg.ple_layers == [0, 2] and cfg.hc_count == 3
    assert q4.parse_config(raw["text_config"]).text_prefix == "model."


@pytest.mark.parametrize("case", list(TEXT_CASES))
def test_hostile_qwen4_exp_text_config(case, raw):
    change, expected = TEXT_CASES[case]
    assert_refused(q4.parse_config, raw, _in_text_config(change), expected, prefix="config.json")
    assert_refused(q4.parse_config, raw["text_config"], change, expected)


@pytest.mark.parametrize("case", list(WRAPPER_CASES))
def test_hostile_qwen4_exp_wrapper(case, raw):
    assert_refused(lambda r: q4.describe(q4.parse_config(r)), raw, WRAPPER_CASES[case][0], WRAPPER_CASES[case][1])


def test_other_text_model_type_refused(raw):
    with pytest.raises(UnsupportedModelError, match="text_config.model_type='qwen3_5_moe_text'"):
        q4.parse_config(_in_text_config({"model_type": "qwen3_5_moe_text"})(raw))


@pytest.mark.parametrize("case", ["ple_on_attention", "qsa_two_key_heads"])
def test_refused_at_the_cli_in_one_line(case, family_models, tmp_path, capsys):
    change, expected = TEXT_CASES[case]
    path = hostile_checkpoint(family_models, tmp_path, "qwen4_exp", _in_text_config(change))
    assert_refused_at_cli(path, expected, capsys)


def _edited_weights(family_models, tmp_path, edit) -> str:
    """The registry checkpoint with its safetensors rewritten by ``edit(tensors)``."""
    src = family_models.hf("qwen4_exp", "f32")
    dst = tmp_path / "q4-weights"
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).symlink_to(f)
    tensors = load_file(str(src / "model.safetensors"))
    save_file(edit(tensors), str(dst / "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


TABLE = "model.language_model.layers.0.ple.ple_embedding."


@pytest.mark.parametrize("case,edit,expected", [
    ("piece_missing", lambda t: {k: v for k, v in t.items() if k != TABLE + "ngram_embedding.shard_11.weight"},
     "hold 385 rows, config.json implies 416"),
    ("piece_gap", lambda t: {k: v for k, v in t.items() if k != TABLE + "ngram_embedding.shard_5.weight"},
     "do not follow shard_0..shard_4"),
    ("table_missing", lambda t: {k: v for k, v in t.items() if "layers.0.ple.ple_embedding.ngram" not in k},
     "neither"),
    ("piece_wide", lambda t: {**t, TABLE + "ngram_embedding.shard_3.weight": t[
        TABLE + "ngram_embedding.shard_3.weight"].repeat(1, 2)}, "expected [rows, 8]"),
    ("piece_int", lambda t: {**t, TABLE + "ngram_embedding.shard_3.weight": t[
        TABLE + "ngram_embedding.shard_3.weight"].int()}, "stored as I32"),
    ("multipliers_differ", lambda t: {**t, TABLE + "layer_multipliers": t[TABLE + "layer_multipliers"] + 2},
     "the n-gram hash would read other rows"),
    ("sizes_float", lambda t: {**t, TABLE + "ngram_heads_vocab_sizes": t[TABLE + "ngram_heads_vocab_sizes"].float()},
     "expected I64"),
])
def test_hostile_row_tables(family_models, tmp_path, case, edit, expected, capsys):
    import sluice

    path = _edited_weights(family_models, tmp_path, edit)
    with pytest.raises(CheckpointError) as e:
        sluice.load(path, memory="2GiB", progress=False)
    assert expected in str(e.value), str(e.value)
    assert_refused_at_cli(tmp_path / "q4-weights", expected, capsys)


def test_damaged_container_pages(family_models, tmp_path):
    """A byte flipped in a container's row page: the page's CRC fails where the row is read (at load
    for resident tables, at the step for streamed ones), naming the table and the file; with
    verify_reads=False the bytes are used as they are."""
    import shutil

    import sluice
    import torch

    from sluice.convert import convert
    from sluice.rows.store import RowReadError

    box = convert(family_models.hf("qwen4_exp", "f32"), tmp_path / "box", progress=False)
    bad = tmp_path / "bad"
    shutil.copytree(box, bad)
    data = bytearray((bad / "rows.bin").read_bytes())
    data[100] ^= 0x40  # in the first table's first page
    (bad / "rows.bin").write_bytes(bytes(data))
    with pytest.raises(RowReadError, match="CRC mismatch .*layers.0.ple.ple_embedding.ngram_embedding"):
        sluice.load(bad, memory="2GiB", progress=False)
    with sluice.load(bad, memory="2GiB", progress=False, row_cache=1) as eng:  # streamed: loads, fails at the row
        first = eng.model.layers[0].ple.table
        last_page = eng.rows.tables[first].rows - 1
        assert eng.rows.gather(first, torch.tensor([last_page])).shape == (1, 8)  # another page: fine
        with pytest.raises(RowReadError, match="CRC mismatch in the page of row 0 "):
            eng.rows.gather(first, torch.tensor([0]))
    with sluice.load(bad, memory="2GiB", progress=False, verify_reads=False) as eng:
        assert eng.plan.rows_resident


def test_config_json_roundtrip(raw):
    assert json.loads(json.dumps(raw)) == raw


# -- quantized checkpoints: the parts Qwen4-Exp adds (scales of the gated residuals, the final
# mixer, PLE and the QSA indexer; the routed experts' INT4 words) missing or misshapen ------------


def _tampered(family_models, tmp_path, kind: str, name: str, change) -> str:
    """The registry checkpoint stored as ``kind`` with tensor ``name`` changed (None: removed)."""
    src = family_models.hf("qwen4_exp", kind)
    dst = tmp_path / f"q4-{kind}"
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


Q = "model.language_model."


@pytest.mark.parametrize("kind,name,change,expected", [
    ("fp8", Q + "layers.0.attn_hyper_connection.block_inject_weight.weight_scale_inv", None, "is missing"),
    ("fp8", Q + "hyper_connection_mixer.input_mix_weight_up.weight_scale_inv", lambda t: t.flatten(), "has shape"),
    ("fp8", Q + "layers.2.ple.key_proj.weight_scale_inv", None, "is missing"),
    ("fp8", Q + "layers.1.self_attn.indexer.index_qk_proj.weight_scale_inv", lambda t: t[:1], "has shape"),
    ("ct-fp8", Q + "layers.0.mlp.shared_expert_gate.weight_scale", None, "is missing"),
    ("int4", Q + "layers.1.mlp.experts.3.down_proj.weight_packed", lambda t: t.flatten(), "has shape"),
])
def test_hostile_quantized_files(family_models, tmp_path, kind, name, change, expected):
    """Each refused at load in one line naming the tensor (by its name in the file or, a spine
    tensor, in the text model), never read as a plain weight."""
    import sluice
    from sluice.errors import SluiceError

    path = _tampered(family_models, tmp_path, kind, name, change)
    with pytest.raises(SluiceError) as e:
        sluice.load(path, memory="2GiB", progress=False)
    msg = str(e.value)
    assert expected in msg and "\n" not in msg, msg
    assert repr(name) in msg or repr(name.replace(Q, "model.")) in msg, msg
