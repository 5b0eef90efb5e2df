"""DeepSeek-V3 vs transformers: MLA (latent cache, naive and absorbed), grouped sigmoid
routing with the correction bias, shared experts, dense layers, YaRN, bf16 and block-FP8
checkpoints, streaming with evictions, the packed container and router lookahead."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import sluice
from conftest import LOGIT_MARGIN, ROUTER_MARGIN, prompt_ids
from families import to_fp8 as _to_fp8
from sluice import kernels
from sluice.convert import convert
from sluice.layers.mla import MLA
from sluice.layers.routing import grouped_topk
from sluice.quant.fp8 import BlockFP8, quantize

N_NEW = 32

BASE = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=1,
    topk_group=1, first_k_dense_replace=0, kv_lora_rank=40, q_lora_rank=48, qk_rope_head_dim=8,
    qk_nope_head_dim=16, v_head_dim=16, n_shared_experts=1, routed_scaling_factor=2.5, initializer_range=0.2,
    max_position_embeddings=512, bos_token_id=1, eos_token_id=None, pad_token_id=0,
)

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
        "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}

# name -> (config overrides, seed); each variant is checked against transformers
VARIANTS = {
    # q low-rank, grouped routing (4 groups, 2 kept), one leading dense layer
    "lora-grouped-dense1": (dict(n_group=4, topk_group=2, first_k_dense_replace=1), 0),
    # plain q_proj, rotate-half RoPE, attention biases, two shared experts, tied embeddings
    "qproj-bias": (dict(q_lora_rank=None, rope_interleave=False, attention_bias=True, n_shared_experts=2,
                        norm_topk_prob=False, tie_word_embeddings=True), 0),
    # YaRN with mscale / mscale_all_dim (cos/sin factor and softmax scale correction)
    "yarn": (dict(rope_parameters=YARN, n_group=2, topk_group=1), 0),
}


def _save(path: Path, seed: int, dtype=torch.float32, **overrides) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("deepseek_v3", **{**BASE, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # non-trivial norm weights, so each one is proven to be applied
                p.copy_(1 + 0.2 * torch.randn_like(p))
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:  # a correction bias that changes selections (weights must ignore it)
                gate.e_score_correction_bias.copy_(0.3 * torch.randn_like(gate.e_score_correction_bias))
    model.to(dtype).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def ds_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek")
    made: dict = {}

    def make(variant: str, dtype: str = "float32") -> Path:
        key = (variant, dtype)
        if key not in made:
            overrides, seed = VARIANTS[variant]
            made[key] = _save(root / f"{variant}-{dtype}", seed, getattr(torch, dtype), **overrides)
        return made[key]

    yield make
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def fp8_dirs(ds_dir, tmp_path_factory):
    """(FP8 checkpoint, its fp32 dequantized twin) of the grouped variant."""
    root = tmp_path_factory.mktemp("deepseek-fp8")
    return _to_fp8(ds_dir("lora-grouped-dense1"), root / "fp8", root / "dequantized")


def _reference(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _assert_decisive(ref, ids: torch.Tensor, first: int) -> None:
    """A clear top-1 logit from ``first`` on, and clear expert and group choices everywhere,
    under DeepSeek-V3's own selection rule (sigmoid + correction bias, group top-2 sums)."""
    cfg = ref.config
    with torch.no_grad():
        out = ref(ids[None], output_router_logits=True)
    top = out.logits[0, first:].topk(2, dim=-1).values
    margin = (top[:, 0] - top[:, 1]).min().item()
    assert margin > LOGIT_MARGIN, f"top-1/top-2 logit margin {margin:.2e} is a near-tie: pick another seed"
    gates = [layer.mlp.gate for layer in ref.model.layers if hasattr(layer.mlp, "gate")]
    assert len(gates) == len(out.router_logits)
    for gate, logits in zip(gates, out.router_logits):
        choice = torch.sigmoid(logits.float()) + gate.e_score_correction_bias
        t, e = choice.shape
        if cfg.n_group > 1 and cfg.topk_group < cfg.n_group:
            gs = choice.view(t, cfg.n_group, -1).topk(2, dim=-1).values.sum(-1).sort(dim=-1, descending=True).values
            gm = (gs[:, cfg.topk_group - 1] - gs[:, cfg.topk_group]).min().item()
            assert gm > ROUTER_MARGIN, f"group margin {gm:.2e} is a near-tie: pick another seed"
            keep = torch.zeros(t, cfg.n_group, dtype=torch.bool)
            keep.scatter_(1, choice.view(t, cfg.n_group, -1).topk(2, dim=-1).values.sum(-1)
                          .topk(cfg.topk_group, dim=-1).indices, True)
            choice = choice.masked_fill(~keep.repeat_interleave(e // cfg.n_group, dim=1), float("-inf"))
        s = choice.sort(dim=-1, descending=True).values
        k = cfg.num_experts_per_tok
        rm = (s[:, k - 1] - s[:, k]).min().item()
        assert rm > ROUTER_MARGIN, f"router margin {rm:.2e} is a near-tie: pick another seed"


def _check(path: Path, ref_path: Path | None = None, tol_scale: bool = False, cache_experts: int | None = None,
           **opts):
    """Logits at every prompt position and 32 greedy tokens against transformers."""
    ref = _reference(ref_path or path)
    ids = prompt_ids()
    eng = sluice.load(path, memory="4GiB", cache_experts=cache_experts, progress=False, **opts)
    with torch.no_grad():
        ref_logits = ref(ids[None]).logits[0]
    logits = eng.forward(ids)
    tol = 1e-4 * max(1.0, ref_logits.abs().max().item()) if tol_scale else 1e-4
    diff = (logits - ref_logits).abs().max().item()
    assert diff <= tol, f"max |logit diff| {diff:.3e} > {tol:.1e}"
    with torch.no_grad():
        ref_out = ref.generate(ids[None], max_new_tokens=N_NEW, do_sample=False)[0]
    _assert_decisive(ref, ref_out, len(ids) - 1)
    plain = eng.generate(ids.tolist(), max_new_tokens=N_NEW, speculate=False)
    assert plain.token_ids == ref_out[len(ids):].tolist()
    result = eng.generate(ids.tolist(), max_new_tokens=N_NEW)  # with n-gram speculation (the default)
    assert result.token_ids == ref_out[len(ids):].tolist()
    return eng, logits, result


def _small_cache(eng) -> int:
    return max(eng.desc.top_k, eng.desc.total_experts // 3 - 1)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fp32_exact_streaming_and_container(ds_dir, variant, tmp_path):
    path = ds_dir(variant)
    probe = sluice.load(path, memory="4GiB", progress=False)
    cache = _small_cache(probe)
    eng, logits, result = _check(path, cache_experts=cache)
    assert eng.plan.cache_slots < eng.desc.total_experts / 3
    assert result.stats["evictions"] > 0 and result.stats["expert_misses"] > 0
    assert result.stats["lookahead_predictions"] > 0 and 0 < result.stats["lookahead_recall"] <= 1
    # the container holds the same bits: identical logits and tokens
    box = convert(path, tmp_path / "m.sluice", progress=False)
    b = sluice.load(box, memory="4GiB", cache_experts=cache, progress=False)
    assert b.info.is_container
    assert torch.equal(b.forward(prompt_ids()), logits)
    assert b.generate(prompt_ids().tolist(), max_new_tokens=N_NEW).token_ids == result.token_ids


def test_bf16_against_upcast_reference(ds_dir):
    path = ds_dir("lora-grouped-dense1", "bfloat16")
    eng, _, _ = _check(path, tol_scale=True, cache_experts=4)
    assert eng.experts_source.format == "bf16"


def test_fp8_against_dequantized_reference(fp8_dirs, tmp_path):
    fp8, ref = fp8_dirs
    eng, logits, result = _check(fp8, ref, cache_experts=4)  # fp32 compute on both sides: the fp32 bound
    assert eng.experts_source.format == "fp8"
    assert result.stats["evictions"] > 0
    attn = eng.model.layers[1].attn
    assert isinstance(attn.wkv_b, BlockFP8) and attn.wkv_b.weight.dtype == torch.float8_e4m3fn  # kept in FP8
    assert isinstance(eng.model.layers[0].mlp.gate, BlockFP8)  # dense layer
    slot = next(s for s in eng.cache.slots if s.weights is not None)
    assert isinstance(slot.weights["down"], BlockFP8)  # cache slots hold FP8 and block scales
    assert eng.info.experts.record_bytes < sluice.load(ref, memory="4GiB", progress=False).info.experts.record_bytes
    box = convert(fp8, tmp_path / "fp8.sluice", progress=False)
    b = sluice.load(box, memory="4GiB", cache_experts=4, progress=False)
    assert b.experts_source.format == "fp8"
    assert torch.equal(b.forward(prompt_ids()), logits)
    assert b.generate(prompt_ids().tolist(), max_new_tokens=N_NEW).token_ids == result.token_ids
    with pytest.raises(ValueError, match="FP8"):
        convert(fp8, tmp_path / "bf16.sluice", experts="bf16", progress=False)


def test_transformers_fp8_loading_on_cpu(ds_dir, tmp_path):
    """transformers' own FP8 path on a CPU-only machine dequantizes at load; it agrees.

    (It derives the block from the weight and scale-grid shapes, so it rejects matrices
    whose sides are not multiples of the block; hence 8x8 blocks here.)"""
    pytest.importorskip("accelerate")  # transformers' FP8 loader needs it
    fp8, _ = _to_fp8(ds_dir("lora-grouped-dense1"), tmp_path / "fp8", tmp_path / "deq", block=[8, 8])
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(fp8, dtype=torch.float32).eval()
    ids = prompt_ids()
    with torch.no_grad():
        ref_logits = ref(ids[None]).logits[0].float()
    logits = sluice.load(fp8, memory="4GiB", progress=False).forward(ids)
    assert (logits - ref_logits).abs().max().item() <= 1e-4


def test_absorbed_and_naive_attention_agree(ds_dir):
    """Decode runs MLA absorbed (kv_b folded into q and output), and so does prefill with
    batch-invariant kernels (naive without them, when cheaper); forcing either
    everywhere changes logits by fp32 rounding only and leaves greedy tokens unchanged."""
    path = ds_dir("yarn")
    ids = prompt_ids(seed=3)
    runs = {}
    for mode in (False, True):
        eng = sluice.load(path, memory="4GiB", progress=False)
        attns = [layer.attn for layer in eng.model.layers]
        assert all(isinstance(a, MLA) for a in attns)
        # the automatic choice: always absorbed with batch-invariant kernels (one way for every
        # chunk size), else the cheaper one (naive for a prefill from an empty cache)
        assert attns[0].use_absorbed(1, 17) and attns[0].use_absorbed(16, 16)
        prev = kernels.set_batch_invariant(False)
        try:
            assert attns[0].use_absorbed(1, 17) and not attns[0].use_absorbed(16, 16)
        finally:
            kernels.set_batch_invariant(prev)
        for a in attns:
            a.absorb = mode
        runs[mode] = (eng.forward(ids), eng.generate(ids.tolist(), max_new_tokens=8).token_ids)
    assert (runs[True][0] - runs[False][0]).abs().max().item() < 2e-5
    assert runs[True][1] == runs[False][1]
    # the latent cache truncates like a KV cache: reusing the prompt prefix gives the same tokens
    eng = sluice.load(path, memory="4GiB", progress=False)
    first = eng.generate(ids.tolist(), max_new_tokens=8)
    again = eng.generate(ids.tolist(), max_new_tokens=8, reuse_prefix=True)
    assert again.stats["reused_prefix_tokens"] == len(ids) - 1
    assert again.token_ids == first.token_ids == runs[True][1]


def test_grouped_router_matches_transformers():
    from transformers import AutoConfig
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=g)
    for n_group, topk_group, norm in ((1, 1, True), (4, 2, True), (8, 3, False)):
        cfg = AutoConfig.for_model("deepseek_v3", hidden_size=16, num_attention_heads=4, n_routed_experts=32,
                                   num_experts_per_tok=4, n_group=n_group, topk_group=topk_group, norm_topk_prob=norm,
                                   routed_scaling_factor=1.5)
        r = DeepseekV3TopkRouter(cfg)
        with torch.no_grad():
            r.weight.copy_(torch.randn(32, 16, generator=g))
            r.e_score_correction_bias.copy_(0.2 * torch.randn(32, generator=g))
            _, want_w, want_i = r(x)
        ids, w = grouped_topk(x @ r.weight.T, 4, bias=r.e_score_correction_bias, n_group=n_group,
                              topk_group=topk_group, normalize=norm, scale=1.5)
        _same_routing(ids, w, want_i, want_w)
    # softmax scoring with max-per-group selection (DeepSeek-V2's group_limited_greedy)
    cfg = AutoConfig.for_model("deepseek_v2", hidden_size=16, num_attention_heads=4, n_routed_experts=32,
                               num_experts_per_tok=4, n_group=4, topk_group=2, topk_method="group_limited_greedy",
                               routed_scaling_factor=1.5)
    r = DeepseekV2TopkRouter(cfg)
    with torch.no_grad():
        r.weight.copy_(torch.randn(32, 16, generator=g))
        _, want_w, want_i = r(x)
    ids, w = grouped_topk(x @ r.weight.T, 4, scoring="softmax", n_group=4, topk_group=2, group_score="max",
                          normalize=False, scale=1.5)
    _same_routing(ids, w, want_i, want_w)


def _same_routing(ids, w, want_i, want_w):
    a, oa = ids.sort(dim=-1)
    b, ob = want_i.sort(dim=-1)
    assert torch.equal(a, b)
    torch.testing.assert_close(w.gather(1, oa), want_w.gather(1, ob), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("shape", [(40, 64), (33, 50), (128, 200)])
def test_block_fp8_matrix(shape):
    """Partial edge blocks (ceil semantics), the fused multiply (C kernel and torch paths) and row slices."""
    from sluice import kernels

    g = torch.Generator().manual_seed(sum(shape))
    w32 = torch.randn(shape, generator=g)
    block = (16, 32)
    q, s = quantize(w32, block)
    m = BlockFP8(q, s, block)
    deq = m.dequantize()
    n, k = shape
    rows, cols = torch.arange(n)[:, None] // block[0], torch.arange(k)[None, :] // block[1]
    assert torch.equal(deq, q.float() * s[rows, cols])  # exactly the per-element definition
    assert (deq - w32).abs().max() <= w32.abs().max() / 8  # e4m3 keeps 3 mantissa bits
    bias = torch.randn(n, generator=g)
    for t in (1, 3, 8, 20):  # <= 8 rows: the C kernel when built; more: dequantized row blocks + sgemm
        x = torch.randn(t, k, generator=g)
        want = x @ deq.T + bias
        torch.testing.assert_close(m.linear(x, bias), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(m.linear(x, None, 7, n - 3), (x @ deq.T)[:, 7 : n - 3], rtol=1e-5, atol=1e-5)
    # per-head products over row ranges (MLA absorption): heads of 7 rows, 9 apart, from row 2 on
    heads, d, stride, r0 = 4, 7, 9, 2
    if r0 + (heads - 1) * stride + d <= n:
        xo = torch.randn(3, heads, k, generator=g)
        xq = torch.randn(3, heads, d, generator=g)
        want_o = torch.stack([xo[:, h] @ deq[r0 + h * stride : r0 + h * stride + d].T for h in range(heads)], 1)
        want_q = torch.stack([xq[:, h] @ deq[r0 + h * stride : r0 + h * stride + d] for h in range(heads)], 1)
        for fused in (True, False):  # C kernels, torch fallback
            avail = kernels._lib.fp8
            kernels._lib.fp8 = avail and fused
            try:
                torch.testing.assert_close(m.heads(xo, r0, stride, d), want_o, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(m.heads_t(xq, r0, stride), want_q, rtol=1e-5, atol=1e-5)
            finally:
                kernels._lib.fp8 = avail
    if kernels.fp8_available():
        x = torch.randn(2, k, generator=g)
        for threads in (1, 2):
            kernels.set_threads(threads)
            torch.testing.assert_close(kernels.fp8_dense(x, q, s, None, block), x @ deq.T, rtol=1e-5, atol=1e-5)
        kernels.set_threads(torch.get_num_threads())


def test_inspect_and_notes(ds_dir, tmp_path):
    from sluice.model_report import inspect_model

    src = ds_dir("yarn")
    cfg = json.loads((src / "config.json").read_text())
    r = inspect_model(src, max_context=256)
    assert r["model_type"] == "deepseek_v3" and r["moe_layers"] == 3
    # latent cache: (kv_lora_rank + qk_rope_head_dim) fp32 per position per layer
    assert r["kv_state_bytes"] == 4 * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 3 * 256
    assert any("multi-token-prediction" in n for n in r["notes"])  # num_nextn_predict_layers: 1
    # Kimi K2 ships this architecture under its own model_type: read the same way
    kimi = tmp_path / "kimi"
    shutil.copytree(src, kimi)
    (kimi / "config.json").write_text(json.dumps({**cfg, "model_type": "kimi_k2"}))
    ids = prompt_ids()
    assert torch.equal(sluice.load(kimi, memory="4GiB", progress=False).forward(ids),
                       sluice.load(src, memory="4GiB", progress=False).forward(ids))


def test_moe_layer_freq():
    from sluice.models import deepseek_v3 as ds

    raw = {**BASE, "model_type": "deepseek_v3", "num_hidden_layers": 6, "first_k_dense_replace": 1,
           "moe_layer_freq": 2, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    desc = ds.describe(ds.parse_config(raw))
    assert desc.moe_layers == [2, 4]
    assert "model.layers.3.mlp.gate_proj.weight" in desc.spine
    assert "model.layers.4.mlp.gate.e_score_correction_bias" in desc.spine


@pytest.mark.parametrize("edit,message", [
    (dict(scoring_func="softmax"), "scoring_func='softmax' is not supported"),
    (dict(topk_method="greedy"), "topk_method='greedy' is not supported"),
    (dict(num_key_value_heads=2), "num_key_value_heads=2"),
    (dict(n_group=3), "not divisible by n_group=3"),
    (dict(n_group=2, topk_group=3), "topk_group=3 exceeds n_group=2"),
    (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}), "RoPE type 'dynamic'"),
    (dict(quantization_config={"quant_method": "awq"}), "quant_method='awq'"),
    (dict(quantization_config={"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}), "fmt='e5m2'"),
    (dict(quantization_config={"quant_method": "fp8", "activation_scheme": "static",
                               "weight_block_size": [128, 128]}), "activation_scheme='static'"),
    (dict(quantization_config={"quant_method": "fp8", "weight_block_size": None}), "weight_block_size=None"),
    (dict(hidden_act="swiglu_oai"), "activation 'swiglu_oai'"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0}), "RoPE type 'yarn' without a 'factor'"),
])
def test_unsupported_options_are_refused(ds_dir, tmp_path, edit, message):
    src = ds_dir("lora-grouped-dense1")
    dst = tmp_path / "m"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(edit)
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(sluice.UnsupportedModelError, match=message.replace("[", r"\[").replace("(", r"\(")):
        sluice.load(dst, memory="4GiB", progress=False)


def test_fp8_checkpoint_without_scales_is_clear(fp8_dirs, tmp_path):
    """An FP8 tensor whose weight_scale_inv is missing names the tensor."""
    from safetensors.torch import load_file, save_file

    fp8, _ = fp8_dirs
    dst = tmp_path / "broken"
    shutil.copytree(fp8, dst)
    t = load_file(dst / "model.safetensors")
    del t["model.layers.1.self_attn.kv_b_proj.weight_scale_inv"]
    save_file(t, dst / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(sluice.CheckpointError, match=r"kv_b_proj\.weight_scale_inv' is missing"):
        sluice.load(dst, memory="4GiB", progress=False)
    # FP8 tensors in a checkpoint whose config.json declares no quantization
    shutil.copy(fp8 / "model.safetensors", dst / "model.safetensors")
    cfg = json.loads((dst / "config.json").read_text())
    del cfg["quantization_config"]
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(sluice.CheckpointError, match="declares no FP8 quantization"):
        sluice.load(dst, memory="4GiB", progress=False)
