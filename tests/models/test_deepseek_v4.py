"""DeepSeek-V4: the published tensor names and config shape, exactness against transformers on
the published layer schedule at the real compression rates (4 and 128) past several entries of
both kinds and past ``index_topk``, the indexer's choices against transformers', chunked prefill
across compression-block boundaries, rewinds and prefix reuse of the compressed state, hash
routing (a pure function of the token ids; hostile tables refused), the clamped experts, and the
state bytes the planner states against the built caches.

(Exactness on every axis runs in the fidelity matrix through the registry entry.)"""

from __future__ import annotations

import json
import re

import pytest
import torch

import sluice
from conftest import prompt_ids
from families import LOGIT_MARGIN, ROUTER_MARGIN, reference, save_family
from sluice.errors import CheckpointError, UnsupportedModelError
from sluice.layers.compressed_attention import CompressedAttention
from sluice.layers.compressor import Compressor, Indexer
from sluice.layers.rotary import Rotary
from sluice.models import get_family

v4 = get_family("deepseek_v4")
N_NEW = 32

# The published DeepSeek-V4-Flash config.json (its architecture keys), without its FP8 / FP4
# quantization (``QUANT``: tests/models/test_deepseek_v4_fp4.py)
HUB_CONFIG = dict(
    architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", attention_bias=False, bos_token_id=0,
    eos_token_id=1, hc_eps=1e-6, hc_mult=4, hc_sinkhorn_iters=20, head_dim=512, hidden_act="silu", hidden_size=4096,
    index_head_dim=128, index_n_heads=64, index_topk=512, max_position_embeddings=1048576, moe_intermediate_size=2048,
    n_routed_experts=256, n_shared_experts=1, norm_topk_prob=True, num_attention_heads=64, num_experts_per_tok=6,
    num_hidden_layers=43, num_hash_layers=3, num_key_value_heads=1, num_nextn_predict_layers=1, o_groups=8,
    o_lora_rank=1024, q_lora_rank=1024, qk_rope_head_dim=64, rms_norm_eps=1e-6,
    rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 65536,
                  "type": "yarn"},
    rope_theta=10000, routed_scaling_factor=1.5, scoring_func="sqrtsoftplus", sliding_window=128, swiglu_limit=10.0,
    tie_word_embeddings=False, topk_method="noaux_tc", vocab_size=129280, compress_rope_theta=160000,
    compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0, 0, 0],
)
QUANT = dict(expert_dtype="fp4", quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3",
                                                      "quant_method": "fp8", "scale_fmt": "ue8m0",
                                                      "weight_block_size": [128, 128]})
# the published schedule scaled down: 2 sliding layers, then CSA and HCA; the first 3 hash-routed;
# the real rates (4 and 128), window 32, index_topk 16: a prompt of 360 passes 3 HCA entries
LONG = dict(layer_types=["sliding_attention", "sliding_attention", "compressed_sparse_attention",
                         "heavily_compressed_attention"], mlp_layer_types=["hash_moe"] * 3 + ["moe"],
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
            sliding_window=32, index_topk=16, swiglu_limit=10.0)
LONG_PROMPT = 360


def test_checkpoint_tensor_names():
    """The published model.safetensors names (layer 0 sliding + hash-routed, 2 CSA, 3 HCA, 42
    CSA + routed), the experts' w1/w3/w2 and the hash tables kept resident."""
    desc = v4.describe(v4.parse_config(HUB_CONFIG))
    sp = desc.spine

    def layer(i):
        return {k[len(f"layers.{i}."):]: v for k, v in sp.items() if k.startswith(f"layers.{i}.")}

    common = {"attn_norm.weight": (4096,), "ffn_norm.weight": (4096,),
              "hc_attn_fn": (24, 16384), "hc_attn_base": (24,), "hc_attn_scale": (3,),
              "hc_ffn_fn": (24, 16384), "hc_ffn_base": (24,), "hc_ffn_scale": (3,),
              "attn.wq_a.weight": (1024, 4096), "attn.q_norm.weight": (1024,), "attn.wq_b.weight": (32768, 1024),
              "attn.wkv.weight": (512, 4096), "attn.kv_norm.weight": (512,), "attn.wo_a.weight": (8192, 4096),
              "attn.wo_b.weight": (4096, 8192), "attn.attn_sink": (64,), "ffn.gate.weight": (256, 4096),
              "ffn.shared_experts.w1.weight": (2048, 4096), "ffn.shared_experts.w3.weight": (2048, 4096),
              "ffn.shared_experts.w2.weight": (4096, 2048)}
    assert layer(0) == {**common, "ffn.gate.tid2eid": (129280, 6)}
    csa = {"attn.compressor.wkv.weight": (1024, 4096), "attn.compressor.wgate.weight": (1024, 4096),
           "attn.compressor.ape": (4, 1024), "attn.compressor.norm.weight": (512,),
           "attn.indexer.compressor.wkv.weight": (256, 4096), "attn.indexer.compressor.wgate.weight": (256, 4096),
           "attn.indexer.compressor.ape": (4, 256), "attn.indexer.compressor.norm.weight": (128,),
           "attn.indexer.wq_b.weight": (8192, 1024), "attn.indexer.weights_proj.weight": (64, 4096)}
    assert layer(2) == {**common, **csa, "ffn.gate.tid2eid": (129280, 6)}
    hca = {"attn.compressor.wkv.weight": (512, 4096), "attn.compressor.wgate.weight": (512, 4096),
           "attn.compressor.ape": (128, 512), "attn.compressor.norm.weight": (512,)}
    assert layer(3) == {**common, **hca, "ffn.gate.bias": (256,)}
    assert layer(42) == {**common, **csa, "ffn.gate.bias": (256,)}
    assert {k: v for k, v in sp.items() if not k.startswith("layers.")} == {
        "embed.weight": (129280, 4096), "norm.weight": (4096,), "head.weight": (129280, 4096),
        "hc_head_fn": (4, 16384), "hc_head_base": (4,), "hc_head_scale": (1,)}
    refs = {role: (r.name, tuple(r.shape)) for role, r in desc.expert_tensors(42, 255).items()}
    assert refs == {"gate": ("layers.42.ffn.experts.255.w1.weight", (2048, 4096)),
                    "up": ("layers.42.ffn.experts.255.w3.weight", (2048, 4096)),
                    "down": ("layers.42.ffn.experts.255.w2.weight", (4096, 2048))}
    assert desc.tables == [f"layers.{i}.ffn.gate.tid2eid" for i in range(3)]
    assert desc.moe_layers == list(range(43)) and desc.top_k == 6 and desc.expert.variant == "clamped_silu"
    assert any("multi-token-prediction" in n for n in desc.notes)
    assert "attn.wo_a.weight" not in " ".join(desc.spine_linears)  # read by row blocks: never int8


def test_other_quantization_is_refused_by_name():
    """The published FP8 / FP4 form is read (test_deepseek_v4_fp4.py); every other one is refused."""
    qc = QUANT["quantization_config"]
    for edit, name in (({"quantization_config": {"quant_method": "mxfp4"}}, "quant_method='mxfp4'"),
                       ({"quantization_config": {**qc, "quant_method": "compressed-tensors"}},
                        "quant_method='compressed-tensors'"),
                       ({"quantization_config": {**qc, "expert_dtype": "fp8"}}, "differs from"),
                       ({"quantization_config": {**qc, "scale_fmt": "float"}}, "scale_fmt='float' with FP4"),
                       ({"quantization_config": {**qc, "modules_to_not_convert": ["lm_head"]}},
                        "modules_to_not_convert")):
        with pytest.raises(UnsupportedModelError, match=re.escape(name)):
            v4.parse_config({**HUB_CONFIG, **QUANT, **edit})


def test_published_config_as_transformers_reads_it():
    from transformers import AutoConfig

    ref = AutoConfig.for_model(**HUB_CONFIG)
    cfg = v4.parse_config(HUB_CONFIG)
    assert cfg.layer_types == ref.layer_types and cfg.mlp_layer_types == ref.mlp_layer_types
    assert cfg.rope_dim == ref.qk_rope_head_dim == 64 and cfg.compress_rates == ref.compress_rates
    assert cfg.rope["compress"]["attention_factor"] == 1.0 and cfg.rope["compress"]["rope_type"] == "yarn"
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    rot = DeepseekV4RotaryEmbedding(ref)
    for label in ("main", "compress"):
        ours = Rotary(cfg.head_dim, cfg.rope[label], cfg.max_position_embeddings)
        assert torch.allclose(ours.inv_freq, getattr(rot, f"{label}_inv_freq"), rtol=1e-6, atol=0)
        assert ours.attention_scaling == getattr(rot, f"{label}_attention_scaling") == 1.0


def test_names_match_what_transformers_saves(family_models):
    """transformers' save_pretrained writes the published names under ``model.`` (and a few of
    its own): every tensor it writes is an alias of a declared spine or expert tensor."""
    from safetensors import safe_open

    path = family_models.hf("deepseek_v4", "f32")
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    cfg = v4.parse_config(json.loads((path / "config.json").read_text()))
    desc = v4.describe(cfg)
    aliases = v4.tensor_aliases(cfg)
    experts = {r.name for layer in desc.moe_layers for e in range(desc.n_experts)
               for r in desc.expert_tensors(layer, e).values()}
    assert saved == {aliases.get(n, n) for n in set(desc.spine) | experts}
    assert "head.weight" in saved and "model.layers.1.ffn.gate.tid2eid" in saved


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    return save_family(tmp_path_factory.mktemp("v4") / "long", "deepseek_v4", **LONG)


def _indexer_picks(ref, ids):
    """transformers' indexer choices [S, k] (-1: none) of each CSA layer over ``ids``."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

    picks, scores, orig = [], [], m.DeepseekV4Indexer.forward
    orig_score = m.DeepseekV4IndexerScorer.forward

    def fwd(self, *a, **k):
        picks.append(orig(self, *a, **k)[0])
        return picks[-1][None]

    def score(self, *a, **k):
        scores.append(orig_score(self, *a, **k)[0])
        return scores[-1][None]

    m.DeepseekV4Indexer.forward, m.DeepseekV4IndexerScorer.forward = fwd, score
    try:
        with torch.no_grad():
            out = ref(ids[None], output_router_logits=True)
    finally:
        m.DeepseekV4Indexer.forward, m.DeepseekV4IndexerScorer.forward = orig, orig_score
    return out, picks, scores


def _assert_decisive(ref, ids, first):
    """Clear top-1 logits from ``first``, clear routing (sqrtsoftplus + bias) and clear indexer
    choices (the topk-th and next visible entries' scores apart) at every position."""
    out, picks, scores = _indexer_picks(ref, ids)
    top = out.logits[0, first:].topk(2, dim=-1).values
    assert (top[:, 0] - top[:, 1]).min().item() > LOGIT_MARGIN
    k = ref.config.num_experts_per_tok
    biases = [layer.mlp.gate.e_score_correction_bias for layer in ref.model.layers if not layer.mlp.is_hash]
    for rl, b in zip(out.router_logits, biases):
        s = (torch.nn.functional.softplus(rl.float()).sqrt() + b).topk(k + 1, dim=-1).values
        assert (s[:, :-1] - s[:, 1:]).min().item() > ROUTER_MARGIN
    m, topk = ref.config.compress_rates["compressed_sparse_attention"], ref.config.index_topk
    for sc in scores:
        for p in range(len(ids)):
            n = (p + 1) // m
            if n > topk:
                v = sc[p, :n].topk(topk + 1).values
                assert (v[-2] - v[-1]).item() > 1e-5, f"indexer near-tie at position {p}"
    return picks


def test_long_context_against_transformers(long_model):
    """f32 within 1e-4 at every position of a 360-token prompt and 32 greedy tokens equal to
    transformers': past the window, 3 HCA entries of 128, 90+ CSA entries of 4 of which the
    indexer keeps 16; the indexer's choices are transformers' at every position."""
    ref = reference(long_model)
    ids = prompt_ids(LONG_PROMPT)
    with torch.no_grad():
        ref_logits = ref(ids[None]).logits[0]
        ref_out = ref.generate(ids[None], max_new_tokens=N_NEW, do_sample=False)[0]
    picks = _assert_decisive(ref, ref_out, LONG_PROMPT - 1)
    from sluice.layers import compressed_attention as ca

    chosen: list = []
    select = Indexer.select

    def record(self, scores, position, m):
        got = select(self, scores, position, m)
        chosen.append((position, got))
        return got

    Indexer.select = record
    try:
        with sluice.load(long_model, memory="4GiB", progress=False) as eng:
            logits = eng.forward(ref_out)
            n_sel = len(chosen)
            assert (logits[:LONG_PROMPT] - ref_logits).abs().max().item() <= 1e-4
            out = eng.generate(ids.tolist(), max_new_tokens=N_NEW, ignore_eos=True, speculate=False)
            assert out.token_ids == ref_out[LONG_PROMPT:].tolist()
    finally:
        Indexer.select = select
    assert ca.CompressedAttention is CompressedAttention
    want = picks[0]
    selecting = 0
    for position, got in chosen[:n_sel]:
        ref_set = sorted(i for i in want[position].tolist() if i >= 0)
        assert got.tolist() == ref_set, f"position {position}: indexer kept {got.tolist()}, transformers {ref_set}"
        selecting += (position + 1) // 4 > 16
    assert selecting > 200  # the indexer really chose (more visible entries than it keeps)


def test_long_context_bf16(tmp_path):
    path = save_family(tmp_path / "bf16", "deepseek_v4", dtype=torch.bfloat16, **LONG)
    ref = reference(path)
    ids = prompt_ids(LONG_PROMPT)
    with torch.no_grad():
        ref_logits = ref(ids[None]).logits[0]
        ref_out = ref.generate(ids[None], max_new_tokens=N_NEW, do_sample=False)[0]
    with sluice.load(path, memory="4GiB", progress=False) as eng:
        diff = (eng.forward(ids) - ref_logits).abs().max().item()
        assert diff <= 1e-4 * max(1.0, ref_logits.abs().max().item())
        assert eng.generate(ids.tolist(), max_new_tokens=N_NEW, ignore_eos=True).token_ids == \
            ref_out[LONG_PROMPT:].tolist()


def test_chunked_prefill_across_blocks_is_bit_identical(long_model):
    """Prefill cut into chunks of 50 and of 7 (every boundary inside some CSA and HCA window),
    and speculative decoding: the bits of one chunk and of plain decoding."""
    ids = prompt_ids(LONG_PROMPT)
    with sluice.load(long_model, memory="4GiB", progress=False) as eng:
        want = eng.forward(ids)
        plain = eng.generate(ids.tolist(), max_new_tokens=12, ignore_eos=True, speculate=False, logprobs=0)
    for chunk in (50, 7):
        with sluice.load(long_model, memory="4GiB", progress=False, prefill_chunk=chunk) as eng:
            assert torch.equal(eng.forward(ids), want), chunk
            spec = eng.generate(ids.tolist(), max_new_tokens=12, ignore_eos=True, logprobs=0)
            assert spec.token_ids == plain.token_ids and spec.logprobs == plain.logprobs


def test_state_rewinds_and_prefix_reuse(family_models):
    """The compressed state returns to any position its rings still hold (a rejected draft, a
    continued prompt), else to 0; a continued conversation reuses the prefix with the bits of a
    fresh run."""
    path = family_models.hf("deepseek_v4", "f32")
    ids = prompt_ids(40).tolist()
    with sluice.load(path, memory="4GiB", progress=False) as eng:
        fresh = eng.generate(ids + [5, 6, 7], max_new_tokens=8, ignore_eos=True, logprobs=0)
    with sluice.load(path, memory="4GiB", progress=False) as eng:
        regen = eng.generate(ids, max_new_tokens=40, ignore_eos=True, logprobs=0)
        # a regeneration after 40 tokens: the rings no longer hold the prompt's end, so from 0
        same = eng.generate(ids, max_new_tokens=40, ignore_eos=True, logprobs=0, reuse_prefix=True)
        assert same.stats["reused_prefix_tokens"] == 0
        assert same.token_ids == regen.token_ids and same.logprobs == regen.logprobs
        eng.generate(ids, max_new_tokens=8, ignore_eos=True)
        again = eng.generate(ids + [5, 6, 7], max_new_tokens=8, ignore_eos=True, logprobs=0, reuse_prefix=True)
        assert again.stats["reused_prefix_tokens"] == len(ids)  # rewound within the rings: nothing recomputed
        assert again.token_ids == fresh.token_ids and again.logprobs == fresh.logprobs
        state = eng.model.new_state(256)
        att = eng.model.layers[1].attn
        assert att.kind == "csa"
        layer = state.layers[1]
        parts = (layer.window, layer.comp.raw, layer.index.raw)
        for ring in parts:
            ring.end, ring.base = 200, 200 - ring.keep  # as after a forward ending at 200
        assert layer.restorable(200 - 12) == 200 - 12  # a rejected draft's worth: within every ring
        # the window is gone once the window's first key is; a compressor ring needs its last 2m
        assert layer.restorable(200 - layer.window.keep) == 0
        assert layer.comp.restorable(200 - layer.comp.raw.keep + 2 * 4 - 1) > 0


def test_hash_routing_is_a_function_of_the_token_ids(family_models):
    """A hash layer's experts are ``tid2eid[token]`` before the model runs, and they are the ones
    the layer routes to (any hidden state)."""
    from safetensors import safe_open

    path = family_models.hf("deepseek_v4", "f32")
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        table = f.get_tensor("model.layers.1.ffn.gate.tid2eid")
    with sluice.load(path, memory="4GiB", progress=False) as eng:
        router = eng.model.layers[1].mlp.router
        assert router.kind == "hash"
        tokens = torch.tensor([3, 200, 3, 17])
        assert torch.equal(router.experts_for(tokens), table[tokens])
        for x in (torch.randn(4, 64), torch.zeros(4, 64)):
            ids, weights = router(x, token_ids=tokens)
            assert sorted(map(sorted, ids.tolist())) == sorted(map(sorted, table[tokens].tolist()))
            assert torch.allclose(weights.sum(-1), torch.full((4,), 1.5))  # renormalised, scaled
        with pytest.raises(ValueError, match="token ids"):
            router(torch.randn(4, 64))


@pytest.mark.parametrize("case", ["duplicate", "out_of_range", "float"])
def test_hostile_hash_tables_refused(family_models, tmp_path, case):
    import shutil

    from safetensors.torch import load_file, save_file

    src = family_models.hf("deepseek_v4", "f32")
    shutil.copytree(src, tmp_path / "m")
    tensors = load_file(str(src / "model.safetensors"))
    name = "model.layers.2.ffn.gate.tid2eid"
    t = tensors[name].clone()
    if case == "duplicate":
        t[7] = t[7, 0]
    elif case == "out_of_range":
        t[7, 1] = 8
    else:
        t = t.float()
    tensors[name] = t
    save_file(tensors, str(tmp_path / "m" / "model.safetensors"), metadata={"format": "pt"})
    ids = [7] + prompt_ids(8).tolist()
    if case == "float":
        with pytest.raises(CheckpointError, match="tid2eid.*lookup table.*F32"):
            sluice.load(tmp_path / "m", memory="4GiB", progress=False)
        return
    with sluice.load(tmp_path / "m", memory="4GiB", progress=False) as eng:
        with pytest.raises(CheckpointError, match=r"layers\.2\.ffn\.gate\.tid2eid: token 7 is routed to experts"):
            eng.forward(torch.tensor(ids))


def test_clamped_experts_reach_their_limit(family_models):
    """The registry config's swiglu_limit (1.5) is reached by the routed and shared experts'
    gate and up pre-activations, so the clamp is proven applied (the matrix is exact)."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

    ref = reference(family_models.hf("deepseek_v4", "f32"))
    seen = []
    orig = m.DeepseekV4Experts._apply_gate

    def gate(self, gate_up):
        seen.append(gate_up.abs().max().item())
        return orig(self, gate_up)

    m.DeepseekV4Experts._apply_gate = gate
    try:
        with torch.no_grad():
            ref(prompt_ids()[None])
    finally:
        m.DeepseekV4Experts._apply_gate = orig
    assert max(seen) > 1.5 * 2


def _real_layers(cfg):
    """The real config's attention layers, built on placeholder weights (their states only)."""
    out = []
    for i, t in enumerate(cfg.layer_types):
        kind, m, d = v4.KIND[t], cfg.rate(i), cfg.head_dim
        one = torch.ones(1)

        def comp(dim, overlap, m=m):
            return Compressor(one, one, one, torch.ones(dim), m=m, dim=dim, overlap=overlap, eps=1e-6)

        c = comp(d, kind == "csa") if kind != "sliding" else None
        ix = Indexer(comp(cfg.index_head_dim, True), one, one, heads=1, dim=cfg.index_head_dim,
                     topk=cfg.index_topk) if kind == "csa" else None
        out.append(CompressedAttention(wq_a=one, q_norm=torch.ones(1), wq_b=one, wkv=one, kv_norm=torch.ones(d),
                                       wo_a=one, wo_b=one, sinks=torch.zeros(1), n_heads=1, head_dim=d,
                                       window=cfg.sliding_window, groups=1, eps=1e-6, kind=kind, compressor=c,
                                       indexer=ix))
    return out


@pytest.mark.parametrize("context,below", [(4096, 3), (32768, 5)])
def test_planner_state_bytes_are_the_built_caches(context, below):
    """DeepSeek-V4-Flash's state per sequence: the planner's figure (``state_bytes``) is the bytes
    of the cache tensors a sequence's slot allocates, far below a full-attention cache."""
    cfg = v4.parse_config(HUB_CONFIG)
    desc = v4.describe(cfg)
    layers = _real_layers(cfg)
    built = sum(a.new_cache(context).tensor_bytes() for a in layers)
    assert built == sum(a.cache_bytes(context) for a in layers) == desc.state_bytes(context)
    full = cfg.num_hidden_layers * 4 * cfg.head_dim * context  # every position's K = V, fp32, every layer
    assert built < full / below  # docs/families.md gives the numbers
