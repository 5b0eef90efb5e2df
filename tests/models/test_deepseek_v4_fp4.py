"""DeepSeek-V4 as published: the FP8 spine (e4m3, ue8m0 block scales ``<module>.scale``) and the
FP4 routed experts (e2m1 two per byte, one ue8m0 scale per 32 inputs), read, cached, converted
and multiplied in their stored form, against transformers on the exactly dequantized twin.

The quantizer and the reference dequantization here are written from the format, independently
of ``sluice.quant``; the FP4 one is checked against both of transformers' readings of these bytes
(``Fp8Dequantize``, what its V4 loader uses, and MXFP4's ``convert_moe_packed_tensors``) and
against hand-computed values, nibble order first."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import sluice
from families import E8M0, N_NEW, PROMPT, assert_decisive_model, fp4_dequantize, reference, to_published
from sluice.errors import CheckpointError, UnsupportedModelError
from sluice.models import get_family
from sluice.quant import FORMATS, QuantMatrix
from sluice.quant.fp8 import BlockFP8

v4 = get_family("deepseek_v4")
@pytest.fixture(scope="module")
def published(family_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("v4-published")
    return to_published(family_models.hf("deepseek_v4", "bf16"), root / "fp4", root / "twin")


# -- the FP4 bytes ------------------------------------------------------------------------------


def test_fp4_dequantization_nibble_order_and_values():
    """Hand-made bytes: the low nibble is the first element (transformers' V4 reading and MXFP4's
    alike), bit 3 the sign, the scale 2^(e - 127); Sluice's reference and kernels agree."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    row = [0x21, 0xF0, 0x7E, 0x08] + [0x00] * 12  # codes 1,2 | 0,15 | 14,7 | 8,0 then zeros
    packed = torch.tensor([row, [0x53] * 16], dtype=torch.uint8).view(torch.int8)  # 2 rows of 32 inputs
    scale = torch.tensor([[128], [125]], dtype=torch.uint8).view(E8M0)  # 2^1, 2^-2
    want = torch.zeros(2, 32)
    want[0, :8] = torch.tensor([0.5, 1.0, 0.0, -6.0, -4.0, 6.0, -0.0, 0.0]) * 2
    want[1] = torch.tensor([1.5, 3.0] * 16) * 0.25  # 0x53: low 3 -> 1.5, high 5 -> 3.0
    assert torch.equal(fp4_dequantize(packed, scale), want)
    hf_v4 = Fp8Dequantize(None)._dequantize_one(packed, scale, output_dtype=torch.float32)
    hf_mx = convert_moe_packed_tensors(packed.view(torch.uint8).view(1, 2, 1, 16), scale.view(torch.uint8)[None],
                                       dtype=torch.float32)[0].T  # GPT-OSS's [E, out, G, 16] -> [E, in, out]
    assert torch.equal(hf_v4, want) and torch.equal(hf_mx, want)
    assert torch.equal(torch.signbit(fp4_dequantize(packed, scale)), torch.signbit(hf_v4))  # -0.0 kept
    fmt = FORMATS["fp4"]
    parts = {"weight": packed, "scale": scale}
    assert torch.equal(fmt.dequantize(parts, 2, 32), want)
    x = torch.randn(3, 32)
    assert torch.allclose(QuantMatrix(fmt, parts, 2, 32, exact=True).matmul(x), x @ want.T, rtol=1e-6, atol=1e-5)


def test_fp4_matches_mxfp4_on_random_bytes():
    """Every code and a range of exponents: Sluice's fp4 reference, its kernels (few rows and
    many), transformers' two readings and mxfp4's on the same bytes all agree exactly."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    g = torch.Generator().manual_seed(0)
    n, k = 40, 96
    packed = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8).view(torch.int8)
    scale = torch.randint(100, 150, (n, k // 32), generator=g, dtype=torch.uint8).view(E8M0)
    want = fp4_dequantize(packed, scale)
    parts = {"weight": packed, "scale": scale}
    mx = {"blocks": packed.view(torch.uint8).view(n, k // 32, 16), "scales": scale.view(torch.uint8)}
    assert torch.equal(FORMATS["fp4"].dequantize(parts, n, k), want)
    assert torch.equal(FORMATS["mxfp4"].dequantize(mx, n, k), want)
    assert torch.equal(Fp8Dequantize(None)._dequantize_one(packed, scale, output_dtype=torch.float32), want)
    m = QuantMatrix("fp4", parts, n, k, exact=True)
    for t in (1, 5, 70):
        x = torch.randn(t, k, generator=g)
        bound = 1e-5 * (x.abs() @ want.abs().T)  # fp32 summation error (the scales span 2^-27 .. 2^22)
        assert ((m.matmul(x) - x @ want.T).abs() <= bound).all()
    # Sluice's own quantizer writes the format too (sluice convert --experts fp4)
    w = torch.randn(8, 64, generator=g)
    q = FORMATS["fp4"].quantize(w)
    assert q["weight"].dtype == torch.int8 and q["scale"].dtype == E8M0
    assert torch.equal(FORMATS["fp4"].dequantize(q, 8, 64), fp4_dequantize(q["weight"], q["scale"]))


# -- the model -----------------------------------------------------------------------------------


def test_published_quantization_parses():
    from models.test_deepseek_v4 import HUB_CONFIG, QUANT

    for quant in (QUANT, {"quantization_config": {**QUANT["quantization_config"], "expert_dtype": "fp4"}}):
        desc = v4.describe(v4.parse_config({**HUB_CONFIG, **quant}))
        assert desc.expert_format == "fp4"
        refs = {k: (r.name, r.shape) for k, r in desc.expert_tensors(42, 255).items()}
        assert refs["gate.weight"] == ("layers.42.ffn.experts.255.w1.weight", (2048, 2048))
        assert refs["gate.scale"] == ("layers.42.ffn.experts.255.w1.scale", (2048, 128))
        assert refs["down.scale"] == ("layers.42.ffn.experts.255.w2.scale", (4096, 64))
        sp = desc.spine
        assert sp["layers.2.attn.wq_a.scale"] == (8, 32) and sp["layers.2.attn.wo_a.scale"] == (64, 32)
        assert sp["layers.2.ffn.shared_experts.w2.scale"] == (32, 16)
        assert "layers.2.attn.compressor.wkv.scale" not in sp and "layers.2.attn.indexer.weights_proj.scale" not in sp
        assert "head.scale" not in sp and "layers.2.ffn.gate.scale" not in sp
        assert any("FP4 e2m1" in n for n in desc.notes) and any("ue8m0" in n for n in desc.notes)


def test_fp8_linears_are_transformers_fp8_linears(published):
    """The published names quantized here are exactly transformers' FP8-converted linears."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    dst, twin = published
    cfg = AutoConfig.from_pretrained(twin)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    kept = model._keep_in_fp32_modules
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"
               and not any(k in n for k in kept)}
    with safe_open(str(dst / "model.safetensors"), "pt") as f:
        scaled = {n for n in f.keys() if n.endswith(".scale") and ".experts." not in n}
    assert len(scaled) == len(linears) > 0


def test_published_form_against_transformers_on_the_twin(published, tmp_path):
    """Logits at every prompt position within 1e-4 (f32) and greedy tokens equal; the spine kept
    in FP8 (wo_a included), the cache slots in FP4; ``sluice inspect`` names the formats; a
    container keeps the stored bytes and gives the same bits."""
    from sluice.convert import convert
    from sluice.model_report import inspect_model

    dst, twin = published
    ref = reference(twin)
    with torch.no_grad():
        ref_logits = ref(PROMPT[None]).logits[0]
        ref_out = ref.generate(PROMPT[None], max_new_tokens=N_NEW, do_sample=False)[0]
    assert_decisive_model(ref, ref_out, len(PROMPT) - 1)
    want = ref_out[len(PROMPT):].tolist()
    eng = sluice.load(dst, memory="4GiB", cache_experts=6, progress=False)
    logits = eng.forward(PROMPT)
    diff = (logits - ref_logits).abs().max().item()
    assert diff <= 1e-4, f"max |logit diff| {diff:.3e}"
    result = eng.generate(PROMPT.tolist(), max_new_tokens=N_NEW, speculate=False)
    assert result.token_ids == want and result.stats["evictions"] > 0
    assert eng.experts_source.format == "fp4" and eng.experts_source.native_quant
    attn = eng.model.layers[1].attn
    assert isinstance(attn.wo_a, BlockFP8) and attn.wo_a.stored_scale.dtype == E8M0
    assert isinstance(attn.wq_a, BlockFP8) and attn.wq_a.weight.dtype == torch.float8_e4m3fn
    assert attn.compressor is not None and attn.compressor.wkv.dtype == torch.bfloat16  # kept bf16, as published
    slot = next(s for s in eng.cache.slots if s.weights is not None)
    assert isinstance(slot.weights["down"], QuantMatrix) and slot.weights["down"].format.name == "fp4"
    report = inspect_model(dst)
    assert report["expert_format"] == "fp4" and any("FP4 e2m1" in n for n in report["notes"])
    box = convert(dst, tmp_path / "v4.sluice", progress=False)
    b = sluice.load(box, memory="4GiB", cache_experts=6, progress=False)
    assert b.experts_source.format == "fp4"
    assert torch.equal(b.forward(PROMPT), logits)
    assert b.generate(PROMPT.tolist(), max_new_tokens=N_NEW, speculate=False).token_ids == want
    assert not b.generate(PROMPT.tolist(), max_new_tokens=2).stats.get("lossy")


def _edit(src: Path, dst: Path, tensors=None, config=None) -> Path:
    """A copy of ``src`` with some tensors replaced (``tensors(dict) -> dict``) or its config edited."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True)
    data = load_file(src / "model.safetensors")
    save_file(tensors(data) if tensors else data, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config(cfg) if config else cfg))
    return dst


HOSTILE = {
    # an FP4 scale grid per 16 inputs instead of 32
    "scale_shape": (lambda d: {**d, "layers.0.ffn.experts.3.w1.scale": torch.zeros(32, 4, dtype=torch.uint8)
                               .view(E8M0)}, None, CheckpointError, "w1.scale"),
    # FP4 scales stored as fp32 values instead of ue8m0 bytes
    "scale_dtype": (lambda d: {**d, "layers.0.ffn.experts.3.w2.scale": d["layers.0.ffn.experts.3.w2.scale"].float()},
                    None, CheckpointError, "F32"),
    # FP4 codes as uint8 (the published: int8)
    "weight_dtype": (lambda d: {**d, "layers.1.ffn.experts.0.w3.weight": d["layers.1.ffn.experts.0.w3.weight"]
                                .view(torch.uint8)}, None, CheckpointError, "U8"),
    # an FP8 spine weight's scales missing a row block
    "spine_scale_shape": (lambda d: {**d, "layers.0.attn.wq_a.scale": d["layers.0.attn.wq_a.scale"][:1]},
                          None, CheckpointError, "wq_a"),
    # an FP8 spine weight's ue8m0 scales as raw bytes (uint8), and a bf16 weight beside FP8 scales
    "spine_scale_dtype": (lambda d: {**d, "layers.2.attn.wo_a.scale": d["layers.2.attn.wo_a.scale"].view(torch.uint8)},
                          None, CheckpointError, "'layers.2.attn.wo_a.scale' is stored as U8"),
    "spine_weight_dtype": (lambda d: {**d, "layers.1.attn.wq_b.weight": d["layers.1.attn.wq_b.weight"]
                                      .to(torch.bfloat16)}, None, CheckpointError,
                           "layers.1.attn.wq_b.weight: expected a 2-D float8_e4m3fn weight"),
    "unknown_fmt": (None, lambda c: {**c, "quantization_config": {**c["quantization_config"], "fmt": "e5m2"}},
                    UnsupportedModelError, "fmt='e5m2'"),
    "expert_dtype": (None, lambda c: {**c, "expert_dtype": "nvfp4"}, UnsupportedModelError, "expert_dtype='nvfp4'"),
    "scale_fmt": (None, lambda c: {**c, "quantization_config": {**c["quantization_config"], "scale_fmt": "e4m3"}},
                  UnsupportedModelError, "scale_fmt='e4m3'"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_published_checkpoints(case, published, tmp_path):
    tensors, config, error, match = HOSTILE[case]
    path = _edit(published[0], tmp_path / case, tensors, config)
    with pytest.raises(error, match=re.escape(match)):
        sluice.load(path, memory="4GiB", progress=False).forward(PROMPT[:4])


@pytest.mark.parametrize("block, expert_dtype", [([128, 128], "fp4"), ([16, 16], "fp8")])
def test_published_blocks_and_fp8_experts(family_models, tmp_path, block, expert_dtype):
    """The published 128 x 128 blocks (every tiny matrix one partial block), and
    ``expert_dtype: "fp8"`` experts (block FP8 with ``.scale``, like the spine)."""
    dst, twin = to_published(family_models.hf("deepseek_v4", "bf16"), tmp_path / "q", tmp_path / "twin", block,
                             expert_dtype)
    ref = reference(twin)
    with torch.no_grad():
        ref_logits = ref(PROMPT[None]).logits[0]
    eng = sluice.load(dst, memory="4GiB", progress=False)
    assert eng.experts_source.format == expert_dtype
    diff = (eng.forward(PROMPT) - ref_logits).abs().max().item()
    assert diff <= 1e-4, f"max |logit diff| {diff:.3e}"


def test_transformers_reads_the_published_form_as_the_twin(family_models, tmp_path):
    """transformers' own loader on the published form (on a CPU-only machine it dequantizes at
    load: ``.scale`` renamed to ``weight_scale_inv``, the FP4 experts unpacked low nibble first)
    gives the twin's logits exactly, so the twin is what transformers makes of these bytes.
    (It derives the block from the shapes, so it needs blocks dividing every side: 8 x 8.)"""
    pytest.importorskip("accelerate")  # transformers' FP8 loader needs it
    from transformers import AutoModelForCausalLM

    dst, twin = to_published(family_models.hf("deepseek_v4", "bf16"), tmp_path / "q", tmp_path / "twin", [8, 8])
    own = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()
    with torch.no_grad():
        got, want = own(PROMPT[None]).logits[0].float(), reference(twin)(PROMPT[None]).logits[0]
    assert torch.equal(got, want)
    diff = (sluice.load(dst, memory="4GiB", progress=False).forward(PROMPT) - want).abs().max().item()
    assert diff <= 1e-4, f"max |logit diff| {diff:.3e}"


def test_fp4_experts_need_groups_of_32():
    from models.test_deepseek_v4 import HUB_CONFIG, QUANT

    with pytest.raises(UnsupportedModelError, match="must be multiples of 32 for FP4 experts"):
        v4.describe(v4.parse_config({**HUB_CONFIG, **QUANT, "moe_intermediate_size": 2040}))
