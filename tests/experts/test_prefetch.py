"""Lookahead prefetch: read tickets (priority down to every piece, raise, cancel), the
cache's abandoned slots, ranking guesses over several rows, and exactness with it all on."""

from __future__ import annotations

import threading
from concurrent.futures import CancelledError, Future

import pytest
import torch

import sluice
from conftest import prompt_ids
from families import FAMILY_NAMES
from sluice.experts.cache import LOADING, READY, ExpertCache
from sluice.experts.layout import ExpertLayout
from sluice.experts.lookahead import rank_guesses
from sluice.experts.policy import LRU
from sluice.experts.policy_spec import make_policy
from sluice.experts.provider import ExpertProvider
from sluice.experts.spec import ExpertSpec
from sluice.layers.context import ForwardContext
from sluice.replay.sim import WeightlessExperts
from sluice.storage import AlignedBuffer, LocalFile
from sluice.storage.file import PIECE_BYTES
from sluice.storage.priority import DEMAND, PREFETCH, PriorityPool, ReadCancelled, Ticket, carrying


def _blocked_pool(threads=1, low_cap=None):
    """A pool whose threads are all held by a task until the returned event is set."""
    pool = PriorityPool(threads, "test-pool", low_cap=low_cap)
    gate, started = threading.Event(), []
    holders = []
    for _ in range(threads):
        ev = threading.Event()
        holders.append(pool.submit(lambda ev=ev: (ev.set(), gate.wait())))
        started.append(ev)
    for ev in started:
        assert ev.wait(10)
    return pool, gate, holders


def test_pool_runs_lowest_priority_first_and_sees_raises():
    pool, gate, _ = _blocked_pool()
    order = []
    a = Ticket(PREFETCH + 1)
    b = Ticket(PREFETCH)
    c = Ticket(PREFETCH + 1)
    fa = pool.submit(order.append, "far", ticket=a)
    fb = pool.submit(order.append, "near", ticket=b)
    fc = pool.submit(order.append, "raised", ticket=c)
    fd = pool.submit(order.append, "demand", ticket=Ticket(DEMAND))
    c.raise_to(DEMAND)  # raised while queued: as urgent as a demand read, and older than it
    gate.set()
    for f in (fa, fb, fc, fd):
        f.result(10)
    assert order == ["raised", "demand", "near", "far"]
    pool.shutdown()


def test_pool_drops_cancelled_tickets_and_runs_under_the_ticket():
    pool, gate, _ = _blocked_pool()
    t = Ticket(PREFETCH)
    f = pool.submit(lambda: 1, ticket=t)
    seen = []
    g = pool.submit(lambda: seen.append(__import__("sluice.storage.priority", fromlist=["current"]).current()),
                    ticket=(u := Ticket(PREFETCH)))
    t.cancelled = True
    gate.set()
    g.result(10)
    assert f.cancelled() and seen == [u]
    pool.shutdown()


def test_pool_low_cap_keeps_threads_for_demand():
    """With one of two threads allowed on guesses, a second guess waits while a demand read
    queued after it runs at once on the other thread."""
    pool = PriorityPool(2, "test-cap", low_cap=1)
    release, running = threading.Event(), threading.Event()
    g1 = pool.submit(lambda: (running.set(), release.wait(10)), ticket=Ticket(PREFETCH))
    assert running.wait(10)
    g2 = pool.submit(lambda: "g2", ticket=Ticket(PREFETCH))
    g4 = pool.submit(lambda: "g4", ticket=(t4 := Ticket(PREFETCH)))
    g3 = pool.submit(lambda: "g3", ticket=(t3 := Ticket(PREFETCH)))
    d = pool.submit(lambda: "d", ticket=Ticket(DEMAND))
    assert d.result(10) == "d"
    assert not g2.done() and not g3.done()  # the one guess thread is busy; both still queued
    t3.raise_to(DEMAND)  # the layer needs g3 now: it runs on the free thread
    assert g3.result(10) == "g3" and not g2.done()
    t4.cancel()  # a wrong guess queued behind the cap: dropped without waiting for it
    with pytest.raises(CancelledError):
        g4.result(10)
    assert not g2.done()
    release.set()
    assert g2.result(10) == "g2" and g1.result(10)
    pool.shutdown()


def test_cancelled_ticket_stops_a_read_in_pieces(tmp_path):
    data = bytes(range(256)) * (3 * PIECE_BYTES // 256)
    path = tmp_path / "blob"
    path.write_bytes(data)
    f = LocalFile(str(path))
    buf = AlignedBuffer(len(data))
    with carrying(Ticket(PREFETCH)):
        assert f.read_aligned(buf.view(0, len(data)), 0) == len(data)
    assert bytes(buf.view(0, len(data))) == data
    before = f.stats.bytes_read
    t = Ticket(PREFETCH)
    t.cancelled = True
    with carrying(t), pytest.raises(ReadCancelled):
        f.read_aligned(buf.view(0, len(data)), 0)
    with carrying(t), pytest.raises(ReadCancelled):
        f.read_aligned(buf.view(0, 4096), 0)  # a small read: not started either
    assert f.stats.bytes_read == before  # nothing was read for it
    f.close()


def test_rank_guesses_union_by_mass():
    ids = torch.tensor([[3, 1], [1, 4], [5, 3]])
    p = torch.tensor([[0.5, 0.1], [0.3, 0.05], [0.2, 0.1]])
    assert rank_guesses(ids, p) == [3, 1, 5, 4]  # 3: 0.6, 1: 0.4, 5: 0.2, 4: 0.05
    assert rank_guesses(ids, p, min_prob=0.15) == [3, 1, 5]  # 4's best row is 0.05
    assert rank_guesses(torch.tensor([[2, 7]]), torch.tensor([[0.25, 0.25]])) == [2, 7]  # ties: lower id




class _HeldPool:
    """Demand reads complete at submit; prefetches wait until the test starts or finishes them."""

    def __init__(self):
        self.held: dict[int, tuple[Future, Ticket]] = {}  # expert -> its prefetch

    def submit(self, fn, *args, priority=DEMAND, ticket=None):
        f = Future()
        if (ticket.priority if ticket else priority) == DEMAND:
            f.set_running_or_notify_cancel()
            f.set_result(fn(*args))
        else:
            self.held[args[2]] = (f, ticket)
        return f

    def shutdown(self):
        pass


def _provider(slots=8):
    cache = ExpertCache(slots, 1, make_policy("lfru"))
    pool = _HeldPool()
    out = ExpertProvider(WeightlessExperts(), cache, ExpertSpec(hidden=1, intermediate=1), 16, pool=pool,
                         compute=(lambda spec, w, x, s: x, lambda spec, w, x: x))
    return out, pool


# a decoding forward's context (one sequence: only ``decoding`` matters to the provider's counters)
DECODE = ForwardContext.single(torch.zeros(1, dtype=torch.long), decoding=True)


def test_wrong_guesses_cancelled_or_stopped_right_ones_raised():
    p, pool = _provider()
    p.prefetch(1, [3, 5, 9])
    assert {e: t.priority for e, (_, t) in pool.held.items()} == {3: PREFETCH, 5: PREFETCH, 9: PREFETCH}
    running = pool.held[3][0]
    running.set_running_or_notify_cancel()  # 3 is being read; 5 and 9 are queued
    f5, t5 = pool.held[5]

    def finish_when_raised():  # a reader that serves 5 once the layer asks for it
        while t5.priority != DEMAND:
            threading.Event().wait(0.001)
        f5.set_running_or_notify_cancel()
        f5.set_result(None)

    th = threading.Thread(target=finish_when_raised)
    th.start()
    p.moe(1, torch.zeros(1, 1), torch.tensor([[5, 7]]), torch.ones(1, 2), DECODE)
    th.join(10)
    c = p.counters
    assert (c.prefetch_reads, c.prefetch_used, c.prefetch_cancelled, c.prefetch_aborted) == (3, 1, 1, 1)
    assert (c.predicted, c.predicted_hits, c.demand_reads) == (2, 1, 1)
    assert pool.held[9][0].cancelled() and pool.held[9][1].cancelled and pool.held[3][1].cancelled
    assert (1, 3) not in p.cache and (1, 9) not in p.cache  # 3 left the cache, its slot still busy
    assert p.cache.lookup((1, 5)).state == READY and p.cache.lookup((1, 7)).state == READY
    assert len(p.cache.draining()) == 1
    # the stopped read ends; once the cache needs its slot it is reused
    running.set_exception(ReadCancelled("stopped"))
    for e in range(10, 16):
        p.moe(2, torch.zeros(1, 1), torch.tensor([[e]]), torch.ones(1, 1), DECODE)
    assert not p.cache.draining() and len(p.cache) == 8


def test_two_layers_ahead_nearer_prediction_raises_priority():
    p, pool = _provider()
    p.prefetch(3, [4, 6], distance=2)
    assert pool.held[4][1].priority == PREFETCH + 1
    p.prefetch(3, [6, 2], distance=1)  # after the next layer's attention: 6 again, and 2
    assert pool.held[6][1].priority == PREFETCH and pool.held[2][1].priority == PREFETCH
    assert pool.held[4][1].priority == PREFETCH + 1
    for f, _ in pool.held.values():
        f.set_running_or_notify_cancel()
        f.set_result(None)
    p.moe(3, torch.zeros(1, 1), torch.tensor([[2, 6]]), torch.ones(1, 2), DECODE)
    c = p.counters
    assert (c.predicted, c.predicted_hits, c.predicted_far, c.predicted_far_hits) == (2, 2, 2, 1)
    assert (3, 4) in p.cache  # a finished wrong guess stays cached like any expert


def test_abandon_frees_slot_after_read_stops():
    cache = ExpertCache(1, 1, LRU())
    lay = ExpertLayout(reads=(), views=(), slot_bytes=1)
    slot = cache.allocate((0, 1), lay, speculative=True)
    slot.future = Future()
    slot.future.set_running_or_notify_cancel()
    cache.abandon(slot)
    assert (0, 1) not in cache and cache.allocate((0, 2), lay) is None  # still being written
    slot.future.set_result(None)
    again = cache.allocate((0, 2), lay)
    assert again is slot and again.state == LOADING and again.key == (0, 2)


def test_multi_row_lookahead_prefetches_and_is_exact(model_dir):
    """Forwards of several rows (a short prefill here, as a batch of sequences' decode rows
    would be) predict the union of their rows' experts; results stay bit-identical."""
    path = model_dir("qwen3_moe")
    ids = prompt_ids(n=12, seed=3)
    off = sluice.load(path, memory="2GiB", cache_experts=10, prefetch=False, progress=False)
    on = sluice.load(path, memory="2GiB", cache_experts=10, prefetch=True, progress=False)
    assert torch.equal(off.forward(ids), on.forward(ids))
    assert on.experts.counters.prefetch_reads > 0 and off.experts.counters.prefetch_reads == 0
    assert on.options.prefetch.depth == 1
    a = off.generate(ids.tolist(), max_new_tokens=8).token_ids
    assert on.generate(ids.tolist(), max_new_tokens=8).token_ids == a
    on.options.prefetch.max_rows = 4  # a 12-token prefill is past the limit now
    before = on.experts.counters.prefetch_reads
    on.forward(ids)
    assert on.experts.counters.prefetch_reads == before
    off.close()
    on.close()


def test_lookahead_runs_after_the_layers_demand_reads():
    """The engine defers its guesses into the layer's MoE call, after that layer's demand
    reads are submitted; a deferral for another layer is dropped."""
    p, pool = _provider()
    order = []
    real = pool.submit

    def submit(fn, *args, priority=DEMAND, ticket=None):
        order.append((args[1], args[2], ticket.priority))
        return real(fn, *args, priority=priority, ticket=ticket)

    pool.submit = submit
    p.after_reads(0, lambda: p.prefetch(1, [4]))
    p.moe(0, torch.zeros(1, 1), torch.tensor([[2, 3]]), torch.ones(1, 2), DECODE)
    assert order == [(0, 2, DEMAND), (0, 3, DEMAND), (1, 4, PREFETCH)]
    p.after_reads(5, lambda: p.prefetch(6, [1]))
    p.moe(2, torch.zeros(1, 1), torch.tensor([[9]]), torch.ones(1, 1), DECODE)  # not layer 5: dropped
    assert (6, 1) not in p.cache and p._deferred is None


# -- the prefetch admission gate and cross-layer lookahead -------------------------------------


def _gate_policy():
    """lfru after 10 ticks of layers 0 and 2: (0, 1) used at every pass, (2, 6) at 9 of layer
    2's 10 passes, (2, 5) once, 9 passes ago. Tick 10 has begun and layer 0 has run."""
    p = make_policy("lfru")
    for t in range(11):
        p.tick()
        p.begin_layer(0)
        if t == 0:
            p.insert((0, 1))
        else:
            p.access((0, 1))
        if t == 10:
            break
        p.begin_layer(2)
        e = 5 if t == 0 else 6
        if t <= 1:
            p.insert((2, e))
        else:
            p.access((2, e))
    return p


def test_gate_weighs_guess_probability_against_victims_reuse():
    p = _gate_policy()
    assert p.reuse((0, 1)) == pytest.approx(1.0)
    assert 0.8 < p.reuse((2, 6)) < 1.0 and p.reuse((2, 5)) < 0.15
    anything = lambda k: True  # noqa: E731
    # (2, 5) is the stale key: a guess likelier than its reuse evicts it, a less likely one does not
    assert p.speculative_victim(anything, prob=0.2) == (2, 5)
    assert p.speculative_victim(anything, prob=0.05) is None
    # without a probability: the fixed rule (hotness of (2, 5) is above 0.25: kept)
    assert p.speculative_victim(anything) is None
    # layer 2 (still to come this tick) is predicted to use 7, not 6: 6, hot but left out of the
    # prediction, is a candidate; only a guess likelier than its reuse evicts it
    p.predict(2, [7])
    not_stale = lambda k: k != (2, 5)  # noqa: E731
    assert p.speculative_victim(not_stale, prob=0.5) is None
    assert p.speculative_victim(not_stale, prob=0.97) == (2, 6)
    assert p.speculative_victim(lambda k: k == (0, 1), prob=0.99) is None  # fresh, its layer not predicted
    p.gate = 0.0  # the gate off: the fixed rule for every guess
    assert p.speculative_victim(anything, prob=0.99) is None


def test_gate_in_the_cache_high_probability_guess_evicts_cold_key_low_one_keeps_hot():
    """Through ``ExpertProvider.prefetch``: a full 3-slot cache; the guess with probability 0.6
    evicts the cold key, the next guesses (0.3 and 0.1 for the predicted layer's hot key's
    place) read nothing."""
    p, pool = _provider(slots=3)
    one = torch.ones(1, 1)
    for t in range(11):
        p.begin(DECODE)
        p.moe(0, torch.zeros(1, 1), torch.tensor([[1]]), one, DECODE)
        if t < 10:
            p.moe(2, torch.zeros(1, 1), torch.tensor([[5 if t == 0 else 6]]), one, DECODE)
    assert set(p.cache.keys()) == {(0, 1), (2, 5), (2, 6)}
    p.prefetch(1, [3, 4], probs=[0.6, 0.3])
    assert (1, 3) in p.cache and (2, 5) not in p.cache  # cold key out for a likely guess
    assert (1, 4) not in p.cache and p.counters.prefetch_reads == 1  # only a protected guess or hot keys left
    p.prefetch(2, [8], probs=[0.1])  # layer 2's own hot expert (6) left out: 0.1 < its reuse
    assert (2, 6) in p.cache and (2, 8) not in p.cache and p.counters.prefetch_reads == 1
    assert p.cache.evictions == 1


def test_lookahead_more_keeps_readers_busy_and_covers_read_latency():
    p, pool = _provider(slots=16)
    assert p.queue_target == 4  # the test pool has no threads of its own: reader_threads
    p.prefetch(1, [1, 2])
    assert p.in_flight() == 2 and p.lookahead_more(1)  # two reads for four readers: look further
    p.prefetch(2, [3, 4, 5])
    assert p.in_flight() == 5 and not p.lookahead_more(1)  # readers busy, no latency measured
    p.read_s, p.layer_s = 0.05, 0.02  # a read outlasts two layers: predict three ahead, not four
    assert not p.lookahead_more(2)  # only with the latency rule (PrefetchOptions.latency)
    assert p.lookahead_more(2, latency=True) and not p.lookahead_more(3, latency=True)
    for f, _ in pool.held.values():
        f.set_running_or_notify_cancel()
        f.set_result(None)
    assert p.in_flight() == 0


def test_weigh_guesses_probability_of_any_row():
    from sluice.experts.lookahead import weigh_guesses

    ids = torch.tensor([[3, 1], [1, 4]])
    probs = torch.tensor([[0.5, 0.2], [0.5, 0.1]])
    order, p = weigh_guesses(ids, probs)
    assert order == [1, 3, 4]
    assert p == pytest.approx([1 - 0.8 * 0.5, 0.5, 0.1])


def test_two_ahead_reads_start_before_the_layers_router(family_models):
    """With two layers ahead, layer L's guesses are issued inside layer L-2's MoE call (after its
    demand reads), before layer L-1 runs: before L's router has its input."""
    path = family_models.hf("mixtral")  # three MoE layers
    eng = sluice.load(path, memory="2GiB", cache_experts=12, prefetch=sluice.PrefetchOptions(depth=2), progress=False)
    events = []
    real_moe, real_prefetch = eng.experts.moe, eng.experts.prefetch

    def moe(layer, *a, **kw):
        events.append(("moe", layer))
        return real_moe(layer, *a, **kw)

    def prefetch(layer, experts, read=True, distance=1, probs=None):
        events.append(("prefetch", layer, distance, len(experts), eng.experts.counters.prefetch_reads))
        return real_prefetch(layer, experts, read=read, distance=distance, probs=probs)

    eng.experts.moe, eng.experts.prefetch = moe, prefetch
    eng.forward(prompt_ids(n=1, seed=4))
    assert events[:2] == [("moe", 0), ("prefetch", 1, 1, 2, 0)]
    far = events.index(next(e for e in events if e[0] == "prefetch" and e[1] == 2 and e[2] == 2))
    assert far < events.index(("moe", 1)) and events[far][3] == 2
    assert eng.experts.counters.prefetch_reads >= 4  # layer 1's and layer 2's guesses were read
    eng.close()


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_gate_and_two_ahead_leave_logits_bit_identical(family_models, family):
    """Every family: prefetch with the gate and two layers ahead (and the gate off) at a cache of
    about one token's working set gives the same logits and tokens as no prefetch. (Without
    certain reads: with them, DeepSeek-V4's hash layers are read from the token ids, and at this
    cache the few guesses left for its router layers are all in memory already.)"""
    path = family_models.hf(family)
    ids = prompt_ids(n=10, seed=5)
    off = sluice.load(path, memory="2GiB", prefetch=False, progress=False)
    ref = off.forward(ids)
    want = off.generate(ids.tolist(), max_new_tokens=6, ignore_eos=True).token_ids
    d = off.desc
    slots = max(d.top_k * len(d.moe_layers), d.n_experts) + d.top_k
    off.close()
    for gate in (True, False):
        on = sluice.load(path, memory="2GiB", cache_experts=slots, prefetch=sluice.PrefetchOptions(depth=2, gate=gate),
                         certain_reads=False, progress=False)
        assert torch.equal(on.forward(ids), ref)
        assert on.generate(ids.tolist(), max_new_tokens=6, ignore_eos=True).token_ids == want
        assert on.experts.counters.prefetch_reads > 0
        on.close()


def test_busy_readers_read_only_guesses_worth_their_read_time():
    """With every reader busy, a guess is read only if prob x the wait it can hide beats
    (1 - prob) x the read time it takes from demand reads; with idle readers, any guess."""
    p, pool = _provider(slots=16)
    p.read_s, p.layer_s = 0.04, 0.01  # a read takes four layers of compute
    p.prefetch(1, [1, 2, 3, 4], probs=[0.3, 0.3, 0.3, 0.3])  # readers idle: all four are read
    assert p.counters.prefetch_reads == 4 and p.in_flight() == 4
    assert not p.worth_reading(0.75, 1)  # 0.75 x 0.01 < 0.25 x 0.04
    assert p.worth_reading(0.85, 1)  # 0.85 x 0.01 > 0.15 x 0.04
    assert p.worth_reading(0.6, 4) and not p.worth_reading(0.45, 4)  # four layers ahead hides the whole read
    p.prefetch(2, [5, 6], probs=[0.9, 0.5])
    assert (2, 5) in p.cache and (2, 6) not in p.cache and p.counters.prefetch_reads == 5
    # 6 waits in the backlog until the readers would idle: two reads finish, it starts
    for e in (1, 2):
        f, _ = pool.held[e]
        f.set_running_or_notify_cancel()
        f.set_result(None)
    p._top_up(1)
    assert (2, 6) in p.cache and p.counters.prefetch_reads == 6 and 6 in p._issued[2]
    p.prefetch(3, [7], probs=[0.5])  # busy again: backlogged; a new forward drops it
    assert p._backlog and (3, 7) not in p.cache
    p.begin(DECODE)
    p._top_up(0)
    assert (3, 7) not in p.cache

def test_finished_reads_are_not_kept():
    """The reads-in-flight list is pruned as reads are submitted, whether or not the gate asks."""
    p, pool = _provider(slots=4)
    for t in range(300):
        p.begin(DECODE)
        # demand reads finish at once
        p.moe(t % 8, torch.zeros(1, 1), torch.tensor([[t % 16]]), torch.ones(1, 1), DECODE)
    assert len(p._inflight) <= 257 and p.in_flight() == 0
