"""DeepSeek sparse attention (``deepseek_v32``, and ``glm_moe_dsa`` where both share it): the
published tensor names and config.json, the lightning indexer against transformers' own
(selections identical; with ties, identical to the row transformers scores when it decodes),
and long runs against transformers on the registry's tiny models (index_topk 8 and 18): prompt
plus generation several times index_topk, logits at every position, greedy tokens, prefill in
chunks that straddle index_topk, and speculative drafts verified across it, bit for bit; the
published FP8 layout (indexer wq_b / wk in FP8, weights_proj bf16) against its dequantized twin.

(The registry entries run every axis of the fidelity matrix too.)"""

from __future__ import annotations

import math

import pytest
import torch

import sluice
import sluice.generation
from conftest import prompt_ids
from families import assert_decisive_model, reference
from sluice.layers.dsa import IndexedLatentCache, SparseMLA
from sluice.layers.indexer import LightningIndexer, layer_norm
from sluice.models import get_family

ds = get_family("deepseek_v32")
FAMILIES = ("deepseek_v32", "glm_moe_dsa")
SELECTION_MARGIN = 1e-5  # k-th minus (k+1)-th indexer score: far above fp32 rounding (~1e-7)

FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
       "scale_fmt": "ue8m0"}
# The published DeepSeek-V3.2-Exp config.json (the keys its architecture reads)
V32_CONFIG = dict(
    architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32", vocab_size=129280, hidden_size=7168,
    intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
    num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512,
    q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4,
    num_experts_per_tok=8, first_k_dense_replace=3, moe_layer_freq=1, norm_topk_prob=True, scoring_func="sigmoid",
    topk_method="noaux_tc", hidden_act="silu", max_position_embeddings=163840, rms_norm_eps=1e-6, rope_theta=10000,
    rope_scaling={"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                  "original_max_position_embeddings": 4096},
    index_topk=2048, index_head_dim=128, index_n_heads=64, num_nextn_predict_layers=1, tie_word_embeddings=False,
    attention_bias=False, quantization_config=FP8)


def test_checkpoint_tensor_names():
    """The names and shapes of a sparse layer as the published model.safetensors.index.json has them:
    the indexer's wq_b and wk in FP8 with their block scales, its LayerNorm k_norm (weight and bias) and
    weights_proj (bf16, no scale) as stored; the MTP layer 61 never read; the state per position."""
    desc = ds.describe(ds.parse_config(V32_CONFIG))
    p = "model.layers.3.self_attn."
    attn = {k[len(p):]: v for k, v in desc.spine.items() if k.startswith(p)}
    assert attn == {
        "q_a_proj.weight": (1536, 7168), "q_a_proj.weight_scale_inv": (12, 56), "q_a_layernorm.weight": (1536,),
        "q_b_proj.weight": (24576, 1536), "q_b_proj.weight_scale_inv": (192, 12),
        "kv_a_proj_with_mqa.weight": (576, 7168), "kv_a_proj_with_mqa.weight_scale_inv": (5, 56),
        "kv_a_layernorm.weight": (512,), "kv_b_proj.weight": (32768, 512), "kv_b_proj.weight_scale_inv": (256, 4),
        "o_proj.weight": (7168, 16384), "o_proj.weight_scale_inv": (56, 128),
        "indexer.wq_b.weight": (8192, 1536), "indexer.wq_b.weight_scale_inv": (64, 12),
        "indexer.wk.weight": (128, 7168), "indexer.wk.weight_scale_inv": (1, 56),
        "indexer.k_norm.weight": (128,), "indexer.k_norm.bias": (128,), "indexer.weights_proj.weight": (64, 7168)}
    assert desc.moe_layers == list(range(3, 61)) and "model.layers.0.mlp.gate_proj.weight" in desc.spine
    assert not any(k.startswith("model.layers.61.") for k in desc.spine)
    e = "model.layers.60.mlp.experts.255."
    assert {r: t.name for r, t in desc.expert_tensors(60, 255).items()}["down"] == e + "down_proj.weight"
    # latent (512 + 64) and indexer keys (128) per position on each of the 61 layers, fp32
    assert desc.state_bytes_per_token == 61 * 4 * (512 + 64 + 128) and desc.state_bytes_fixed == 0
    assert any("index_topk=2048" in n and "64 heads x 128" in n for n in desc.notes)


def test_released_config_fields():
    cfg = ds.parse_config(V32_CONFIG)
    assert (cfg.index_topk, cfg.index_n_heads, cfg.index_head_dim, cfg.index_interleave) == (2048, 64, 128, False)
    assert cfg.indexer_types == ("full",) * 61 and cfg.rope_interleave and cfg.mtp_layers == 1
    # the YaRN softmax scale as transformers' AXK1 attention computes it (mscale_all_dim 1, factor 40)
    assert cfg.softmax_scale == pytest.approx(192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2, rel=1e-12)
    minimal = {k: v for k, v in V32_CONFIG.items() if k not in (
        "index_topk", "index_head_dim", "index_n_heads", "first_k_dense_replace", "n_group", "topk_group",
        "q_lora_rank", "kv_lora_rank", "n_routed_experts", "num_experts_per_tok", "quantization_config")}
    same = ds.parse_config(minimal)  # transformers' DeepseekV32Config defaults fill the rest
    assert (same.index_topk, same.index_n_heads, same.index_head_dim, same.moe_layers, same.q_lora_rank,
            same.n_group, same.topk_group) == (2048, 64, 128, cfg.moe_layers, 1536, 8, 4)


# -- the indexer against transformers' --------------------------------------------------------


def _hf_indexer(family: str, topk: int, seed: int):
    """transformers' indexer module of ``family`` with random weights, and the RoPE (cos, sin) of 40 positions."""
    from transformers import AutoConfig

    if family == "deepseek_v32":
        from transformers.models.deepseek_v32.modeling_deepseek_v32 import (
            DeepseekV32Indexer as Indexer, DeepseekV32RotaryEmbedding as RoPE)
    else:
        from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import (
            GlmMoeDsaIndexer as Indexer, GlmMoeDsaRotaryEmbedding as RoPE)
    cfg = AutoConfig.for_model(family, hidden_size=32, q_lora_rank=24, qk_rope_head_dim=8, index_head_dim=16,
                               index_n_heads=8, index_topk=topk, num_attention_heads=4, num_key_value_heads=4)
    torch.manual_seed(seed)
    ix = Indexer(cfg, 0).eval()
    with torch.no_grad():
        for p in ix.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    cos, sin = RoPE(cfg)(torch.zeros(1), torch.arange(40)[None])
    return ix, cos, sin


def _hf_select(ix, x, q_resid, cos, sin) -> torch.Tensor:
    """transformers' top-k indices [T, K] for a one-pass forward over the rows x [T, H]."""
    t = x.shape[0]
    mask = torch.full((t, t), torch.finfo(torch.float32).min).triu(1)[None]
    with torch.no_grad():
        return ix(x[None], q_resid[None], (cos[:, :t], sin[:, :t]), mask, None)[0].long()


def _ours(ix, topk: int, interleave: bool) -> LightningIndexer:
    return LightningIndexer(wq_b=ix.wq_b.weight.detach(), wk=ix.wk.weight.detach(),
                            weights_proj=ix.weights_proj.weight.detach(), k_norm_weight=ix.k_norm.weight.detach(),
                            k_norm_bias=ix.k_norm.bias.detach(), n_heads=ix.n_heads, head_dim=ix.head_dim,
                            topk=topk, interleave=interleave)


def _sluice_select(ours, x, q_resid, cos, sin, chunk: int | None = None) -> list:
    t = x.shape[0]
    keys = ours.keys(x, cos[0, :t], sin[0, :t])
    q, w = ours.queries(q_resid, x, cos[0, :t], sin[0, :t])
    step = chunk or t
    out = []
    for s in range(0, t, step):
        out += ours.select(q[s : s + step], w[s : s + step], keys[: min(t, s + step)], s)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_indexer_selects_what_transformers_selects(family):
    """Random weights (no ties): every query keeps the positions transformers' indexer keeps; a query that
    sees topk positions or fewer keeps them all; the same selections computed in chunks of 7."""
    topk = 10
    ix, cos, sin = _hf_indexer(family, topk, seed=1)
    g = torch.Generator().manual_seed(2)
    x, q_resid = torch.randn(40, 32, generator=g), torch.randn(40, 24, generator=g)
    want = _hf_select(ix, x, q_resid, cos, sin)
    ours = _ours(ix, topk, interleave=family == "glm_moe_dsa")
    got = _sluice_select(ours, x, q_resid, cos, sin)
    for i, sel in enumerate(got):
        if i + 1 <= topk:
            assert sel is None and set(range(i + 1)) <= set(want[i].tolist())
        else:
            assert sel.tolist() == sorted(want[i].tolist()), f"query {i}"
    chunked = _sluice_select(ours, x, q_resid, cos, sin, chunk=7)
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(got, chunked))
    other = _ours(ix, topk, interleave=family != "glm_moe_dsa")  # the other RoPE layout selects otherwise
    assert any(a is not None and not torch.equal(a, b)
               for a, b in zip(got, _sluice_select(other, x, q_resid, cos, sin)))


@pytest.mark.parametrize("family", FAMILIES)
def test_tied_scores_resolve_as_transformers_decodes(family):
    """Every score of a query tied (k_norm's weight 0, its bias 0 on the rotated dims: one key for every
    position): each query keeps exactly what transformers' indexer keeps for the last query of a forward
    over its own prefix (the row it scores when decoding token by token), whatever the chunking. (Its
    one-pass forward resolves some of these ties otherwise: why the long runs are checked tie-free.)"""
    topk = 6
    ix, cos, sin = _hf_indexer(family, topk, seed=3)
    with torch.no_grad():
        ix.k_norm.weight.zero_()
        ix.k_norm.bias[:8] = 0
    g = torch.Generator().manual_seed(4)
    x, q_resid = torch.randn(40, 32, generator=g), torch.randn(40, 24, generator=g)
    ours = _ours(ix, topk, interleave=family == "glm_moe_dsa")
    for chunk in (None, 5):
        got = _sluice_select(ours, x, q_resid, cos, sin, chunk)
        for n in range(topk + 1, 41):
            decoding = _hf_select(ix, x[:n], q_resid[:n], cos, sin)[-1]
            assert got[n - 1].tolist() == sorted(decoding.tolist()), f"query {n - 1}"
    one_pass = _hf_select(ix, x, q_resid, cos, sin)
    assert any(got[n - 1].tolist() != sorted(one_pass[n - 1].tolist()) for n in range(topk + 1, 41))


def test_layer_norm_matches_torch():
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(50, 128, generator=g) * 3 + 1, torch.randn(128, generator=g), torch.randn(128, generator=g)
    want = torch.nn.functional.layer_norm(x, (128,), w, b, 1e-6)
    assert (layer_norm(x, w, b, 1e-6) - want).abs().max().item() < 1e-5
    rows = torch.cat([layer_norm(x[i : i + 1], w, b, 1e-6) for i in range(50)])
    assert torch.equal(rows, layer_norm(x, w, b, 1e-6))


# -- long runs against transformers -----------------------------------------------------------

N_PROMPT, N_NEW = 6, 74  # a prompt under both index_topk (8, 18): drafts cross it


class _Margins:
    """The smallest k-th minus (k+1)-th indexer score of every selecting query (patched in)."""

    def __init__(self, monkeypatch):
        self.low = math.inf
        self.rows = 0
        select = LightningIndexer.select

        def checked(ix, q, w, keys, start):
            out = select(ix, q, w, keys, start)
            for i in range(q.shape[0]):
                if start + i + 1 > ix.topk:
                    v = ix.scores(q[i], w[i], keys[: start + i + 1]).topk(ix.topk + 1).values
                    self.low = min(self.low, (v[-2] - v[-1]).item())
                    self.rows += 1
            return out

        monkeypatch.setattr(LightningIndexer, "select", checked)


class _Forwards:
    """(start, rows) of every forward of a layer with its own indexer (patched in)."""

    def __init__(self, monkeypatch):
        self.seen: set[tuple[int, int]] = set()
        segments = SparseMLA.segments

        def recorded(attn, x, segs, cos, sin):
            if attn.indexer is not None:
                self.seen.update((start, r1 - r0) for r0, r1, start, _ in segs)
            return segments(attn, x, segs, cos, sin)

        monkeypatch.setattr(SparseMLA, "segments", recorded)


def _oracle_drafter(seq: list[int], prompt: int):
    """A drafter class proposing, once decoding (past the ``prompt``), the reference's next 3 tokens then a
    wrong one: drafts verified several rows at a time everywhere, accepted in part and rolled back."""

    class Oracle:
        def __init__(self, tokens):
            self.tokens = list(tokens)

        def append(self, token):
            self.tokens.append(token)

        def propose(self):
            n = len(self.tokens)
            if self.tokens != seq[:n] or not prompt < n < len(seq):
                return []
            good = seq[n : n + 3]
            return good + [(seq[n + 3] + 1) % 256] if n + 3 < len(seq) else good

        def feedback(self, drafted, accepted):
            pass

    return Oracle


@pytest.mark.parametrize("kind", ["f32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_long_run_against_transformers(family, kind, family_models, monkeypatch):
    """Prompt plus generation 80 positions (10x / 4.4x index_topk): logits at every position within the
    matrix's tolerance of transformers' one pass, its greedy tokens, the indexer's k-th score apart from
    the next at every query; prefill in chunks of 5 (straddling index_topk) and speculative drafts
    verified across it give the bits of one chunk and of plain decoding."""
    path = family_models.hf(family, kind)
    ref = reference(path)
    ids = prompt_ids(N_PROMPT, seed=1)
    with torch.no_grad():
        ref_out = ref.generate(ids[None], max_new_tokens=N_NEW, do_sample=False)[0]
        ref_logits = ref(ref_out[None]).logits[0]
    assert_decisive_model(ref, ref_out, N_PROMPT - 1)
    seq = ref_out.tolist()
    margins = _Margins(monkeypatch)
    with sluice.load(path, memory="4GiB", progress=False) as eng:
        topk = eng.model.layers[0].attn.indexer.topk
        assert len(seq) >= 4 * topk > 4 * N_PROMPT
        logits = eng.forward(seq)
        tol = 1e-4 * (1 if kind == "f32" else max(1.0, ref_logits.abs().max().item()))
        diff = (logits - ref_logits).abs().max().item()
        assert diff <= tol, f"max |logit diff| {diff:.3e} > {tol:.1e}"
        assert margins.low > SELECTION_MARGIN and margins.rows >= (len(seq) - topk) * 2
        plain = eng.generate(ids.tolist(), max_new_tokens=N_NEW, ignore_eos=True, speculate=False, logprobs=0)
        assert plain.token_ids == seq[N_PROMPT:]
        forwards = _Forwards(monkeypatch)
        monkeypatch.setattr(sluice.generation, "NgramDrafter", _oracle_drafter(seq, N_PROMPT))
        spec = eng.generate(ids.tolist(), max_new_tokens=N_NEW, ignore_eos=True, logprobs=0)
    assert spec.token_ids == plain.token_ids and spec.logprobs == plain.logprobs
    assert 0 < spec.stats["accepted"] < spec.stats["drafted"]
    # drafts verified several rows at a time across index_topk (rows that see topk positions or fewer and
    # rows that select) and past it
    assert any(0 < s < topk < s + r for s, r in forwards.seen), sorted(forwards.seen)
    assert any(s > topk and r > 1 for s, r in forwards.seen), sorted(forwards.seen)
    with sluice.load(path, memory="4GiB", progress=False, prefill_chunk=5) as eng:
        assert torch.equal(eng.forward(seq), logits)


def test_state_is_a_cache_per_position(family_models):
    """Each layer with an indexer keeps its keys beside the latent cache (one per sequence, sized by the
    declaration); rewinding and prefix reuse continue from the cut with the same tokens."""
    path = family_models.hf("deepseek_v32", "f32")
    ids = prompt_ids(20, seed=3)
    with sluice.load(path, memory="4GiB", progress=False) as eng:
        state = eng.model.new_state(64)
        assert all(isinstance(s, IndexedLatentCache) and s.index.keys.shape == (64, 16) for s in state.layers)
        assert sum(layer.attn.cache_bytes(64) for layer in eng.model.layers) == eng.desc.state_bytes_per_token * 64
        first = eng.generate(ids.tolist(), max_new_tokens=12)
        again = eng.generate(ids.tolist() + first.token_ids[:5], max_new_tokens=7, reuse_prefix=True)
    assert again.stats["reused_prefix_tokens"] == len(ids) + 4
    assert again.token_ids == first.token_ids[5:]


def test_fp8_indexer_stays_fp8(family_models):
    """The published layout's FP8 indexer projections (and MLA's) are multiplied as stored, its
    weights_proj plain (transformers never converts it): logits at every position within 1e-4 of
    transformers on the dequantized twin (the suite's FP8 checkpoints: ``families.to_stored``)."""
    from sluice.quant.fp8 import BlockFP8

    ref = reference(family_models.reference_path("deepseek_v32", "fp8"))
    ids = prompt_ids(40, seed=2)
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    with sluice.load(family_models.hf("deepseek_v32", "fp8"), memory="4GiB", progress=False) as eng:
        ix = eng.model.layers[1].attn.indexer
        assert isinstance(ix.wq_b, BlockFP8) and isinstance(ix.wk, BlockFP8)
        assert ix.weights_proj.dtype == torch.float32 and isinstance(eng.model.layers[1].attn.wkv_b, BlockFP8)
        assert (eng.forward(ids) - want).abs().max().item() <= 1e-4
