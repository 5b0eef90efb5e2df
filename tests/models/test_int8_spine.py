"""The int8 spine's container and loading: what ``sluice convert --spine int8`` stores (the
quantized bytes, computed in bounded row blocks), what stays as stored (norms, routers, FP8
and MXFP4 weights), how the engine reads it back (an embedding lookup of dequantized rows),
and the refusals (an unknown format, damaged entries). The run on every family is in
tests/test_fidelity_matrix.py (``test_int8_spine``); quality on the trained demo model in
docs/quantization.md."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import sluice
from conftest import prompt_ids
from families import REGISTRY
from sluice import convert as convert_mod
from sluice.cli import main
from sluice.container import Container, seal_manifest
from sluice.engine import ModelInfo
from sluice.errors import CheckpointError, InvalidArgumentError
from sluice.models.quantized_spine import quantizable
from sluice.quant import FORMATS, QuantMatrix, embed

pytestmark = pytest.mark.filterwarnings("ignore:.*the spine is stored as int8")


@pytest.fixture(scope="module")
def boxes(family_models):
    return {"hf": family_models.hf("qwen3_moe"), "int8": family_models.container("qwen3_moe", spine="int8"),
            "stored": family_models.container("qwen3_moe")}


def test_container_holds_the_quantized_rows(boxes):
    from safetensors.torch import load_file

    sd = load_file(str(boxes["hf"] / "model.safetensors"))
    box, info = Container(boxes["int8"]), ModelInfo(boxes["int8"])
    assert box.manifest["spine_format"] == "int8" and info.spine_format == "int8"
    names = quantizable(info.desc)
    assert set(box.spine_quant) == set(names) and "model.embed_tokens.weight" in names
    for name in names:
        want = FORMATS["int8"].quantize(sd[name].float())
        t = box.read_tensors([name, name + ".scales"])
        assert torch.equal(t[name], want["weight"]) and torch.equal(t[name + ".scales"], want["scales"])
    for name in info.desc.spine:  # norms and routers stay as stored, bit for bit
        if name not in names:
            assert box.spine_quant.get(name) is None and torch.equal(box.read(name), sd[name])
    assert any(".mlp.gate.weight" in n for n in info.desc.spine if n not in names)  # routers
    box.close()
    info.checkpoint.close()


def test_row_blocks_give_the_bytes_of_whole_matrices(boxes, tmp_path, monkeypatch):
    """Converted in blocks of a few rows (bounded memory), the spine file is byte-identical."""
    monkeypatch.setattr(convert_mod, "SPINE_CHUNK", 4096)
    small = convert_mod.convert(boxes["hf"], tmp_path / "small.sluice", spine="int8", progress=False)
    assert (small / "spine.bin").read_bytes() == (boxes["int8"] / "spine.bin").read_bytes()


def test_embedding_rows_and_linear(boxes):
    eng = sluice.load(boxes["int8"], memory="4GiB", progress=False)
    table = eng.model.embed
    assert isinstance(table, QuantMatrix) and isinstance(eng.model.lm_head, QuantMatrix)
    ids = torch.tensor([5, 0, 5, 255, 17])
    assert torch.equal(embed(table, ids), table.dequantize()[ids])
    x = torch.randn(3, table.k)
    torch.testing.assert_close(eng.model.logits(x), x @ eng.model.lm_head.dequantize().T, rtol=1e-5, atol=1e-5)
    assert isinstance(eng.model.layers[0].attn.wq, QuantMatrix)
    assert isinstance(eng.model.layers[0].mlp.router.weight, torch.Tensor)  # routing stays exact
    from sluice.model_report import inspect_model, render_inspect

    r = inspect_model(boxes["int8"])
    assert r["spine_format"] == "int8" and "matrices int8 (lossy)" in render_inspect(r)
    assert r["params_total"] == inspect_model(boxes["stored"])["params_total"]
    assert r["spine_bytes"] < 0.5 * inspect_model(boxes["stored"])["spine_bytes"]
    eng.close()


@pytest.mark.parametrize("family,kind", [(f, e.native) for f, e in REGISTRY.items() if e.native])
def test_native_formats_stay_as_stored(family_models, family, kind):
    """FP8 spine weights are one byte already and stay FP8 with their scales; MXFP4 and FP4 experts
    stay as stored; the float matrices around them become int8. The result runs and is finite."""
    box = family_models.container(family, kind, spine="int8")
    c = Container(box)
    kept = [n for n, t in c.tensors.items() if t.dtype == "F8_E4M3"]
    assert (len(kept) > 0) == (kind in ("fp8", "fp4"))  # fp4: DeepSeek-V4's FP8 spine beside FP4 experts
    assert not set(kept) & set(c.spine_quant) and c.spine_quant
    assert c.expert_format == kind
    c.close()
    with sluice.load(box, memory="4GiB", progress=False) as eng:
        assert torch.isfinite(eng.forward(prompt_ids())).all()


def test_refusals(boxes, tmp_path, capsys):
    with pytest.raises(InvalidArgumentError, match=r"spine \(--spine\): unknown spine format 'q4'"):
        convert_mod.convert(boxes["hf"], tmp_path / "q4.sluice", spine="q4", progress=False)
    rc = main(["convert", str(boxes["hf"]), str(tmp_path / "x.sluice"), "--spine", "fp16", "--no-progress"])
    out, err = capsys.readouterr()
    assert rc != 0 and "--spine" in err and "'fp16'" in err and "Traceback" not in out + err

    def edited(label, edit):
        dst = tmp_path / label
        shutil.copytree(boxes["int8"], dst)
        m = json.loads((dst / "manifest.json").read_text())
        edit(m["spine"]["tensors"])
        (dst / "manifest.json").write_text(json.dumps(seal_manifest(m)))
        return dst

    q = "model.layers.1.self_attn.q_proj.weight"
    cases = {
        "format": (lambda t: t[q].update(format="q4"), "stored as 'q4'"),
        "scales": (lambda t: t.pop(q + ".scales"), "missing its part"),
        "shape": (lambda t: t[q + ".scales"].update(shape=[1]), "F32 [1]"),
        "dtype": (lambda t: t[q].update(dtype="U8"), "U8"),
        "stray": (lambda t: t["model.layers.1.input_layernorm.weight"].update(format="int8"), "int8"),
        "kind": (lambda t: t[q].update(format=7), "malformed format"),
    }
    for label, (edit, words) in cases.items():
        with pytest.raises(CheckpointError, match="q_proj|input_layernorm") as e:
            sluice.load(edited(label, edit), memory="4GiB", progress=False)
        assert words in str(e.value), (label, str(e.value))
