"""GPT-OSS against transformers: the Hugging Face directory (fused input-major experts streamed
as stored) and the container (canonical records), fp32 / bf16 / MXFP4, evicting caches,
router lookahead, inspect, the input-major kernel and refused options."""

from __future__ import annotations

import copy

import pytest
import torch

import sluice
from conftest import assert_decisive, prompt_ids, tiny_config
from families import to_mxfp4
from sluice import kernels
from sluice.convert import convert
from sluice.errors import UnsupportedModelError
from sluice.layers.routing import TopKSoftmaxRouter
from sluice.models import gpt_oss

N_NEW = 32
SEED = 0
MXFP4_SEED = 1  # its own seed: quantization moves the margins
# 3 layers: sliding (window 4), full, sliding; the 16-token prompt is far longer than the
# window. yarn with truncate=False and factor 32 over 64 original positions, as GPT-OSS has.
CONFIG = dict(intermediate_size=32, num_hidden_layers=3, sliding_window=4, max_position_embeddings=2048,
              rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                               "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})
TOTAL_EXPERTS = 3 * 8
SMALL_CACHE = 5  # < a quarter of all experts: forces evictions


def _save(path, dtype=torch.float32, seed=SEED, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config("gpt_oss", **{**copy.deepcopy(CONFIG), **overrides})
    AutoModelForCausalLM.from_config(cfg).eval().to(dtype).save_pretrained(path)
    return path


def _reference(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss")
    hf = _save(root / "fp32")
    return {"hf": hf, "container": convert(hf, root / "fp32.sluice", progress=False), "root": root}


@pytest.fixture(scope="module")
def expected(models):
    """transformers' logits for the prompt and its 32 greedy tokens, margins proven decisive."""
    ref = _reference(models["hf"])
    ids = prompt_ids()
    with torch.no_grad():
        logits = ref(ids[None]).logits[0]
        out = ref.generate(ids[None], max_new_tokens=N_NEW, do_sample=False)[0]
    assert_decisive(ref, out, len(ids) - 1, ref.config.num_experts_per_tok)
    return ids, logits, out[len(ids):].tolist(), ref


def _check(path, expected, tol=1e-4, **opts):
    ids, ref_logits, ref_tokens, _ = expected
    eng = sluice.load(path, memory="4GiB", progress=False, **opts)
    logits = eng.forward(ids)
    diff = (logits - ref_logits).abs().max().item()
    assert diff <= tol, f"max |logit diff| {diff:.3e} > {tol:.1e}"
    plain = eng.generate(ids.tolist(), max_new_tokens=N_NEW, speculate=False)
    assert plain.token_ids == ref_tokens
    result = eng.generate(ids.tolist(), max_new_tokens=N_NEW)  # with n-gram speculation (the default)
    assert result.token_ids == ref_tokens
    return eng, logits, result


@pytest.mark.parametrize("source", ["hf", "container"])
def test_exact_with_evicting_cache(models, expected, source):
    eng, _, result = _check(models[source], expected, cache_experts=SMALL_CACHE)
    assert eng.plan.cache_slots == SMALL_CACHE < TOTAL_EXPERTS / 4
    s = result.stats
    assert s["evictions"] > 0 and s["expert_misses"] > 0
    assert s["lookahead_predictions"] > 0 and 0 < s["lookahead_recall"] <= 1  # CausalLM.predict drives lookahead
    assert eng.info.is_container == (source == "container")


def test_container_matches_hf_directory(models, expected):
    """Same weights, two layouts: the HF path computes x @ W on the fused input-major slices,
    the container x @ W.T on canonical records, both in the input-major summation order
    (``quant.linear_chain``): bit-identical, whatever the cache and prefetch."""
    ids = expected[0]
    outs = {}
    for source in ("hf", "container"):
        runs = []
        for opts in (dict(cache_experts=2, prefetch=False), dict(cache_experts=TOTAL_EXPERTS, prefetch=True)):
            eng = sluice.load(models[source], memory="4GiB", progress=False, **opts)
            runs.append((eng.forward(ids), eng.generate(ids.tolist(), max_new_tokens=8).token_ids))
        assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1]
        outs[source] = runs[0]
    assert torch.equal(outs["hf"][0], outs["container"][0])
    assert outs["hf"][1] == outs["container"][1]


def test_container_records_are_canonical(models):
    """Convert de-interleaves gate/up and transposes to [out, in]: one record per expert."""
    from safetensors.torch import load_file

    from sluice.engine import ModelInfo
    from sluice.quant import record_views as views
    from sluice.storage import AlignedBuffer

    info = ModelInfo(models["container"])
    src = info.experts
    sd = load_file(str(models["hf"] / "model.safetensors"))
    p = "model.layers.1.mlp.experts."
    buf = AlignedBuffer(src.slot_bytes)
    layout = src.read(1, 5, buf)
    assert len(layout.reads) == 1
    w = views(buf, 0, layout)
    gu, gub = sd[p + "gate_up_proj"][5], sd[p + "gate_up_proj_bias"][5]
    assert torch.equal(w["gate"], gu[:, 0::2].T) and torch.equal(w["up"], gu[:, 1::2].T)
    assert torch.equal(w["down"], sd[p + "down_proj"][5].T)
    assert torch.equal(w["gate_bias"], gub[0::2]) and torch.equal(w["up_bias"], gub[1::2])
    assert torch.equal(w["down_bias"], sd[p + "down_proj_bias"][5])
    info.checkpoint.close()


def test_bf16_against_upcast_reference(models):
    path = _save(models["root"] / "bf16", dtype=torch.bfloat16)
    ref = _reference(path)
    ids = prompt_ids()
    with torch.no_grad():
        logits = ref(ids[None]).logits[0]
        out = ref.generate(ids[None], max_new_tokens=N_NEW, do_sample=False)[0]
    assert_decisive(ref, out, len(ids) - 1, ref.config.num_experts_per_tok)
    tol = 1e-4 * max(1.0, logits.abs().max().item())
    for p in (path, convert(path, models["root"] / "bf16.sluice", progress=False)):
        _check(p, (ids, logits, out[len(ids):].tolist(), ref), tol=tol, cache_experts=SMALL_CACHE)


def test_inspect_describes_gpt_oss(models, expected):
    from sluice.model_report import inspect_model, render_inspect

    ref = expected[3]
    n_params = sum(p.numel() for p in ref.parameters())
    per_expert = 3 * 64 * 32 + 2 * 32 + 64
    for source in ("hf", "container"):
        r = inspect_model(models[source])
        assert r["model_type"] == "gpt_oss" and r["layers"] == r["moe_layers"] == 3
        assert r["experts_per_layer"] == 8 and r["experts_per_token"] == 2
        assert r["params_total"] == n_params
        assert r["params_active_per_token"] == n_params - per_expert * (TOTAL_EXPERTS - 6)
        assert r["expert_format"] == "f32"
        assert r["bytes_per_expert"] >= per_expert * 4
        text = render_inspect(r)
        assert "gpt_oss" in text and "sliding-window" in text


def test_variant_without_attention_bias_tied_embeddings(models):
    """attention_bias=False and tied embeddings take other spine tensors; forward only."""
    path = _save(models["root"] / "nobias", attention_bias=False, tie_word_embeddings=True,
                 layer_types=["full_attention", "sliding_attention", "full_attention"])
    ref = _reference(path)
    ids = prompt_ids()
    with torch.no_grad():
        ref_logits = ref(ids[None]).logits[0]
    logits = sluice.load(path, memory="4GiB", progress=False).forward(ids)
    assert (logits - ref_logits).abs().max().item() <= 1e-4


# -- native MXFP4 ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mxfp4(models):
    """A real-layout MXFP4 GPT-OSS checkpoint (experts as blocks/scales, everything else bf16)
    and transformers' reference on it (dequantized by transformers itself, upcast to fp32)."""
    src = _save(models["root"] / "mxfp4-src", seed=MXFP4_SEED)
    dst, tensors = to_mxfp4(src, models["root"] / "mxfp4")
    ref = _reference(dst)  # on CPU transformers dequantizes MXFP4 experts (convert_moe_packed_tensors)
    ids = prompt_ids()
    with torch.no_grad():
        logits = ref(ids[None]).logits[0]
        out = ref.generate(ids[None], max_new_tokens=N_NEW, do_sample=False)[0]
    assert_decisive(ref, out, len(ids) - 1, ref.config.num_experts_per_tok)
    return dst, tensors, (ids, logits, out[len(ids):].tolist(), ref)


def test_mxfp4_weights_bit_identical_to_transformers(mxfp4):
    """The 4-bit slices Sluice streams, dequantized, are transformers' weights bit for bit."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from sluice.engine import ModelInfo
    from sluice.quant import QuantMatrix, assemble
    from sluice.storage import AlignedBuffer

    path, tensors, (_, _, _, ref) = mxfp4
    info = ModelInfo(path)
    src = info.experts
    assert src.format == "mxfp4" and src.native_quant
    p = "model.layers.2.mlp.experts."
    buf = AlignedBuffer(src.slot_bytes)
    layout = src.read(2, 6, buf)
    assert layout.format == "mxfp4" and layout.exact  # what the cache assembles a slot with
    w = assemble(buf, 0, layout)  # what the cache does when the read completes
    assert isinstance(w["gate_up"], QuantMatrix) and isinstance(w["down"], QuantMatrix) and w["gate_up"].exact
    gu_ref = convert_moe_packed_tensors(tensors[p + "gate_up_proj_blocks"], tensors[p + "gate_up_proj_scales"],
                                        dtype=torch.float32)[6]  # [H, 2I]
    down_ref = convert_moe_packed_tensors(tensors[p + "down_proj_blocks"], tensors[p + "down_proj_scales"],
                                          dtype=torch.float32)[6]  # [I, H]
    assert torch.equal(w["gate_up"].dequantize(), gu_ref.T) and torch.equal(w["down"].dequantize(), down_ref.T)
    assert torch.equal(gu_ref, ref.model.layers[2].mlp.experts.gate_up_proj[6].float())
    # 4.25 bits per weight plus bf16 biases: what one expert read brings in
    h, i = 64, 32
    assert src.record_bytes == 3 * h * i // 2 + 3 * h * i // 32 + 2 * (2 * i + h)
    info.checkpoint.close()
    from sluice.model_report import inspect_model

    r = inspect_model(path)
    assert r["expert_format"] == "mxfp4" and r["bytes_per_expert"] == src.record_bytes
    assert r["params_total"] == sum(p.numel() for p in ref.parameters())


@pytest.mark.parametrize("target", ["hf", "container-mxfp4", "container-f32"])
def test_mxfp4_exact_against_dequantized_reference(models, mxfp4, target):
    """Streamed in 4-bit form (fp32 activations, as the reference) from the HF directory or a
    container that copies the blocks; or dequantized once into an f32 container."""
    path, _, expected = mxfp4
    if target != "hf":
        fmt = target.split("-")[1]
        path = convert(path, models["root"] / f"mxfp4.{fmt}.sluice", experts=fmt, progress=False)
    tol = 1e-4 * max(1.0, expected[1].abs().max().item())
    eng, _, result = _check(path, expected, tol=tol, cache_experts=SMALL_CACHE)
    assert eng.experts_source.format == target.split("-")[-1].replace("hf", "mxfp4")
    assert result.stats["evictions"] > 0


def test_mxfp4_container_records_copy_the_blocks(models, mxfp4):
    """A container made from an MXFP4 checkpoint holds gate/up de-interleaved by rows, blocks
    and scales copied bit for bit (nothing requantized)."""
    from sluice.engine import ModelInfo
    from sluice.quant import record_views as views
    from sluice.storage import AlignedBuffer

    path, tensors, _ = mxfp4
    box = models["root"] / "mxfp4.mxfp4.sluice"
    if not box.exists():
        convert(path, box, progress=False)
    info = ModelInfo(box)
    src = info.experts
    assert src.format == "mxfp4" and src.native_quant
    buf = AlignedBuffer(src.slot_bytes)
    w = views(buf, 0, src.read(0, 3, buf))
    p = "model.layers.0.mlp.experts."
    for part in ("blocks", "scales"):
        gu = tensors[f"{p}gate_up_proj_{part}"][3]
        assert torch.equal(w[f"gate.{part}"], gu[0::2]) and torch.equal(w[f"up.{part}"], gu[1::2])
        assert torch.equal(w[f"down.{part}"], tensors[f"{p}down_proj_{part}"][3])
    info.checkpoint.close()


# -- pieces ---------------------------------------------------------------------------------


@pytest.mark.parametrize("truncate", [True, False])
def test_yarn_matches_transformers(truncate):
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from sluice.layers.rotary import Rotary

    params = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
              "truncate": truncate, "original_max_position_embeddings": 4096}
    cfg = AutoConfig.for_model("gpt_oss", head_dim=64, max_position_embeddings=131072, rope_parameters=params)
    inv, scale = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    rot = Rotary(64, gpt_oss.parse_config(cfg.to_dict()).rope, 131072)
    assert torch.equal(rot.inv_freq, inv) and rot.attention_scaling == scale


def test_router_is_softmax_over_topk_logits():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    cfg = tiny_config("gpt_oss", num_experts_per_tok=4)
    torch.manual_seed(3)
    r = GptOssTopKRouter(cfg)
    torch.nn.init.normal_(r.weight)
    torch.nn.init.normal_(r.bias)
    x = torch.randn(5, cfg.hidden_size)
    with torch.no_grad():
        _, scores, idx = r(x)
        ids, weights = TopKSoftmaxRouter(r.weight, 4, r.bias)(x)
    assert torch.equal(ids, idx) and torch.allclose(weights, scores, atol=1e-7)


@pytest.mark.skipif(not kernels.available(), reason="C kernels not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t,k,n", [(1, 1, 1), (1, 45, 37), (3, 128, 64), (5, 1000, 300), (8, 512, 2048), (7, 77, 130)])
def test_input_major_kernel(dtype, t, k, n):
    g = torch.Generator().manual_seed(n * k + t)
    w = torch.randn(k, n, generator=g).to(dtype)
    x = torch.randn(t, k, generator=g)
    b = torch.randn(n, generator=g)
    ref = (x.double() @ w.double() + b.double()).float()
    out = kernels.dense_t(x, w, b)
    assert torch.allclose(out, ref, atol=1e-4 * k**0.5, rtol=1e-5)
    # each row is the same fma chain whatever the batch: a token's result never depends on T
    rows = torch.cat([kernels.dense_t(x[i : i + 1].contiguous(), w, b) for i in range(t)])
    assert torch.equal(rows, out)


@pytest.mark.skipif(not kernels.available(), reason="C kernels not built")
def test_input_major_kernel_thread_independent():
    w = torch.randn(777, 1000).to(torch.bfloat16)
    x = torch.randn(2, 777)
    before = kernels.info()["threads"]
    try:
        kernels.set_threads(1)
        a = kernels.dense_t(x, w)
        kernels.set_threads(2)
        b = kernels.dense_t(x, w)
    finally:
        kernels.set_threads(before)
    assert torch.equal(a, b)


def test_linear_t_large_batch_bounded_upcast():
    from sluice.quant import linear_t

    w = torch.randn(1024, 5000).to(torch.bfloat16)
    x = torch.randn(40, 1024)
    b = torch.randn(5000).to(torch.bfloat16)
    assert torch.allclose(linear_t(x, w, b), x @ w.float() + b.float(), atol=1e-3)


# -- refused options ------------------------------------------------------------------------


def _raw(**changes) -> dict:
    raw = tiny_config("gpt_oss", **copy.deepcopy(CONFIG)).to_dict()
    raw.update(changes)
    return raw


@pytest.mark.parametrize("changes,match", [
    (dict(layer_types=["sliding_attention", "chunked_attention", "full_attention"]), "layer_types"),
    (dict(layer_types=["full_attention"]), "one type per layer"),
    (dict(sliding_window=None), "sliding_window"),
    (dict(quantization_config={"quant_method": "fp8"}), "quant_method"),
    (dict(quantization_config={"quant_method": "mxfp4",
                               "modules_to_not_convert": ["model.layers.*.mlp.experts"]}), "modules_to_not_convert"),
    (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}), "RoPE type"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
     "partial_rotary_factor"),
    (dict(num_key_value_heads=3), "num_key_value_heads"),
])
def test_unsupported_options_are_refused(changes, match):
    with pytest.raises(UnsupportedModelError, match=match):
        gpt_oss.parse_config(_raw(**changes))


def test_config_defaults_follow_transformers():
    """A config.json without rope/layer_types gets transformers' GptOssConfig defaults."""
    raw = _raw()
    for key in ("rope_parameters", "layer_types", "rope_theta"):
        raw.pop(key, None)
    cfg = gpt_oss.parse_config(raw)
    assert cfg.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert cfg.rope["rope_type"] == "yarn" and cfg.rope["rope_theta"] == 150000.0
    assert cfg.rope["truncate"] is False and cfg.rope["factor"] == 32.0
    # MXFP4 as real checkpoints declare it: attention, router, embeddings and head stay unquantized
    mx = gpt_oss.parse_config(_raw(quantization_config={
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                   "lm_head"]}))
    assert mx.mxfp4


def test_released_config_shape():
    """config.json as the released checkpoints write it: legacy ``rope_scaling`` + top-level
    ``rope_theta``, no ``swiglu_alpha``; the same RoPE as transformers derives from it."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from sluice.layers.rotary import Rotary

    raw = {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "vocab_size": 201088,
           "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64,
           "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4,
           "experts_per_token": 4, "sliding_window": 128, "swiglu_limit": 7.0, "rms_norm_eps": 1e-05,
           "max_position_embeddings": 131072, "initial_context_length": 4096, "rope_theta": 150000,
           "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                            "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
           "layer_types": ["sliding_attention", "full_attention"] * 12, "attention_bias": True,
           "tie_word_embeddings": False, "hidden_act": "silu", "eos_token_id": 200002, "pad_token_id": 199999,
           "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
               "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}}
    cfg = gpt_oss.parse_config(raw)
    assert cfg.mxfp4 and cfg.swiglu_alpha == 1.702 and cfg.sliding_window == 128
    desc = gpt_oss.describe(cfg)
    assert desc.expert_format == "mxfp4" and desc.working_set == 4 * 24
    refs = desc.expert_tensors(0, 31)
    assert refs["gate_up.blocks"].shape == (5760, 90, 16) and refs["down.scales"].shape == (2880, 90)
    hf = AutoConfig.for_model(**{k: v for k, v in raw.items() if k != "quantization_config"})
    inv, scale = ROPE_INIT_FUNCTIONS["yarn"](hf)
    rot = Rotary(64, cfg.rope, cfg.max_position_embeddings)
    assert torch.equal(rot.inv_freq, inv) and rot.attention_scaling == scale
