"""Kimi K2.5 / K2-Thinking vs transformers: compressed-tensors INT4 experts (pack-quantized,
group 32, symmetric, bf16 scales) read as stored, on a deepseek_v3 checkpoint and inside the
kimi_k25 multimodal wrapper (``text_config``, tensors under ``language_model.``).

The oracle: the same model with every INT4 expert dequantized (``levels * scale``, exact in
fp32) by this file's own reference code, run through transformers. Packing here is written
from the format's description (codes are levels + 8, eight per int32, lowest nibble first),
independently of ``sluice.quant.int4``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import sluice
from conftest import prompt_ids
from families import REGISTRY
from sluice.convert import convert
from sluice.errors import UnsupportedModelError
from sluice.quant import FORMATS, QuantMatrix
from sluice.quant.int4 import dequantize_reference, pack_int32, unpack_int32

N_NEW = 32
EXPERT = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")

QCONFIG = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "kv_cache_scheme": None, "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                                        "re:.*mlp\\.(gate|up|down)_proj.*"],
    "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                  "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                              "group_size": 32, "dynamic": False, "actorder": None,
                                              "observer": "minmax", "observer_kwargs": {}}}},
}


def _pack(levels: torch.Tensor) -> torch.Tensor:
    """levels [N, K] in -8..7 -> int32 [N, K/8], written out word by word (the test's own packing)."""
    n, k = levels.shape
    out = torch.empty(n, k // 8, dtype=torch.int32)
    for r in range(n):
        for j in range(k // 8):
            word = 0
            for i in range(8):
                word |= (int(levels[r, 8 * j + i]) + 8) << (4 * i)
            out[r, j] = word - (1 << 32) if word >= 1 << 31 else word
    return out


def _quantize(w: torch.Tensor, tiny: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(levels, bf16 scales, exact dequantized fp32) of [N, K] ``w``; ``tiny``: one group's scale
    below f16's exact range (2^-17), so the matrix cannot be a q4 repack."""
    n, k = w.shape
    g = w.reshape(n, k // 32, 32)
    scale = (g.abs().amax(-1) / 7).to(torch.bfloat16)
    if tiny:
        scale[0, 0] = 3e-7
    levels = (g / scale.float()[..., None]).round().clamp(-8, 7)
    deq = (levels.double() * scale.double()[..., None]).float().reshape(n, k)
    return levels.reshape(n, k).to(torch.int8), scale, deq


def _to_int4(src: Path, dst: Path, ref: Path, wrap: bool = False) -> tuple[Path, Path]:
    """``dst``: ``src`` with its routed experts as compressed-tensors INT4 (the rest as stored);
    ``ref``: the same model dequantized to fp32. ``wrap``: both as kimi_k25 checkpoints."""
    from safetensors.torch import load_file, save_file

    q, deq = {}, {}
    first = True
    for name, t in load_file(src / "model.safetensors").items():
        if EXPERT.search(name):
            levels, scale, d = _quantize(t, tiny=first)
            first = False
            base = name[: -len("weight")]
            q[base + "weight_packed"], q[base + "weight_scale"] = _pack(levels), scale
            q[base + "weight_shape"] = torch.tensor(list(t.shape), dtype=torch.int64)
            deq[name] = d
        else:
            q[name] = deq[name] = t
    cfg = json.loads((src / "config.json").read_text())
    for d, data, quantized in ((dst, q, True), (ref, deq, False)):
        d.mkdir(parents=True, exist_ok=True)
        c = dict(cfg)
        if quantized:
            c["quantization_config"] = QCONFIG
        if wrap:
            data = {"language_model." + k: v for k, v in data.items()}
            c = {"model_type": "kimi_k25", "architectures": ["Kimi_K25ForConditionalGeneration"],
                 "tie_word_embeddings": False, "text_config": {**c, "model_type": "kimi_k2"},
                 "vision_config": {"hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 1,
                                   "num_attention_heads": 2, "patch_size": 14, "pos_emb_height": 4,
                                   "pos_emb_width": 4},
                 "projection_hidden_size": 32}
            if quantized:
                c["quantization_config"] = c["text_config"].pop("quantization_config")
        save_file(data, d / "model.safetensors", metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps(c, indent=1))
    return dst, ref


@pytest.fixture(scope="module")
def ds_src(family_models):
    return family_models.hf("deepseek_v3", "f32")  # the registry's checkpoint, built once a session (read only)


def _reference(path: Path, wrap: bool):
    import transformers

    if wrap:
        cls = transformers.Kimi_K25ForConditionalGeneration
    else:
        cls = transformers.AutoModelForCausalLM
    return cls.from_pretrained(path, dtype=torch.float32).eval()


def _check(path: Path, ref_path: Path, wrap: bool):
    ref = _reference(ref_path, wrap)
    ids = prompt_ids()
    with torch.no_grad():
        ref_logits = ref(input_ids=ids[None]).logits[0]
        ref_out = ref.generate(input_ids=ids[None], max_new_tokens=N_NEW, do_sample=False)[0]
    eng = sluice.load(path, memory="4GiB", cache_experts=REGISTRY["deepseek_v3"].top_k * 2, progress=False)
    diff = (eng.forward(ids) - ref_logits).abs().max().item()
    assert diff <= 1e-4, f"max |logit diff| {diff:.3e}"
    assert eng.generate(ids.tolist(), max_new_tokens=N_NEW).token_ids == ref_out[len(ids):].tolist()
    assert eng.experts_source.format == "int4"
    return eng


def test_pack_order_on_hand_made_values():
    levels = torch.arange(-8, 8).repeat(2).reshape(1, 32)
    packed = pack_int32(levels)
    # codes 0..7 then 8..15, lowest nibble first
    assert [w & 0xFFFFFFFF for w in packed[0].tolist()] == [0x76543210, 0xFEDCBA98] * 2
    assert torch.equal(packed, _pack(levels))
    assert torch.equal(unpack_int32(packed), levels)
    scale = torch.tensor([[0.5]], dtype=torch.bfloat16)
    assert torch.equal(dequantize_reference(packed, scale), levels.float() * 0.5)


@pytest.mark.parametrize("tiny", [False, True])
def test_format_binds_q4_only_when_scales_are_f16_exact(tiny):
    w = torch.randn(16, 64)
    levels, scale, deq = _quantize(w, tiny=tiny)
    parts = {"packed": _pack(levels), "scale": scale}
    m = FORMATS["int4"].bind(parts, 16, 64, exact=True)
    assert m.format.name == "int4" and (getattr(m, "q4", None) is None) == tiny
    if not tiny:
        assert m.q4.format.name == "q4" and m.q4.parts["blocks"].data_ptr() == parts["packed"].data_ptr()
    assert torch.equal(m.dequantize(), deq)
    x = torch.randn(5, 64)
    assert (m.matmul(x) - x @ deq.T).abs().max().item() < 1e-4


@pytest.mark.parametrize("wrap", [False, True], ids=["deepseek_v3", "kimi_k25"])
def test_int4_against_dequantized_reference(ds_src, tmp_path, wrap):
    path, ref = _to_int4(ds_src, tmp_path / "int4", tmp_path / "ref", wrap=wrap)
    eng = _check(path, ref, wrap)
    slots = [s.weights for s in eng.cache.slots if s.weights is not None]
    assert slots and all(isinstance(w["down"], QuantMatrix) for w in slots)
    assert eng.info.experts.record_bytes < sluice.load(ref, memory="4GiB", progress=False).info.experts.record_bytes
    box = convert(path, tmp_path / "int4.sluice", progress=False)  # the INT4 words and scales copied as stored
    b = sluice.load(box, memory="4GiB", progress=False)
    assert b.experts_source.format == "int4" and b.info.is_container
    assert torch.equal(b.forward(prompt_ids()), eng.forward(prompt_ids()))


def test_refused_schemes(ds_src, tmp_path):
    path, _ = _to_int4(ds_src, tmp_path / "int4", tmp_path / "ref")
    cfg = json.loads((path / "config.json").read_text())
    for edit, match in (
            (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=8), "num_bits=8"),
            (lambda q: q["config_groups"]["group_0"]["weights"].update(symmetric=False), "symmetric=False"),
            (lambda q: q["config_groups"]["group_0"]["weights"].update(group_size=128), "group_size=128"),
            (lambda q: q["config_groups"]["group_0"]["weights"].update(actorder="group"), "actorder='group'"),
            (lambda q: q["config_groups"]["group_0"].update(input_activations={"num_bits": 8}),
             "input_activations"),
            (lambda q: q.update(format="float-quantized"), "num_bits=4 is not supported (expected 8 for format "
                                                            "'float-quantized'"),
            (lambda q: q.update(quantization_status="frozen"), "quantization_status='frozen'")):
        c = json.loads(json.dumps(cfg))
        edit(c["quantization_config"])
        (path / "config.json").write_text(json.dumps(c))
        with pytest.raises(UnsupportedModelError, match=re.escape(match)):
            sluice.load(path, memory="4GiB", progress=False)
