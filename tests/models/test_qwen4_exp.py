"""Qwen3.8-Flash-Next (qwen4_exp): the published layout's tensor names, the n-gram hash against
transformers, exactness across EOS-separated segments and the QSA budget (f32 every position,
bf16, greedy tokens, token-by-token decode), and the row store (resident or streamed through a
one-row cache: bit-identical; its counters and the planner's rule).

(Exactness on every axis runs in the fidelity matrix through the registry entry.)"""

from __future__ import annotations

import json

import pytest
import torch

import sluice
from families import N_NEW, PROMPT, REGISTRY, reference
from sluice.layers.ple import NGramHash
from sluice.models import get_family
from sluice.plan import rows_for

q4 = get_family("qwen4_exp")
EOS = REGISTRY["qwen4_exp"].overrides["eos_token_id"]

# transformers' Qwen4ExpTextConfig defaults (configuration_qwen4_exp.py) as the wrapper's text_config,
# with QSA and PLE on (the published checkpoint's keys: indexer_*, ple_layer_ids, ngram tables in pieces)
_TYPES = (["linear_attention"] * 3 + ["full_attention"]) * 10
PUBLISHED = dict(
    architectures=["Qwen4ExpForConditionalGeneration"], model_type="qwen4_exp", tie_word_embeddings=False,
    text_config=dict(
        model_type="qwen4_exp_text", vocab_size=248320, hidden_size=2048, num_hidden_layers=40,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, layer_types=_TYPES, linear_num_key_heads=16,
        linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, num_experts=512,
        num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512, hc_count=4,
        hc_lowrank=320, ple_layer_ids=[1, 2], ngram_size=3, heads_per_ngram=8, ngram_vocab_size_base=20_000_000,
        split_ngram_parts=512, indexer_n_heads=16, indexer_kv_heads=1, indexer_head_dim=128, indexer_budget=2048,
        indexer_compress_ratio=4, eos_token_id=248044, mtp_num_hidden_layers=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                         "mrope_section": [11, 11, 10], "mrope_interleaved": True}),
    vision_config=dict(model_type="qwen4_exp_vision", depth=27, hidden_size=1152, out_hidden_size=2048),
)


def test_checkpoint_tensor_names():
    """A PLE linear-attention layer's and a QSA layer's names under ``model.language_model.`` as
    transformers saves them, the n-gram tables as row tables (not spine), the experts per expert."""
    cfg = q4.parse_config(PUBLISHED)
    desc = q4.describe(cfg)
    aliases = q4.tensor_aliases(cfg)
    stored = {aliases.get(k, k): v for k, v in desc.spine.items()}
    lin, full = "model.language_model.layers.0.", "model.language_model.layers.3."
    hc = {f"{b}_hyper_connection.{n}": s for b in ("attn", "mlp") for n, s in (
        ("hc_norm.weight", (8192,)), ("input_mix_weight_down.weight", (320, 8192)),
        ("input_mix_weight_up.weight", (8192, 320)), ("block_inject_weight.weight", (4, 8192)))}
    moe = {"mlp.gate.weight": (512, 2048), "mlp.shared_expert.gate_proj.weight": (512, 2048),
           "mlp.shared_expert.up_proj.weight": (512, 2048), "mlp.shared_expert.down_proj.weight": (2048, 512),
           "mlp.shared_expert_gate.weight": (1, 2048)}
    ple = {"ple.key_proj.weight": (8192, 2048), "ple.value_proj.weight": (2048, 2048), "ple.norm_key.weight": (8192,),
           "ple.norm_query.weight": (8192,), "ple.norm_conv.weight": (8192,), "ple.conv1d.weight": (8192, 1, 4)}
    assert {k[len(lin):]: v for k, v in stored.items() if k.startswith(lin)} == {
        **hc, **moe, **ple, "linear_attn.in_proj_qkv.weight": (8192, 2048),
        "linear_attn.in_proj_z.weight": (4096, 2048), "linear_attn.in_proj_b.weight": (32, 2048),
        "linear_attn.in_proj_a.weight": (32, 2048), "linear_attn.conv1d.weight": (8192, 1, 4),
        "linear_attn.A_log": (32,), "linear_attn.dt_bias": (32,), "linear_attn.norm.weight": (128,),
        "linear_attn.out_proj.weight": (2048, 4096)}
    assert {k[len(full):]: v for k, v in stored.items() if k.startswith(full)} == {
        **hc, **moe, "self_attn.q_proj.weight": (8192, 2048), "self_attn.k_proj.weight": (512, 2048),
        "self_attn.v_proj.weight": (512, 2048), "self_attn.o_proj.weight": (2048, 4096),
        "self_attn.q_norm.weight": (256,), "self_attn.k_norm.weight": (256,),
        "self_attn.indexer.index_qk_proj.weight": (17 * 128, 2048),
        "self_attn.indexer.q_layernorm.weight": (128,), "self_attn.indexer.k_layernorm.weight": (128,)}
    assert {k: v for k, v in stored.items() if ".layers." not in k} == {
        "model.language_model.embed_tokens.weight": (248320, 2048), "lm_head.weight": (248320, 2048),
        **{f"model.language_model.hyper_connection_mixer.{n}": s for n, s in (
            ("hc_norm.weight", (8192,)), ("input_mix_weight_down.weight", (320, 8192)),
            ("input_mix_weight_up.weight", (8192, 320)))}}
    # 16 heads of primes just above 20M per PLE layer, rounded up to 128 rows; 2048 / 16 = 128 floats a row
    tables = desc.row_tables
    assert list(tables) == [f"model.language_model.layers.{i}.ple.ple_embedding.ngram_embedding" for i in (0, 1)]
    rows0 = tables["model.language_model.layers.0.ple.ple_embedding.ngram_embedding"][0]
    assert tables["model.language_model.layers.0.ple.ple_embedding.ngram_embedding"][1] == 128
    assert 16 * 20_000_000 < rows0 < 16 * 20_001_000 and rows0 % 128 == 0
    assert not any("ngram_embedding" in k for k in stored)
    e = "model.language_model.layers.39.mlp.experts.511."
    assert {r.name for r in desc.expert_tensors(39, 511).values()} == {
        e + "gate_proj.weight", e + "up_proj.weight", e + "down_proj.weight"}
    assert cfg.layer_types[3] == "full_attention" and cfg.indexer == dict(n_heads=16, head_dim=128, budget=2048,
                                                                          ratio=4)
    assert any("multi-token-prediction" in n for n in desc.notes)
    assert any("images or video are refused" in n for n in desc.notes)


def test_names_match_what_transformers_saves(family_models):
    """Every tensor transformers writes is a spine tensor, an expert's, a row-table piece, a hash
    constant (checked at load), or the vision tower's."""
    from safetensors import safe_open

    path = family_models.hf("qwen4_exp", "f32")
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    cfg = q4.parse_config(json.loads((path / "config.json").read_text()))
    desc = q4.describe(cfg)
    aliases = q4.tensor_aliases(cfg)
    experts = {r.name for layer in desc.moe_layers for e in range(desc.n_experts)
               for r in desc.expert_tensors(layer, e).values()}
    pieces = {f"{t}.shard_{i}.weight" for t in desc.row_tables for i in range(12)}
    consts = {f"{t.rsplit('.', 1)[0]}.{b}" for t in desc.row_tables for b in q4.HASH_BUFFERS}
    vision = {n for n in saved if n.startswith("model.visual.")}
    assert vision and saved - vision == {aliases.get(k, k) for k in desc.spine} | experts | pieces | consts


def _transformers_rows(cfg_text, ple_index: int, ids: torch.Tensor) -> torch.Tensor:
    """transformers' table rows of ``ids`` [T]: its n-gram embedding with row r's values all r."""
    from transformers import AutoConfig
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextNGramEmbedding

    config = AutoConfig.for_model("qwen4_exp_text", **{k: v for k, v in cfg_text.items() if k != "model_type"})
    emb = Qwen4ExpTextNGramEmbedding(config, config.ple_embed_dim, 0, ple_index)
    rows, dim = emb.ngram_embedding.weight.shape
    with torch.no_grad():
        emb.ngram_embedding.weight.copy_(torch.arange(rows, dtype=torch.float32)[:, None].expand(rows, dim))
        out = emb(ids[None], None)[0]
    return out[:, ::dim].round().long()


@pytest.mark.parametrize("ple_index", [0, 1])
def test_ngram_rows_equal_transformers(ple_index):
    """The row ids of every head, for a sequence with EOS runs, adjacent EOS and EOS first, equal
    transformers'; computed in two chunks (the second after the first's last tokens) they are the same."""
    text = {**REGISTRY["qwen4_exp"].config().to_dict()["text_config"]}
    ids = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(3))
    ids[[0, 7, 8, 20, 33]] = EOS
    want = _transformers_rows(text, ple_index, ids)
    cfg = q4.parse_config(REGISTRY["qwen4_exp"].config().to_dict())
    h: NGramHash = q4.hasher(cfg, cfg.ple_layers[ple_index])
    eos = [EOS] * (h.ngram - 1)
    assert torch.equal(h.row_ids(eos, ids.tolist()), want)
    for cut in (1, 8, 9, 21):
        first, second = ids[:cut].tolist(), ids[cut:].tolist()
        ctx = (eos + first)[-(h.ngram - 1):]
        assert torch.equal(torch.cat([h.row_ids(eos, first), h.row_ids(ctx, second)]), want)


def _teacher_sequence() -> torch.Tensor:
    """The suite's prompt (4 segments: EOS is its 4th token) and 40 more tokens with EOS at three
    places, adjacent EOS once: 56 positions, 14 QSA blocks of 4 for a budget of 2."""
    more = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(11))
    more[[5, 17, 18]] = EOS
    return torch.cat([PROMPT, more])


@pytest.mark.parametrize("kind", ["f32", "bf16"])
def test_exact_across_segments_and_budget(family_models, kind):
    """Logits at every position of a sequence crossing EOS segments and the QSA budget, within
    1e-4 of transformers (bf16: 1e-4 x max|logit| of the fp32-upcast reference); token-by-token
    and through a one-row cache per table, bit-identical to one chunk."""
    path = family_models.hf("qwen4_exp", kind)
    seq = _teacher_sequence()
    with torch.no_grad():
        want = reference(path)(seq[None]).logits[0]
    tol = 1e-4 if kind == "f32" else 1e-4 * want.abs().max().item()
    with sluice.load(path, memory="2GiB", progress=False) as eng:
        got = eng.forward(seq)
        assert eng.plan.rows_resident
    assert (got - want).abs().max().item() <= tol
    with sluice.load(path, memory="2GiB", progress=False, prefill_chunk=1, row_cache=1) as eng:
        assert not eng.plan.rows_resident and eng.rows.capacity and set(eng.rows.capacity.values()) == {1}
        assert torch.equal(eng.forward(seq), got)


def test_greedy_from_a_new_segment(family_models):
    """A prompt that ends with EOS then two tokens (generation starts in a fresh segment): 32
    greedy tokens equal transformers', plain and speculative, resident and streamed."""
    path = family_models.hf("qwen4_exp", "f32")
    prompt = torch.cat([PROMPT, torch.tensor([EOS, 77, 91])])
    with torch.no_grad():
        out = reference(path).generate(prompt[None], max_new_tokens=N_NEW, do_sample=False)[0]
    want = out[len(prompt):].tolist()
    assert len(want) == N_NEW
    for opts in ({}, {"row_cache": 1}):
        with sluice.load(path, memory="2GiB", progress=False, **opts) as eng:
            assert eng.generate(prompt.tolist(), max_new_tokens=N_NEW, ignore_eos=True, speculate=False).token_ids \
                == want
            assert eng.generate(prompt.tolist(), max_new_tokens=N_NEW, ignore_eos=True).token_ids == want


def test_row_store_counters(family_models):
    """Resident tables read nothing per token; a one-row cache reads most rows again and says so
    in the stats (rows, hit rate, bytes per token beside the experts')."""
    path = family_models.hf("qwen4_exp", "f32")
    ids = PROMPT.tolist()
    with sluice.load(path, memory="2GiB", progress=False) as eng:
        s = eng.generate(ids, max_new_tokens=8, ignore_eos=True, speculate=False).stats
        assert s["row_lookups"] > 0 and s["rows_read"] == 0 and s["row_hit_rate"] == 1.0
        assert s["row_bytes_per_token"] == 0
    with sluice.load(path, memory="2GiB", progress=False, row_cache=1) as eng:
        s = eng.generate(ids, max_new_tokens=8, ignore_eos=True, speculate=False).stats
        a = eng.checkpoint.file(next(iter(eng.rows.tables.values())).pieces[0].file).alignment
        # each row read is the aligned span around its 32 bytes (8 f32): one or two blocks of the source
        assert s["rows_read"] > 0 and a * s["rows_read"] <= s["row_bytes_read"] <= 2 * a * s["rows_read"]
        assert 0 <= s["row_hit_rate"] < 0.5
        tokens = s["prompt_tokens"] + s["generated_tokens"]
        assert s["rows_read_per_token"] == pytest.approx(s["rows_read"] / tokens)
        assert s["row_bytes_per_token"] == pytest.approx(s["row_bytes_read"] / tokens)
        assert "expert_bytes_per_token" in s


def test_next_chunks_rows_read_ahead(family_models):
    """Prefill in chunks with the tables streamed: each chunk's rows are issued while the chunk
    before it runs (``rows_read_ahead``), exactly the rows that chunk then gathers (every read
    issued ahead is used: the same rows read as when each layer reads its own, nothing left in
    flight), and the logits are bit-identical to one chunk."""
    path = family_models.hf("qwen4_exp", "f32")
    seq = _teacher_sequence()
    with sluice.load(path, memory="2GiB", progress=False) as eng:
        want = eng.forward(seq)
    opts = dict(memory="2GiB", progress=False, prefill_chunk=5, row_cache="64MiB")
    with sluice.load(path, **opts) as eng:
        assert not eng.plan.rows_resident
        assert torch.equal(eng.forward(seq), want)
        ahead = eng.rows.stats.ahead
        read = eng.rows.stats.read
        assert ahead > 0 and not eng.rows._pending
    with sluice.load(path, **opts) as eng:
        eng.model.early_rows = False  # each layer reads its rows when it runs
        assert torch.equal(eng.forward(seq), want)
        assert eng.rows.stats.ahead == 0 and eng.rows.stats.read == read
    # a generation's prompt is prefilled one chunk per step (the scheduler's budget): each step
    # is handed its sequence's next chunk, so its rows are read ahead across steps too
    ids = PROMPT.tolist()
    with sluice.load(path, memory="2GiB", progress=False) as eng:
        plain = eng.generate(ids, max_new_tokens=4, ignore_eos=True, speculate=False).token_ids
    with sluice.load(path, **opts) as eng:
        r = eng.generate(ids, max_new_tokens=4, ignore_eos=True, speculate=False)
        assert r.token_ids == plain and r.stats["rows_read_ahead"] > 0 and not eng.rows._pending


def test_rows_issued_ahead_for_a_forward_that_never_comes_are_dropped():
    """A read issued ahead that no gather takes (a step cut short) is cancelled once the forward
    it was for has passed: nothing issued ahead is held for good."""
    from collections import OrderedDict
    from concurrent.futures import Future

    from sluice.rows.store import RowStore
    from sluice.storage.priority import AHEAD, Ticket

    store = RowStore({}, lambda f: None, resident=False)
    fut, ticket = Future(), Ticket(AHEAD)
    store._pending[("t", 3)] = (fut, ticket)  # as issue(..., ahead=True) leaves it
    store._ahead_keys[("t", 3)] = None
    store.begin()  # the forward it was issued for begins: still wanted
    assert ("t", 3) in store._pending and not ticket.cancelled
    store.begin()  # and has passed without gathering it
    assert ("t", 3) not in store._pending and ticket.cancelled and fut.cancelled()
    # one already read by then goes into the table's row cache instead (LRU, its capacity kept)
    store._cache["t"], store.capacity["t"] = OrderedDict([(1, torch.zeros(2))]), 1
    for row in (4, 5):
        done = Future()
        done.set_result(torch.full((2,), float(row)))
        store._pending[("t", row)] = (done, Ticket(AHEAD))
        store._ahead_keys[("t", row)] = None
    store.begin()
    store.begin()
    assert not store._pending and list(store._cache["t"]) == [5]
    store.close()


def test_planner_keeps_small_tables_resident():
    """Resident when the tables fit in a tenth of the budget above the floor; else a row cache of
    that tenth (at least one row per table), or the size asked for."""
    assert rows_for(100, 8, budget=2000, floor=1000) == (True, 100)
    assert rows_for(101, 8, budget=2000, floor=1000) == (False, 100)
    assert rows_for(10_000, 8, budget=1001, floor=1000) == (False, 8)
    assert rows_for(100, 8, budget=2000, floor=1000, cache=1) == (False, 8)
    assert rows_for(100, 8, budget=2000, floor=1000, cache=64) == (False, 64)


def test_inspect_shows_the_row_tables(family_models):
    """``sluice inspect``: the tables' bytes, and per budget whether they are resident or streamed."""
    from sluice.model_report import inspect_model, render_inspect
    from sluice.sysmem import current_rss

    # the plan counts this process's RSS as its baseline: a budget well above it, however large the suite grew
    r = inspect_model(family_models.hf("qwen4_exp", "f32"), memory=current_rss() + (1 << 30))
    assert r["row_table_bytes"] == (416 + 480) * 8 * 4 and len(r["row_tables"]) == 2
    assert r["plan"]["rows_resident"] and r["plan"]["row_bytes"] == r["row_table_bytes"]
    floor = [b for b in r["budgets"] if b["ok"]][0]
    assert not floor["rows_resident"] and floor["row_bytes"] == 2 * 8 * 4  # one row per table at the floor
    text = render_inspect(r)
    assert "row tables        2 token-keyed table(s), 28.00 KiB" in text and "row tables resident" in text
    assert "row cache 64 B" in text


def test_container_pages_are_bit_identical(family_models):
    """The container packs the tables into CRC-checked pages; resident or through a one-row cache,
    its logits are the directory's, bit for bit."""
    seq = _teacher_sequence()
    with sluice.load(family_models.hf("qwen4_exp", "f32"), memory="2GiB", progress=False) as eng:
        want = eng.forward(seq)
    box = family_models.container("qwen4_exp", "f32")
    for opts in ({}, {"row_cache": 1}):
        with sluice.load(box, memory="2GiB", progress=False, **opts) as eng:
            t = next(iter(eng.rows.tables.values()))
            assert t.page_bytes == 4096 and t.rows_per_page == (4096 - 4) // 32
            assert torch.equal(eng.forward(seq), want)
