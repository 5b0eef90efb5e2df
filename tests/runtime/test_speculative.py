"""Lossless n-gram speculation: identical greedy tokens, fewer forwards on repetitive text."""

from __future__ import annotations

import pytest

import sluice
from sluice.speculative import NgramDrafter


@pytest.fixture(scope="module")
def engine(text_model):
    return sluice.load(text_model, memory="2GiB", cache_experts=6, progress=False)


PROMPT = "for i in range(10):\n    x = x + i\n"


class OracleDrafter:
    """Drafts from the known greedy continuation, corrupting every ``wrong_every``-th draft token,
    so that acceptance, partial acceptance and rollback all happen deterministically."""

    truth: list[int] = []
    wrong_every = 0

    def __init__(self, tokens, **_):
        self.tokens = list(tokens)
        self.start = len(tokens)
        self.k = 4
        self.n = 0

    def append(self, token):
        self.tokens.append(token)

    def propose(self):
        i = len(self.tokens) - self.start
        draft = list(self.truth[i : i + self.k])
        for j in range(len(draft)):
            self.n += 1
            if self.wrong_every and self.n % self.wrong_every == 0:
                draft[j] = (draft[j] + 1) % 512
        return draft

    def feedback(self, drafted, accepted):
        self.k = 4


@pytest.fixture
def oracle(engine, monkeypatch):
    import sluice.generation as gen

    truth = engine.generate(PROMPT, max_new_tokens=40, ignore_eos=True, speculate=False)
    OracleDrafter.truth = truth.token_ids
    monkeypatch.setattr(gen, "NgramDrafter", OracleDrafter)
    return truth


@pytest.mark.parametrize("wrong_every", [0, 3, 5, 1])
def test_identical_tokens_and_fewer_forwards(engine, oracle, wrong_every):
    OracleDrafter.wrong_every = wrong_every
    spec = engine.generate(PROMPT, max_new_tokens=40, ignore_eos=True)
    assert spec.token_ids == oracle.token_ids
    assert spec.text == oracle.text
    assert spec.stats["drafted"] > 0
    if wrong_every == 0:
        assert spec.stats["accepted"] == spec.stats["drafted"]
        assert spec.stats["tokens_per_forward"] > 3
    elif wrong_every == 1:
        assert spec.stats["accepted"] == 0
    else:
        assert 0 < spec.stats["accepted"] < spec.stats["drafted"]


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13])
def test_length_limit_inside_an_accepted_draft(engine, oracle, n):
    OracleDrafter.wrong_every = 0
    spec = engine.generate(PROMPT, max_new_tokens=n, ignore_eos=True)
    assert spec.token_ids == oracle.token_ids[:n]
    assert spec.finish_reason == "length"


def test_stop_inside_an_accepted_draft(engine, oracle):
    OracleDrafter.wrong_every = 0
    target = oracle.token_ids[7]
    b = engine.generate(PROMPT, max_new_tokens=30, stop_token_ids=[target])
    assert b.token_ids == oracle.token_ids[: oracle.token_ids.index(target) + 1] and b.finish_reason == "stop"
    stop_text = oracle.text[len(oracle.text) // 2 : len(oracle.text) // 2 + 3]
    a = engine.generate(PROMPT, max_new_tokens=40, ignore_eos=True, stop=[stop_text], speculate=False)
    b = engine.generate(PROMPT, max_new_tokens=40, ignore_eos=True, stop=[stop_text])
    want = (oracle.text[: oracle.text.index(stop_text)], "stop")
    assert (a.text, a.finish_reason) == (b.text, b.finish_reason) == want


def test_ngram_drafter_on_repetitive_prompt(engine):
    """The real drafter drafts from the prompt itself; tokens stay identical."""
    p = engine.encode("a = 1\nb = 2\nc = 3\na = 1\nb = 2\nc = 3\na = 1\nb =")
    plain = engine.generate(p, max_new_tokens=24, ignore_eos=True, speculate=False)
    spec = engine.generate(p, max_new_tokens=24, ignore_eos=True)
    assert spec.token_ids == plain.token_ids
    assert spec.stats["drafted"] > 0


def test_sampling_never_speculates(engine):
    r = engine.generate(PROMPT, max_new_tokens=10, ignore_eos=True, temperature=0.8, seed=1)
    assert r.stats["drafted"] == 0


def test_drafter_longest_suffix():
    d = NgramDrafter([1, 2, 3, 4, 9, 2, 3, 5, 7, 2, 3])
    # suffix (2, 3): most recent earlier occurrence is at index 5..6, followed by 5, 7, 2, 3
    assert d.propose() == [5, 7, 2, 3]
    d.append(5)  # suffix (2, 3, 5) occurred once, followed by 7 2 3 5
    assert d.propose()[:2] == [7, 2]
    assert NgramDrafter([1, 2, 3]).propose() == []
    d.feedback(4, 4)
    assert d.k == 6
    d.feedback(6, 1)
    assert d.k == 2
