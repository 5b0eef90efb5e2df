"""GLM-5.3-Flash (``glm5_next``): the published tensor names of the multimodal wrapper, the pooled
indexer's selections against transformers' own indexer, a long run (prompt plus generation 8 times
``index_topk``) against transformers at every position in f32 and bf16 with its 32 greedy tokens,
chunked prefill and speculative drafts verified across the point where the indexer starts
selecting (the cached pool keys checked against their recomputation after every selection), the
cached pool keys bit for bit through chunks, decoding, a rejected draft across a pool boundary and
a rewound prefix, the unbounded (softplus) forget gate, and the state bytes the planner states
against the built caches.

(Exactness on every axis runs in the fidelity matrix through the registry entry.)"""

from __future__ import annotations

import math

import pytest
import torch

import sluice
from conftest import prompt_ids
from families import REGISTRY, assert_decisive_model, reference, save_family
from sluice.layers.dsa import IndexedLatentCache, SharedLatentCache, SparseMLA
from sluice.layers.gated_delta import KimiDeltaAttention
from sluice.layers.hyper import MeanHead
from sluice.layers.indexer import IndexKeys, PooledIndexer, PooledKeys
from sluice.models import get_family

g5 = get_family("glm5_next")
N_PROMPT, N_NEW = 16, 48
SELECTION_MARGIN = 1e-5  # k-th minus (k+1)-th pool score: far above fp32 rounding of the scores

# transformers' Glm5NextTextConfig defaults (GLM-5.3-Flash's architecture) as a wrapper config.json
TEXT = dict(
    model_type="glm5_next_text", vocab_size=154880, hidden_size=4096, intermediate_size=12288,
    moe_intermediate_size=2048, num_hidden_layers=45, num_attention_heads=64, num_key_value_heads=64,
    n_shared_experts=1, n_routed_experts=288, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
    qk_rope_head_dim=0, v_head_dim=256, qk_nope_head_dim=256, n_group=1, topk_group=1, num_experts_per_tok=8,
    norm_topk_prob=True, hidden_act="silu", max_position_embeddings=1048576, rms_norm_eps=1e-5, index_topk=2048,
    index_head_dim=128, index_n_heads=32, swiglu_limit=10.0, linear_head_dim=128, linear_num_heads=64,
    linear_conv_kernel_dim=4, linear_lower_bound=-5.0, hc_mult=4, hc_eps=1e-6, hc_sinkhorn_iters=20,
    index_kpool=16, index_kpool_always_select_tail=True, tie_word_embeddings=False)
HUB_CONFIG = dict(architectures=["Glm5NextForConditionalGeneration"], model_type="glm5_next", text_config=TEXT,
                  vision_config={"model_type": "glm5_next_vision"}, tie_word_embeddings=False)


def test_checkpoint_tensor_names():
    """The wrapper's names: text under model.language_model. with the original hyper-connection and
    forget-gate names, three separate convs, experts one by one; lm_head at the top; nothing visual."""
    desc = g5.describe(g5.parse_config(HUB_CONFIG))
    sp, p = desc.spine, "model.language_model.layers."
    assert sp["model.language_model.embed_tokens.weight"] == (154880, 4096) and sp["lm_head.weight"] == (154880, 4096)
    assert sp["model.language_model.norm.weight"] == (4096,) and not any("visual" in k for k in sp)
    kda = {k[len(p + "0."):]: v for k, v in sp.items() if k.startswith(p + "0.")}
    assert kda == {
        "input_layernorm.weight": (4096,), "post_attention_layernorm.weight": (4096,),
        "hc_attn_fn": (24, 4 * 4096), "hc_attn_base": (24,), "hc_attn_scale": (3,),
        "hc_ffn_fn": (24, 4 * 4096), "hc_ffn_base": (24,), "hc_ffn_scale": (3,),
        "self_attn.q_proj.weight": (8192, 4096), "self_attn.k_proj.weight": (8192, 4096),
        "self_attn.v_proj.weight": (8192, 4096), "self_attn.q_conv1d.weight": (8192, 1, 4),
        "self_attn.k_conv1d.weight": (8192, 1, 4), "self_attn.v_conv1d.weight": (8192, 1, 4),
        "self_attn.f_a_proj.weight": (128, 4096), "self_attn.f_b_proj.weight": (8192, 128),
        "self_attn.dt_bias": (8192,), "self_attn.A_log": (64,), "self_attn.b_proj.weight": (64, 4096),
        "self_attn.g_a_proj.weight": (128, 4096), "self_attn.g_b_proj.weight": (8192, 128),
        "self_attn.o_norm.weight": (128,), "self_attn.o_proj.weight": (4096, 8192),
        "mlp.gate_proj.weight": (12288, 4096), "mlp.up_proj.weight": (12288, 4096),
        "mlp.down_proj.weight": (4096, 12288)}
    mla = {k[len(p + "3.self_attn."):]: v for k, v in sp.items() if k.startswith(p + "3.self_attn.")}
    assert mla == {
        "q_a_proj.weight": (1536, 4096), "q_a_layernorm.weight": (1536,), "q_b_proj.weight": (64 * 256, 1536),
        "kv_a_proj_with_mqa.weight": (512, 4096), "kv_a_layernorm.weight": (512,),
        "kv_b_proj.weight": (64 * 512, 512), "o_proj.weight": (4096, 64 * 256),
        "indexer.wq_b.weight": (32 * 128, 1536), "indexer.wk.weight": (128, 4096), "indexer.k_norm.weight": (128,),
        "indexer.k_norm.bias": (128,), "indexer.weights_proj.weight": (32, 4096),
        "indexer.index_kpool_compress_ape": (16, 128), "indexer.index_kpool_compress_gate": (128, 4096)}
    moe = {k[len(p + "3.mlp."):]: v for k, v in sp.items() if k.startswith(p + "3.mlp.")}
    assert moe == {"gate.weight": (288, 4096), "gate.e_score_correction_bias": (288,),
                   "shared_experts.gate_proj.weight": (2048, 4096), "shared_experts.up_proj.weight": (2048, 4096),
                   "shared_experts.down_proj.weight": (4096, 2048)}
    assert desc.expert_tensors(3, 287)["gate"].name == p + "3.mlp.experts.287.gate_proj.weight"
    assert desc.expert.variant == "clamped_silu" and desc.expert.limit == 10.0
    # every 4th layer MLA (11 of 45), 3 dense layers: latent 512 + indexer keys 2 x 128 floats per position
    assert desc.moe_layers == list(range(3, 45))
    assert desc.state_bytes_per_token == 11 * 4 * (512 + 2 * 128)
    assert desc.entry_bytes == {16: 11 * 4 * 128}  # and each complete pool's key of 128 floats (cached)


def test_flat_config_is_the_text_config():
    """transformers reads a config without text_config as the text model's (its top-level keys)."""
    flat = {**TEXT, "model_type": "glm5_next"}
    assert g5.parse_config(flat) == g5.parse_config(HUB_CONFIG)


def _hf_indexer(seed: int, topk: int = 12, pool: int = 4):
    from transformers import AutoConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextIndexer

    cfg = AutoConfig.for_model("glm5_next_text", hidden_size=32, q_lora_rank=24, index_topk=topk, index_kpool=pool,
                               index_n_heads=6, index_head_dim=16, num_hidden_layers=1)
    torch.manual_seed(seed)
    ix = Glm5NextTextIndexer(cfg, 0).eval()
    with torch.no_grad():
        for p in ix.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    return ix


def _ours(ix) -> PooledIndexer:
    return PooledIndexer(wq_b=ix.wq_b.weight, wk=ix.wk.weight, weights_proj=ix.weights_proj.weight,
                         k_norm_weight=ix.k_norm.weight.detach(), k_norm_bias=ix.k_norm.bias.detach(),
                         n_heads=ix.n_heads, head_dim=ix.head_dim, topk=ix.index_topk,
                         compress_gate=ix.index_kpool_compress_gate.detach(),
                         ape=ix.index_kpool_compress_ape.detach(), pool=ix.index_kpool)


def _select(ours: PooledIndexer, x, q_resid, chunk: int | None = None) -> list:
    t = x.shape[0]
    keys = ours.keys(x)
    q, w = ours.queries(q_resid, x, None, None)
    step = chunk or t
    out: list = []
    for s in range(0, t, step):
        out += ours.select(q[s : s + step], w[s : s + step], keys[: min(t, s + step)], s)
    return out


def test_indexer_selects_what_transformers_selects():
    """Random weights (no ties): every query attends over the positions transformers' indexer keeps
    (its pools and its incomplete tail pool); a query that sees index_topk / index_kpool pools or fewer
    over everything it sees; the same selections computed in chunks of 5."""
    ix = _hf_indexer(seed=1)
    g = torch.Generator().manual_seed(2)
    x, q_resid = torch.randn(45, 32, generator=g), torch.randn(45, 24, generator=g)
    with torch.no_grad():
        want = ix(x[None], q_resid[None], torch.ones(1, 45, dtype=torch.bool), None)[0]
    ours = _ours(ix)
    got = _select(ours, x, q_resid)
    selecting = 0
    for i, sel in enumerate(got):
        expected = sorted(j for j in want[i].tolist() if j >= 0)
        if sel is None:
            assert expected == list(range(i + 1)), f"query {i}"
        else:
            selecting += 1
            assert sel.tolist() == expected and i not in range(12), f"query {i}"
    assert selecting == 45 - 15  # from position 15 on: 4 complete pools seen, 3 kept
    chunked = _select(ours, x, q_resid, chunk=5)
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(got, chunked))


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a, b))


def test_cached_pool_keys_are_recomputed_bits():
    """``PooledKeys`` caches each complete pool's key once: bit for bit the recomputation from every
    position's keys (and selections equal to the recomputing path) after a prefill in chunks of 7,
    token-by-token decoding, a speculative draft rejected across a pool boundary (the cut pool computed
    again from its new keys) and a prefix rewound then written again; a pool's key does not depend on
    how many pools are computed together."""
    ix = _hf_indexer(seed=1)
    ours = _ours(ix)
    g = torch.Generator().manual_seed(5)
    x, q_resid = torch.randn(45, 32, generator=g), torch.randn(45, 24, generator=g)
    keys = ours.keys(x)
    q, w = ours.queries(q_resid, x, None, None)
    index = ours.new_keys(64)
    assert isinstance(index, PooledKeys) and index.pools.shape == (16, 16) and index.done == 0
    assert ours.keys_bytes(64) == sum(t.numel() * t.element_size() for t in (index.keys, index.pools))

    def run(s: int, e: int, k: torch.Tensor) -> None:
        """Write k's keys for positions s..e-1, select with the cache and by recomputation."""
        index.write(s, k[s:e])
        got = ours.select_cached(q[s:e], w[s:e], index, s)
        assert _same(got, ours.select(q[s:e], w[s:e], k[:e], s)), (s, e)
        if got[-1] is not None:
            assert index.done == e // 4
        assert torch.equal(index.pools[: index.done], ours.pool_keys(k[: 4 * index.done])), (s, e)

    for s in range(0, 30, 7):  # prefill in chunks, selection from position 15 on
        run(s, min(30, s + 7), keys)
    for s in range(30, 38):  # decode
        run(s, s + 1, keys)
    assert index.done == 9
    before = index.pools[8].clone()  # positions 32..35
    draft = keys.clone()
    draft[33:41] = ours.keys(torch.randn(8, 32, generator=g))  # a rejected draft's keys from position 33 on
    run(33, 41, draft)
    assert index.done == 10 and not torch.equal(index.pools[8], before)
    run(33, 34, keys)  # the draft rejected: rewound to 33 and decoded again
    assert index.done == 8
    for s in range(34, 45):
        run(s, s + 1, keys)
    run(20, 45, keys)  # prefix reuse: rewound to 20, the rest prefilled again
    alone = torch.cat([ours.pool_keys(keys[4 * m : 4 * m + 4]) for m in range(11)])
    assert torch.equal(ours.pool_keys(keys[:44]), alone) and torch.equal(index.pools[:11], alone)
    for wrong in (IndexKeys(64, 32), PooledKeys(64, 16, 2)):  # not this indexer's pools: refused
        with pytest.raises(TypeError, match="needs its own PooledKeys"):
            ours.select_cached(q[:20], w[:20], wrong, 0)


class _Margins:
    """The smallest kept-th minus next pool score of every selecting query (patched in), and the
    layer's cached pool keys against their recomputation after every selection (``cached``: calls)."""

    def __init__(self, monkeypatch):
        self.low, self.rows, self.cached = math.inf, 0, 0
        select = PooledIndexer.select

        def checked(ix, q, w, keys, start):
            out = select(ix, q, w, keys, start)
            if isinstance(keys, PooledKeys):
                pools, keys = keys.pools[: keys.done], keys.keys
                assert torch.equal(pools, ix.pool_keys(keys[: pools.shape[0] * ix.pool]))
                self.cached += 1
            for i in range(q.shape[0]):
                n = (start + i + 1) // ix.pool
                if n > ix.pools_kept:
                    v = ix.scores(q[i], w[i], ix.pool_keys(keys[: n * ix.pool])).topk(ix.pools_kept + 1).values
                    self.low = min(self.low, (v[-2] - v[-1]).item())
                    self.rows += 1
            return out

        monkeypatch.setattr(PooledIndexer, "select", checked)


def _oracle_drafter(seq: list[int], prompt: int):
    """Drafts the reference's next 3 tokens then a wrong one once decoding: verified several rows at a time."""

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
def test_long_run_against_transformers(kind, family_models, monkeypatch):
    """Prompt plus generation 64 positions (8x index_topk): logits at every position within the matrix's
    tolerance of transformers' one pass, its greedy tokens, the indexer's kept-th pool score apart from
    the next at every selecting query; prefill in chunks of 5 and speculative drafts verified across
    the point where the indexer starts selecting give the bits of one chunk and of plain decoding."""
    path = family_models.hf("glm5_next", kind)
    ref = reference(path)
    ids = prompt_ids(N_PROMPT, seed=1)
    with torch.no_grad():
        ref_out = ref.generate(ids[None], max_new_tokens=N_NEW, do_sample=False)[0]
        ref_logits = ref(ref_out[None]).logits[0]
    assert_decisive_model(ref, ref_out, N_PROMPT - 1)
    seq = ref_out.tolist()
    margins = _Margins(monkeypatch)
    with sluice.load(path, memory="4GiB", progress=False) as eng:
        attn = eng.model.layers[1].attn
        assert isinstance(attn, SparseMLA) and isinstance(attn.indexer, PooledIndexer)
        topk = attn.indexer.topk
        assert len(seq) >= 8 * topk
        logits = eng.forward(seq)
        tol = 1e-4 * (1 if kind == "f32" else max(1.0, ref_logits.abs().max().item()))
        diff = (logits - ref_logits).abs().max().item()
        assert diff <= tol, f"max |logit diff| {diff:.3e} > {tol:.1e}"
        assert margins.low > SELECTION_MARGIN and margins.rows >= len(seq) - 12 and margins.cached
        plain = eng.generate(ids.tolist(), max_new_tokens=N_NEW, ignore_eos=True, speculate=False, logprobs=0)
        assert plain.token_ids == seq[N_PROMPT:]
        monkeypatch.setattr(sluice.generation, "NgramDrafter", _oracle_drafter(seq, N_PROMPT))
        spec = eng.generate(ids.tolist(), max_new_tokens=N_NEW, ignore_eos=True, logprobs=0)
    assert spec.token_ids == plain.token_ids and spec.logprobs == plain.logprobs
    assert 0 < spec.stats["accepted"] < spec.stats["drafted"]
    with sluice.load(path, memory="4GiB", progress=False, prefill_chunk=5) as eng:
        assert torch.equal(eng.forward(seq), logits)
    assert margins.cached > len(seq)  # the cache checked in every forward since: decoding, drafts, chunks


def test_layers_and_state(family_models):
    """KDA with the bounded gate, MLA with its own pooled indexer, MLA reusing it (no indexer, no keys),
    KDA; the mean head; the state the planner counts is the state the built caches hold."""
    path = family_models.hf("glm5_next", "f32")
    with sluice.load(path, memory="4GiB", progress=False) as eng:
        layers = eng.model.layers
        assert isinstance(layers[0].attn, KimiDeltaAttention) and layers[0].attn.lower_bound == -5.0
        assert layers[1].attn.indexer is not None and layers[2].attn.indexer is None
        assert isinstance(eng.model.head, MeanHead)
        state = eng.model.new_state(64)
        own, shared = state.layers[1], state.layers[2]
        assert isinstance(own, IndexedLatentCache) and isinstance(own.index, PooledKeys)
        assert own.index.keys.shape == (64, 32) and own.index.pools.shape == (64 // 4, 16)
        assert isinstance(shared, SharedLatentCache) and shared.ckv.shape == (64, 32)
        built = sum(t.numel() * t.element_size() for t in (own.ckv, own.index.keys, own.index.pools, shared.ckv))
        assert built == sum(layers[i].attn.cache_bytes(64) for i in (1, 2))
        assert built == eng.desc.state_bytes(64) - eng.desc.state_bytes_fixed  # the KDA layers' is fixed
        assert eng.desc.state_bytes_per_token == 4 * (32 + 2 * 16) + 4 * 32
        assert eng.desc.entry_bytes == {4: 4 * 16}  # one pool key of 16 floats per 4 positions
        assert eng.desc.state_bytes_fixed > 0
        ids = prompt_ids(20, seed=3)
        first = eng.generate(ids.tolist(), max_new_tokens=12)
        again = eng.generate(ids.tolist() + first.token_ids[:5], max_new_tokens=7, reuse_prefix=True)
        ix = layers[1].attn.indexer
        used = [slot.model_state for slot in eng.runner.slots if slot.model_state.length]
        assert used
        for st in used:  # the cached pools are the keys' pools after prefix reuse and decoding
            cached = st.layers[1].index
            assert 0 < cached.done <= st.length // 4
            assert torch.equal(cached.pools[: cached.done], ix.pool_keys(cached.keys[: 4 * cached.done]))
    assert again.stats["reused_prefix_tokens"] > 0 and again.token_ids == first.token_ids[5:]


def test_unbounded_forget_gate_against_transformers(tmp_path):
    """``linear_lower_bound: null``: Kimi's softplus decay, still exact against transformers."""
    path = save_family(tmp_path / "g5", "glm5_next", linear_lower_bound=None)
    assert g5.parse_config(REGISTRY["glm5_next"].config(linear_lower_bound=None).to_dict()).linear_lower_bound is None
    ref = reference(path)
    ids = prompt_ids(24, seed=4)
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    with sluice.load(path, memory="4GiB", progress=False) as eng:
        assert eng.model.layers[0].attn.lower_bound is None
        diff = (eng.forward(ids) - want).abs().max().item()
    assert diff <= 1e-4, diff
