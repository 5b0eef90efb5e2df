"""Hostile layer counts in multimodal wrapper checkpoints (qwen3_5_moe's
``model.language_model.layers.N.*``, kimi_k25's ``language_model.model.layers.N.*``): tensors of
a layer at or past ``num_hidden_layers``, or a config that counts more layers than the tensors
hold, are refused naming ``num_hidden_layers`` and the layer (one ``sluice: error:`` line at the
CLI), as for a text model's ``model.layers.N.*``; never silently ignored or misread."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import sluice
from sluice.cli import main
from sluice.errors import ConfigError

from models.test_wrapper_eos import _kimi_wrapper

LAYERS = {"qwen3_5_moe": "model.language_model.layers.", "kimi_k25": "language_model.model.layers."}


@pytest.fixture(scope="module")
def wrappers(family_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("wrappers")
    return {"qwen3_5_moe": family_models.hf("qwen3_5_moe", "f32"),
            "kimi_k25": _kimi_wrapper(family_models.hf("deepseek_v3", "f32"), root / "kimi_k25")}


def _n_layers(path: Path) -> int:
    return json.loads((path / "config.json").read_text())["text_config"]["num_hidden_layers"]


def _first_free(path: Path) -> int:
    """The first layer index no tensor may have: after the decoder's layers and the
    multi-token-prediction layers stored after them (DeepSeek-V3's ``num_nextn_predict_layers``;
    Qwen3.5 stores its MTP weights as ``mtp.*``)."""
    text = json.loads((path / "config.json").read_text())["text_config"]
    return text["num_hidden_layers"] + text.get("num_nextn_predict_layers", 0)


def _rewrite(src: Path, dst: Path, family: str, case: str) -> Path:
    """``src`` with one hostile change (see CASES)."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    prefix, n = LAYERS[family], _n_layers(src)
    tensors = load_file(src / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    if case == "extra_layer":  # a copy of layer 0 stored as the first layer past the decoder's and MTP's
        free = _first_free(src)
        tensors.update({prefix + f"{free}." + k[len(prefix + "0."):]: v.clone()
                        for k, v in tensors.items() if k.startswith(prefix + "0.")})
    elif case == "far_layer":  # one stray tensor of layer 1000
        tensors[prefix + "1000.input_layernorm.weight"] = tensors[prefix + "0.input_layernorm.weight"].clone()
    elif case == "last_layer_missing":
        tensors = {k: v for k, v in tensors.items() if not k.startswith(prefix + f"{n - 1}.")}
    elif case == "config_counts_more":
        cfg["text_config"]["num_hidden_layers"] = n + 2
        if "layer_types" in cfg["text_config"]:
            cfg["text_config"]["layer_types"] += ["linear_attention", "full_attention"]
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


# case -> what the message names (p: the layer prefix, f: the first free layer index; the tiny
# configs have 3 layers)
CASES = {
    "extra_layer": lambda p, f: ["num_hidden_layers=3", f"layer {f} ({p}{f}.*)"],
    "far_layer": lambda p, f: ["num_hidden_layers=3", f"layer 1000 ({p}1000.*)"],
    "last_layer_missing": lambda p, f: ["num_hidden_layers=3", f"only 2 layers ({p}0 .. {p}1)"],
    "config_counts_more": lambda p, f: ["num_hidden_layers=5", f"only 3 layers ({p}0 .. {p}2)"],
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("family", list(LAYERS))
def test_wrapper_layer_count_refused(wrappers, tmp_path, capsys, family, case):
    src = wrappers[family]
    assert _n_layers(src) == 3
    path = _rewrite(src, tmp_path / "m", family, case)
    expected = ["config.json text_config", *CASES[case](LAYERS[family], _first_free(src))]
    with pytest.raises(ConfigError) as e:
        sluice.load(path, memory="2GiB", progress=False)
    for part in expected:
        assert part in str(e.value), (part, str(e.value))
    rc = main(["check", str(path)])
    out, err = capsys.readouterr()
    assert rc == 1 and "Traceback" not in out + err
    assert err.startswith("sluice: error: ") and err.count("\n") == 1 and expected[-1] in err


@pytest.mark.parametrize("family", list(LAYERS))
def test_clean_wrapper_passes_the_check(wrappers, family):
    """The clean wrappers load (the check reads their layer prefix, and the vision tower's
    blocks are not counted as decoder layers)."""
    with sluice.load(wrappers[family], memory="2GiB", progress=False) as eng:
        assert eng.config.num_hidden_layers == 3
