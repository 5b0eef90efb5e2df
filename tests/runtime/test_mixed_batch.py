"""Mixed sequences in one step (runner.py, ``CausalLM.forward``): a step holding a
prefill of several chunks, a decode token and a token with a speculative draft of three runs
them as one forward per chunk, and each sequence's logits are bit-identical (``torch.equal``)
to its solo run, on every family of the registry (tests/families.py), greedy continuations
included. The expert counters show one read and one compute call per expert of a forward's
union, however many sequences routed to it; an expert whose read fails fails only the
sequences that needed it (the others are re-run, the failed ones rewound to their start).
"""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch

import sluice
from conftest import prompt_ids
from families import FAMILY_NAMES
from sluice.runner import SeqState, SeqWork
from sluice.storage.source import WrappedSource

CHUNK = 4  # the prefill below (10 tokens) runs as chunks of 4, 4, 2
CTX = 64
GREEDY_STEPS = 3


def _engine(path, **kw):
    return sluice.load(path, memory="2G", progress=False, prefill_chunk=CHUNK, prefetch=False, **kw)


def _slot(eng, i: int) -> SeqState:
    return SeqState(eng.model.new_state(CTX), i)


def _prompts():
    pa, pb, pc = prompt_ids(10, seed=3).tolist(), prompt_ids(7, seed=4).tolist(), prompt_ids(6, seed=5).tolist()
    return pa, pb, pc, [11, 12, 13]  # c's draft


def _scenario(eng, together: bool, record: bool = False):
    """Sequence a prefills 10 tokens (3 chunks); b decodes one token after its 7-token context; c
    verifies a token and a draft of 3 after its 6-token context. Then all three decode greedily.
    ``together``: each step holds all three; else each item runs in a step of its own. Returns
    (per-sequence logits, per-sequence generated tokens, the first step's results, and the
    experts resident before it and the counters it moved)."""
    runner = eng.runner
    pa, pb, pc, draft = _prompts()
    a, b, c = (_slot(eng, i) for i in range(3))
    runner.run(b, pb[:-1], 0, last_n=0)
    runner.run(c, pc[:-1], 0, last_n=0)
    items = [SeqWork(a, pa, 0, last_n=3, record_routing=record),
             SeqWork(b, pb[-1:], len(pb) - 1, decoding=True, record_routing=record),
             SeqWork(c, pc[-1:] + draft, len(pc) - 1, last_n=4, decoding=True, record_routing=record)]
    keys, before = set(eng.cache.keys()), runner.counters()
    first = runner.step(items) if together else [runner.step([w])[0] for w in items]
    moved = runner.counters() - before
    logits = [[r.logits] for r in first]
    tokens: list[list[int]] = [[], [], []]
    for _ in range(GREEDY_STEPS):
        nxt = [int(lg[-1][-1].argmax()) for lg in logits]
        work = [SeqWork(s, [t], s.length, decoding=True) for s, t in zip((a, b, c), nxt)]
        rs = runner.step(work) if together else [runner.step([w])[0] for w in work]
        for i, (t, r) in enumerate(zip(nxt, rs)):
            tokens[i].append(t)
            logits[i].append(r.logits)
    return [torch.cat(lg) for lg in logits], tokens, first, (keys, moved)


def _forward_rows(first) -> list[list[tuple[int, slice]]]:
    """The rows each forward of the first step held: forward k has chunk k of each item."""
    lengths = [r.routing[next(iter(r.routing))].shape[0] for r in first]
    n = max((t + CHUNK - 1) // CHUNK for t in lengths)
    return [[(i, slice(k * CHUNK, min(t, (k + 1) * CHUNK))) for i, t in enumerate(lengths) if t > k * CHUNK]
            for k in range(n)]


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_mixed_step_equals_solo_runs_and_reads_each_expert_once(family, family_models):
    with _engine(family_models.hf(family)) as eng:
        want, want_tokens, _, _ = _scenario(eng, together=False)
        got, got_tokens, first, (keys, d) = _scenario(eng, together=True, record=True)
    for i in range(3):
        assert torch.equal(got[i], want[i]), f"sequence {i}: max diff {(got[i] - want[i]).abs().max().item():.3e}"
    assert got_tokens == want_tokens

    # counters of the mixed first step: per forward and MoE layer, one compute call per expert of
    # the union of all its rows; decode lookups for the experts the decoding rows routed to
    union = seq_union = decode = 0
    step_keys: set[tuple[int, int]] = set()
    for rows in _forward_rows(first):
        for layer in first[0].routing:
            own = [set(first[i].routing[layer][sl].reshape(-1).tolist()) for i, sl in rows]
            u = set().union(*own)
            union += len(u)
            seq_union += sum(len(o) for o in own)
            decode += len(set().union(*(o for (i, _), o in zip(rows, own) if i > 0)))
            step_keys |= {(layer, e) for e in u}
    assert d.forwards == 3 and d.tokens_forwarded == 10 + 1 + 4
    assert d.expert_compute_calls == d.expert_union == union
    assert d.expert_seq_union == seq_union > union  # some experts served several sequences at once
    assert d.expert_lookups == decode and d.prefill_lookups == union - decode
    assert d.evictions == 0 and d.prefetch_reads == 0
    assert d.demand_reads == len(step_keys - keys)  # each missing expert read once for the whole step


class FailingExpert(WrappedSource):
    """Reads at ``places`` ((file name, offset): one expert's) fail with EIO; clear the set to heal."""

    def __init__(self, inner, places: set[tuple[str, int]]):
        super().__init__(inner)
        self.places = places

    def read_aligned(self, buf, offset: int) -> int:
        if (Path(self.name).name, offset) in self.places:
            raise OSError(errno.EIO, f"injected I/O error reading at offset {offset}", self.name)
        return self.inner.read_aligned(buf, offset)


# recurrent, KV and sliding-window caches; GPT-OSS's experts share pages in its fused tensors, so
# its container (one aligned record per expert) lets one expert's reads fail alone
@pytest.mark.parametrize("family", ["qwen3_next", "olmoe", "gpt_oss"])
def test_a_failing_expert_read_fails_only_the_sequences_that_routed_to_it(family, family_models):
    path = family_models.container(family) if family == "gpt_oss" else family_models.hf(family)
    with _engine(path) as eng:
        want, _, first, _ = _scenario(eng, together=False, record=True)
    used = [{(layer, e) for layer, r in res.routing.items() for e in r.reshape(-1).tolist()} for res in first]
    # an expert some but not all sequences need
    candidates = sorted(k for k in set().union(*used) if 0 < sum(k in u for u in used) < 3)
    assert candidates, "every expert of the step is needed by all three sequences"
    key = candidates[0]
    doomed = {i for i, u in enumerate(used) if key in u}

    with _engine(path, cache_experts=64) as eng:
        places: set[tuple[str, int]] = set()
        eng.checkpoint.sources.wrap(lambda s: FailingExpert(s, places))

        def reads(k):
            return {(Path(r.file).name, r.offset) for r in eng.experts_source.layout(*k).reads}

        bad = reads(key)
        assert not bad & set().union(*(reads(k) for k in set().union(*used) - {key}))
        runner = eng.runner
        pa, pb, pc, draft = _prompts()
        a, b, c = (_slot(eng, i) for i in range(3))
        runner.run(b, pb[:-1], 0, last_n=0)
        runner.run(c, pc[:-1], 0, last_n=0)
        if key in eng.cache:  # read by the context prefills: drop it, so the step must read it
            eng.cache.discard(eng.cache.lookup(key))
        places |= bad  # from now on the expert cannot be read
        items = [SeqWork(a, pa, 0, last_n=3), SeqWork(b, pb[-1:], len(pb) - 1, decoding=True),
                 SeqWork(c, pc[-1:] + draft, len(pc) - 1, last_n=4, decoding=True)]
        starts = [(s.length, s.tokens) for s in (a, b, c)]
        results = runner.step(items)
        for i, (r, s) in enumerate(zip(results, (a, b, c))):
            if i in doomed:
                assert isinstance(r.error, sluice.ExpertReadError) and r.logits is None
                assert f"layer {key[0]} expert {key[1]}" in str(r.error)
                assert (r.error.layer, r.error.expert) == key
                assert (s.length, s.tokens) == starts[i]  # rewound to where the step found it
            else:
                assert r.error is None
                assert torch.equal(r.logits, want[i][: r.logits.shape[0]])
        # a step of one sequence raises, as it always did, and leaves the state as it was
        i = min(doomed)
        with pytest.raises(sluice.ExpertReadError, match=f"layer {key[0]} expert {key[1]}"):
            runner.step([items[i]])
        assert ((a, b, c)[i].length, (a, b, c)[i].tokens) == starts[i]
        # healed storage: the failed sequences continue from their start as if nothing happened
        places.clear()
        for i in sorted(doomed):
            r = runner.step([items[i]])[0]
            assert torch.equal(r.logits, want[i][: r.logits.shape[0]])
        assert not eng.cache.loading()


def test_spine_streaming_in_a_mixed_step(family_models):
    """Streamed spine layers (a ring of two buffers refilled per layer) serve a mixed step: the
    same bits as the resident spine's solo runs."""
    path = family_models.hf("qwen3_next")
    with _engine(path) as eng:
        want, want_tokens, _, _ = _scenario(eng, together=False)
    with _engine(path, max_resident_layers=0) as eng:
        assert eng.spine is not None and eng.plan.streamed_layers
        got, got_tokens, _, _ = _scenario(eng, together=True)
    for i in range(3):
        assert torch.equal(got[i], want[i])
    assert got_tokens == want_tokens
