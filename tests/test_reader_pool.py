"""The reader pool's lanes (experts/reader.py): a demand read never waits behind queued prefetches,
and a queued prefetch the running layer needs is promoted to the demand lane. Orders of reads are
recorded as the pool's one thread starts them; a gate holds that thread until everything is queued,
so the order is deterministic."""

from __future__ import annotations

import threading

import torch

import sluice
from sluice.experts.reader import DEMAND, PREFETCH, ReaderPool


def _gated_pool():
    """A one-thread pool whose thread is held by a first task until ``gate`` is set."""
    pool = ReaderPool(1)
    gate, running = threading.Event(), threading.Event()

    def hold():
        running.set()
        assert gate.wait(10)

    pool.submit(hold)
    assert running.wait(10)
    return pool, gate


def test_demands_go_first_and_a_promoted_prefetch_joins_them():
    pool, gate = _gated_pool()
    order: list[str] = []
    futs = {n: pool.submit(order.append, n, priority=PREFETCH) for n in ("p1", "p2", "p3")}
    futs["d1"] = pool.submit(order.append, "d1", priority=DEMAND)
    assert pool.promote(futs["p3"]) and not pool.promote(futs["p3"]) and not pool.promote(futs["d1"])
    futs["p2"].cancel()
    assert pool.queued() == (2, 2)  # d1, p3 | p1, p2 (cancelled, skipped when taken)
    gate.set()
    for f in futs.values():
        f.exception() if not f.cancelled() else None
    assert order == ["d1", "p3", "p1"]  # a FIFO would read p1, p3, d1
    assert not pool.promote(futs["p1"])  # done: nothing to promote
    pool.shutdown()


def test_shutdown_cancels_what_is_queued():
    pool, gate = _gated_pool()
    futs = [pool.submit(int, "1", priority=p) for p in (PREFETCH, DEMAND)]
    threading.Timer(0.05, gate.set).start()
    pool.shutdown()
    assert all(f.cancelled() for f in futs)


def test_moe_promotes_the_prefetch_it_needs(model_dir):
    """The provider: prefetches for a layer are queued behind a busy thread; the layer then runs
    needing one of them (c) and one that was not predicted (d). c is read before d (promoted when
    the layer looked it up, before d's demand read was queued) and the wrong guesses are cancelled
    unread; without the promotion d would go first."""
    eng = sluice.load(model_dir("qwen3_moe"), memory="2GiB", reader_threads=1, prefetch=False, progress=False)
    try:
        prov = eng.experts
        layer = eng.desc.moe_layers[0]
        order: list[int] = []
        read = prov._read
        prov._read = lambda base, lay, e: (order.append(e), read(base, lay, e))[1]
        gate, running = threading.Event(), threading.Event()
        submit = prov.pool.submit

        def submit_and_open(fn, *args, priority=DEMAND):
            fut = submit(fn, *args, priority=priority)
            if priority == DEMAND and fn is not hold:
                gate.set()  # d's demand read is queued: let the thread go
            return fut

        def hold():
            running.set()
            assert gate.wait(10)

        submit(hold)
        assert running.wait(10)
        prov.pool.submit = submit_and_open
        a, b, c, d = 0, 1, 2, 3
        prov.prefetch(layer, [a, b, c])
        x = torch.randn(1, eng.config.hidden_size)
        prov.moe(layer, x, torch.tensor([[c, d]]), torch.tensor([[0.5, 0.5]]))
        assert order == [c, d], order
        assert prov.counters.prefetch_cancelled == 2 and prov.counters.prefetch_used == 1
    finally:
        eng.close()
