"""The step generator: streaming text, stop conditions, sampling, cancellation, stats."""

from __future__ import annotations

import json
import threading

import pytest

import sluice
from sluice.layers.sampling import Sampler, SamplingParams
from sluice.text import Detokenizer, StopStrings
from sluice.tokenizer import Tokenizer

STATS_KEYS = {"prefill_tok_s", "decode_tok_s", "hit_rate", "bytes_read", "peak_rss_bytes"}


@pytest.fixture(scope="module")
def engine(text_model):
    return sluice.load(text_model, memory="2GiB", cache_experts=6, progress=False)


def test_stream_text_equals_decode(engine):
    steps = list(engine.stream("def main():\n", max_new_tokens=24, ignore_eos=True))
    ids = [s.token_id for s in steps]
    assert len(ids) == 24
    assert "".join(s.text_delta for s in steps) == engine.tokenizer.decode(ids)
    assert [s.finish_reason for s in steps] == [None] * 23 + ["length"]
    assert STATS_KEYS <= set(steps[-1].stats)
    assert steps[-1].stats["generated_tokens"] == 24
    assert all(not s.stats for s in steps[:-1])


def test_generate_result(engine):
    r = engine.generate("import os\n", max_new_tokens=10, ignore_eos=True)
    assert len(r.token_ids) == 10 and r.finish_reason == "length"
    assert r.text == engine.tokenizer.decode(r.token_ids)
    json.dumps(r.stats)  # the stats are plain JSON values
    assert r.stats["bytes_read"] > 0 and r.stats["peak_rss_bytes"] > 0


def test_stop_string_spanning_tokens(engine):
    full = engine.generate("class A:\n", max_new_tokens=30, ignore_eos=True)
    texts = [engine.tokenizer.decode(full.token_ids[: i + 1]) for i in range(len(full.token_ids))]
    # a stop string that starts inside one token's text and ends inside a later one
    i = next(i for i in range(3, len(texts) - 2) if len(texts[i]) - len(texts[i - 1]) >= 2
             and len(texts[i + 1]) - len(texts[i]) >= 1)
    stop = texts[i + 1][len(texts[i]) - 1 : len(texts[i]) + 1]
    assert stop and stop in full.text
    r = engine.generate("class A:\n", max_new_tokens=30, ignore_eos=True, stop=[stop])
    assert r.finish_reason == "stop"
    assert r.text == full.text[: full.text.index(stop)]
    assert stop not in r.text


def test_eos_stops(text_model, engine):
    first = engine.generate("x = ", max_new_tokens=12, ignore_eos=True).token_ids
    target = first[5]
    r = engine.generate("x = ", max_new_tokens=12, stop_token_ids=[target])
    assert r.token_ids == first[: first.index(target) + 1]
    assert r.finish_reason == "stop"


def test_sampling_seed_reproducible(engine):
    kw = dict(max_new_tokens=16, temperature=1.0, top_p=0.9, top_k=50, ignore_eos=True)
    a = engine.generate("for i in", seed=7, **kw).token_ids
    b = engine.generate("for i in", seed=7, **kw).token_ids
    c = engine.generate("for i in", seed=8, **kw).token_ids
    assert a == b
    assert a != c
    greedy = engine.generate("for i in", max_new_tokens=16, ignore_eos=True).token_ids
    assert engine.generate("for i in", max_new_tokens=16, ignore_eos=True, temperature=0.7, top_k=1,
                           seed=3).token_ids == greedy


def test_logprobs(engine):
    r = engine.generate("return", max_new_tokens=4, ignore_eos=True, logprobs=3)
    assert len(r.logprobs) == 4 and all(lp <= 0 for lp in r.logprobs)
    steps = list(engine.stream("return", max_new_tokens=2, ignore_eos=True, logprobs=3))
    assert steps[0].top_logprobs[0][0] == steps[0].token_id  # greedy picks the most likely
    assert len(steps[0].top_logprobs) == 3


def test_cancel_and_reuse(engine):
    ev = threading.Event()
    got = []
    with pytest.raises(sluice.GenerationCancelled):
        for step in engine.stream("while True:", max_new_tokens=50, ignore_eos=True, cancel=ev):
            got.append(step.token_id)
            if len(got) == 3:
                ev.set()
    assert len(got) == 3
    gen = engine.stream("while True:", max_new_tokens=50, ignore_eos=True)
    next(gen)
    gen.close()  # closing the generator frees the engine
    assert len(engine.generate("while True:", max_new_tokens=5, ignore_eos=True).token_ids) == 5


def test_prefix_reuse_same_tokens(engine):
    base = engine.generate("def f(x):\n    return", max_new_tokens=6, ignore_eos=True)
    again = engine.generate("def f(x):\n    return", max_new_tokens=6, ignore_eos=True, reuse_prefix=True)
    assert again.token_ids == base.token_ids
    assert again.stats["reused_prefix_tokens"] > 0


def test_prompt_too_long(text_model):
    eng = sluice.load(text_model, memory="2GiB", max_context=32, progress=False)
    with pytest.raises(ValueError, match="does not fit the context of 32 tokens"):
        eng.generate(list(range(3, 40)), max_new_tokens=4)
    r = eng.generate(list(range(3, 28)), max_new_tokens=50, ignore_eos=True)
    assert r.finish_reason == "length" and len(r.token_ids) == 32 - 25


def test_bad_token_ids(engine):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.forward([1, 2, 100000])


def test_detokenizer_utf8_safe(text_model):
    tok = Tokenizer(text_model)
    text = "héllo wörld ✓ 日本語 ok"
    ids = tok.encode(text, add_special_tokens=False)
    d = Detokenizer(tok, [])
    parts = [d.push(i) for i in ids] + [d.flush()]
    assert all("\ufffd" not in p for p in parts)
    assert "".join(parts) == text
    assert len(ids) > len(parts) - len([p for p in parts if not p])  # some tokens were held back


def test_stop_strings_hold_back():
    s = StopStrings(["STOP"])
    assert s.feed("abc ST") == ("abc ", False)
    assert s.feed("O") == ("", False)
    assert s.feed("Px") == ("", True)
    s = StopStrings(["xy"])
    assert s.feed("ax") == ("a", False)
    assert s.feed("b") == ("xb", False)
    assert s.flush() == ""


def test_sampler_top_p_top_k():
    import torch

    logits = torch.tensor([5.0, 4.0, 1.0, 0.0])
    probs = Sampler(SamplingParams(temperature=1.0, top_p=0.9)).probs(logits)
    assert probs[2] == 0 and probs[3] == 0 and probs[0] > probs[1] > 0
    probs = Sampler(SamplingParams(temperature=1.0, top_k=1)).probs(logits)
    assert probs.tolist() == [1.0, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
