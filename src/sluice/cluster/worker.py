"""An expert worker: one Ray actor holding a share of the experts (the class is plain Python;
``provider.RayExperts`` makes it an actor with ``ray.remote``).

It opens the model itself (``model.open_experts``), plans its expert cache from its memory
budget with the planner a local run uses (``plan.make_plan``), and holds an ``ExpertProvider``
over that cache and its own reader pool: the one process's lookups, reads (priorities,
cancellation of wrong guesses, CRC checks), pins and compute. Per request it calls the
provider's grouping-free entry (``ExpertProvider.run_experts``) on the experts, rows and weights
the driver grouped, and returns each expert's weighted output, computed as ``ExpertProvider.moe``
computes it (one row: ``expert_output`` with the weight as scale; more: ``expert_forward`` then
times the weights); the driver folds them.
"""

from __future__ import annotations

import os
import socket
import time

import torch

from ..kernels.backend import cpu
from ..errors import BudgetError
from ..experts.cache import ExpertCache
from ..experts.policy_spec import make_policy
from ..experts.provider import ExpertProvider
from ..experts.reader import ReaderPool
from ..plan import budget_for, make_plan
from ..sysmem import current_rss, default_budget
from ..units import format_size
from .model import open_experts, signature

# the provider's counters a call's answer carries (what the call added), in this order
_SENT = ("lookups", "hits", "prefill_lookups", "demand_reads", "prefetch_used", "read_wait_s", "compute_s")


def cache_slots(index: int, budget: int, baseline: int, slot_bytes: int, total_experts: int, transient: int,
                cache_experts: int | None) -> int:
    """A worker's expert cache slots, planned by ``plan.make_plan`` as a local run's are: a process
    with no spine and no sequence state, ``transient`` bytes of buffers, and one expert as its floor
    (a worker computes each expert as soon as it is in memory, so one slot runs any request)."""
    try:
        return make_plan(budget=budget, baseline=baseline, spine_global=0, spine_layers={}, stream_buffer=0,
                         state_bytes=0, activations=transient, slot_bytes=slot_bytes, working_set=1,
                         total_experts=total_experts, top_k=1, max_context=0, prefill_chunk=0,
                         cache_experts=cache_experts).cache_slots
    except BudgetError:
        slots = cache_experts or 1
        what = ("holds no expert" if cache_experts is None else
                f"cannot hold a cache of {slots} experts (--cache-experts)")
        raise BudgetError(f"expert worker {index}: --worker-memory {format_size(budget)} {what} "
                          f"({format_size(slot_bytes)} each) beside this process's {format_size(baseline)}: that "
                          f"needs {format_size(budget_for(baseline + transient, slots * slot_bytes))}; raise "
                          "--worker-memory" + ("" if cache_experts is None else " or lower --cache-experts")) from None


class _Items:
    """A request's experts with their rows and weights, as ``fold.Groups`` gives a layer's (what
    ``ExpertProvider.run_experts`` takes): the driver grouped them."""

    __slots__ = ("experts", "_work")

    def __init__(self, items: list):
        self.experts = [e for e, _, _ in items]
        self._work = {e: (rows, w) for e, rows, w in items}

    def work(self, e: int):
        return self._work[e]

    def rows(self, e: int) -> list[int]:
        rows = self._work[e][0]
        return [0] if rows is None else rows.tolist()


class ExpertWorker:
    def __init__(self, index: int, location: str, opts: dict):
        """``opts``: memory (bytes or None), cache_experts, reader_threads, threads, cache_policy,
        verify_reads, huge_pages, direct_io, ca_bundle, allow_unversioned_remote, max_rows (rows of the largest
        request)."""
        self.index = index
        self.threads = opts.get("threads") or os.cpu_count() or 1
        cpu.set_threads(self.threads)
        self.opened = m = open_experts(location, opts.get("direct_io"), opts.get("ca_bundle"),
                                       bool(opts.get("allow_unversioned_remote")))
        self.spec, self.source = m.spec, m.source
        memory = opts.get("memory") or default_budget()
        # a request's rows in and outputs back (and their copies in the object store), plus the
        # activations of one expert's forward on them
        transient = 8 * opts.get("max_rows", 512) * m.spec.hidden * 4 * 4
        slots = cache_slots(index, memory, current_rss(), self.source.slot_bytes, len(m.moe_layers) * m.n_experts,
                            transient, opts.get("cache_experts"))
        cache = ExpertCache(slots, self.source.slot_bytes, make_policy(opts.get("cache_policy", "lfru")),
                            huge_pages=opts.get("huge_pages", True))
        threads = opts.get("reader_threads", 4)
        # the local provider's lookups, reads, pins and compute; the driver groups and folds
        self.experts = ExpertProvider(self.source, cache, m.spec, m.n_experts,
                                      verify_reads=opts.get("verify_reads", True),
                                      pool=ReaderPool(threads, name=f"sluice-worker{index}-read"))
        self.cache = cache
        self.sig = signature(m.checkpoint)
        self.started = time.time()
        self.stats = dict(calls=0, experts_computed=0, rows_computed=0)
        self._reported = (0, 0)  # evictions, bytes read: last totals sent to the driver

    # -- what the driver asks ------------------------------------------------------------

    def hello(self) -> dict:
        return {"index": self.index, "signature": self.sig, "slots": self.cache.capacity, "pid": os.getpid(),
                "host": socket.gethostname(), "started": self.started, "threads": self.threads}

    def ping(self, x: torch.Tensor) -> torch.Tensor:
        """Echo (benchmarks: the transport's round trip for a layer's rows, no compute)."""
        return x

    def stats_now(self) -> dict:
        c = self.experts.counters
        return dict(self.stats, lookups=c.lookups, hits=c.hits, demand_reads=c.demand_reads,
                    prefetch_reads=c.prefetch_reads, read_wait_s=c.read_wait_s, compute_s=c.compute_s,
                    index=self.index, pid=os.getpid(), slots=self.cache.capacity, cached=len(self.cache),
                    evictions=self.cache.evictions, bytes_read=self.opened.checkpoint.stats.bytes_read)

    def prefetch(self, layer: int, experts: list[int]) -> None:
        self.experts.prefetch(layer, experts)

    def step(self, request):
        """One layer's request through the driver's compiled graph (``provider.RayExperts``, every
        worker gets one per layer): None (nothing for this worker), ``("compute", args)`` (the
        arguments of ``compute``: its answer) or ``("prefetch", (layer, experts))`` (None)."""
        if request is None:
            return None
        kind, args = request
        if kind == "compute":
            return self.compute(*args)
        if kind == "prefetch":
            self.prefetch(*args)
            return None
        raise ValueError(f"unknown request kind {kind!r}")

    def compute(self, layer: int, one_row: bool, x: torch.Tensor, items: list, prefetch, decoding: bool,
                torch_threads: int, decode: list[int]):
        """``items``: ascending ``(expert, rows, w)``; ``rows`` index ``x`` (None for one row), ``w``
        the weight (a float for one row, else a tensor [n]). ``decode``: the experts of ``items``
        that count as decode lookups (some decoding row routed to them; the others are prefill
        lookups), as the driver's ``ForwardContext`` says; ``decoding``: some row is decoding (the wait and
        compute times count). ``prefetch``: ``(next layer, experts)`` to read once this layer's
        reads are issued, or None. Returns (outputs in items' order, counter deltas)."""
        if torch.get_num_threads() != torch_threads:
            torch.set_num_threads(torch_threads)  # as the driver ran: the same bits in torch's ops
        p, c = self.experts, self.experts.counters
        before = [getattr(c, k) for k in _SENT]
        if prefetch is not None:
            p.after_reads(layer, lambda: p.prefetch(*prefetch))
        work = _Items(items)
        results: dict[int, torch.Tensor] = {}

        def keep(e: int, rows, y: torch.Tensor) -> None:
            results[e] = y

        with torch.inference_mode():
            # experts in any order (whichever is in memory first): the driver folds them in order
            # timed as decoding always (worker_stats); the driver counts the decoding calls' times
            p.run_experts(layer, x, work, keep, set(decode), out_of_order=True, decoding=True)
        outs = [results[e] for e in work.experts]
        st = self.stats
        st["calls"] += 1
        st["experts_computed"] += len(outs)
        st["rows_computed"] += sum(y.shape[0] for y in outs)
        ev, br = self.cache.evictions, self.opened.checkpoint.stats.bytes_read
        deltas = [getattr(c, k) - b for k, b in zip(_SENT, before)]
        if not decoding:  # read waits and compute time count toward the driver's counters while decoding
            deltas[-2:] = [0.0, 0.0]
        deltas = (*deltas, ev - self._reported[0], br - self._reported[1], self.started)
        self._reported = (ev, br)
        return outs, deltas

    def close(self) -> None:
        self.experts.close()
