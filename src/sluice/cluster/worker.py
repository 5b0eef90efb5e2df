"""An expert worker: one Ray actor holding a share of the experts (the class is plain Python;
``provider.RayExperts`` makes it an actor with ``ray.remote``).

It opens the model itself (``model.open_experts``), sizes its own expert cache from its memory
budget, reads missing experts on its own reader pool and computes, for every expert of a
request, that expert's weighted output on the rows routed to it, with the same functions and in
the same way as ``ExpertProvider.moe`` (one row: ``expert_output`` with the weight as scale;
more: ``expert_forward`` then times the weights). It returns the outputs, the driver folds them.
"""

from __future__ import annotations

import os
import socket
import time
from concurrent.futures import FIRST_COMPLETED, wait

import torch

from .. import kernels
from ..errors import BudgetError
from ..experts.cache import LOADING, READY, ExpertCache, Slot
from ..experts.compute import expert_forward, expert_output
from ..experts.fold import weigh
from ..experts.policy import make_policy
from ..experts.reader import DEMAND, PREFETCH, ReaderPool
from ..sysmem import current_rss, default_budget
from ..units import format_size
from .model import open_experts, signature

_MARGIN = 64 << 20  # allocator slack, Ray's worker runtime


class ExpertWorker:
    def __init__(self, index: int, location: str, opts: dict):
        """``opts``: memory (bytes or None), cache_experts, reader_threads, threads, cache_policy,
        verify_reads, huge_pages, direct_io, ca_bundle, max_rows (rows of the largest request)."""
        self.index = index
        self.threads = opts.get("threads") or os.cpu_count() or 1
        kernels.set_threads(self.threads)
        self.opened = m = open_experts(location, opts.get("direct_io"), opts.get("ca_bundle"))
        self.spec, self.source = m.spec, m.source
        memory = opts.get("memory") or default_budget()
        # a request's rows in and outputs back (and their copies in the object store), plus the
        # activations of one expert's forward on them
        transient = 8 * opts.get("max_rows", 512) * m.spec.hidden * 4 * 4
        slot_bytes = self.source.slot_bytes
        slots = opts.get("cache_experts")
        if slots is None:
            slots = (memory - current_rss() - _MARGIN - transient) // slot_bytes
            slots = min(slots, len(m.moe_layers) * m.n_experts)
        if slots < 1:
            raise BudgetError(f"expert worker {index}: --worker-memory {format_size(memory)} holds no expert "
                              f"({format_size(slot_bytes)} each) beside this process's {format_size(current_rss())}; "
                              "raise --worker-memory")
        self.cache = ExpertCache(int(slots), slot_bytes, make_policy(opts.get("cache_policy", "lfru")),
                                 huge_pages=opts.get("huge_pages", True))
        self.pool = ReaderPool(opts.get("reader_threads", 4), name=f"sluice-worker{index}-read")
        self.verify = opts.get("verify_reads", True)
        self.sig = signature(m.checkpoint)
        self.started = time.time()
        self.stats = dict(calls=0, experts_computed=0, rows_computed=0, lookups=0, hits=0, demand_reads=0,
                          prefetch_reads=0, read_wait_s=0.0, compute_s=0.0)
        self._reported = (0, 0)  # evictions, bytes read: last totals sent to the driver

    # -- what the driver asks ------------------------------------------------------------

    def hello(self) -> dict:
        return {"index": self.index, "signature": self.sig, "slots": self.cache.capacity, "pid": os.getpid(),
                "host": socket.gethostname(), "started": self.started, "threads": self.threads}

    def ping(self, x: torch.Tensor) -> torch.Tensor:
        """Echo (benchmarks: the transport's round trip for a layer's rows, no compute)."""
        return x

    def stats_now(self) -> dict:
        return dict(self.stats, index=self.index, pid=os.getpid(), slots=self.cache.capacity,
                    cached=len(self.cache), evictions=self.cache.evictions,
                    bytes_read=self.opened.checkpoint.stats.bytes_read)

    def prefetch(self, layer: int, experts: list[int]) -> None:
        self.cache.policy.predict(layer, experts)
        for e in experts:
            key = (layer, e)
            if self.cache.lookup(key) is None and self._start((layer, e), speculative=True) is None:
                break

    def compute(self, layer: int, one_row: bool, x: torch.Tensor, items: list, prefetch, decoding: bool,
                torch_threads: int, decode: list[int]):
        """``items``: ascending ``(expert, rows, w)``; ``rows`` index ``x`` (None for one row), ``w``
        the weight (a float for one row, else a tensor [n]). ``decode``: the experts of ``items``
        that count as decode lookups (some decoding row routed to them; the others are prefill
        lookups), as the driver's ``segments`` say; ``decoding``: some row is decoding (the wait and
        compute times count). Returns (outputs in items' order, counter deltas)."""
        if torch.get_num_threads() != torch_threads:
            torch.set_num_threads(torch_threads)  # as the driver ran: the same bits in torch's ops
        st = self.stats
        st["calls"] += 1
        lookups = hits = prefill = demand = pf_used = 0
        wait_s = compute_s = 0.0
        self.cache.policy.begin_layer(layer)
        slots: dict[int, Slot] = {}
        missing: list[int] = []
        decode = set(decode)
        for e, _, _ in items:
            key = (layer, e)
            slot = self.cache.lookup(key)
            if e in decode:
                lookups += 1
                if slot is not None and (slot.state == READY or slot.future.done()):
                    hits += 1
            else:
                prefill += 1
            if slot is None:
                missing.append(e)
                continue
            if slot.speculative:
                slot.speculative = False
                pf_used += 1
            slot.pins += 1
            slots[e] = slot
            self.cache.policy.access(key)
        demand += self._issue(layer, missing, slots)
        if prefetch is not None and not missing:
            self.prefetch(*prefetch)
            prefetch = None
        # experts in any order (whichever is in memory first): the driver folds them in order
        results: dict[int, torch.Tensor] = {}
        pending = list(items)
        try:
            with torch.inference_mode():
                while pending:
                    demand += self._issue(layer, missing, slots)
                    pick = next((i for i, (e, _, _) in enumerate(pending) if e in slots and
                                 (slots[e].state == READY or slots[e].future.done())), None)
                    if pick is None:
                        t0 = time.perf_counter()
                        mine = [slots[e].future for e, _, _ in pending if e in slots]
                        if mine:
                            wait(mine, return_when=FIRST_COMPLETED)
                        else:  # no slot free for the next read: wait for any read in flight
                            self._wait_any()
                        wait_s += time.perf_counter() - t0
                        continue
                    e, rows, w = pending.pop(pick)
                    slot = slots[e]
                    if slot.state == LOADING:
                        self._settle(slot)
                    t1 = time.perf_counter()
                    if one_row:
                        y = expert_output(self.spec, slot.weights, x, w)
                    else:
                        y = weigh(expert_forward(self.spec, slot.weights, x[rows]), w)  # as ExpertProvider.moe
                    compute_s += time.perf_counter() - t1
                    slot.pins -= 1
                    del slots[e]
                    results[e] = y
                    st["experts_computed"] += 1
                    st["rows_computed"] += y.shape[0]
        finally:
            for slot in slots.values():
                slot.pins = max(0, slot.pins - 1)
        outs = [results[e] for e, _, _ in items]
        if prefetch is not None:
            self.prefetch(*prefetch)
        st["lookups"] += lookups
        st["hits"] += hits
        st["demand_reads"] += demand
        st["read_wait_s"] += wait_s
        st["compute_s"] += compute_s
        ev, br = self.cache.evictions, self.opened.checkpoint.stats.bytes_read
        deltas = (lookups, hits, prefill, demand, pf_used, wait_s if decoding else 0.0,
                  compute_s if decoding else 0.0, ev - self._reported[0], br - self._reported[1], self.started)
        self._reported = (ev, br)
        return outs, deltas

    # -- reads -----------------------------------------------------------------------------

    def _read(self, base: int, layer: int, expert: int) -> None:
        self.source.read(layer, expert, self.cache.arena, base, self.verify)

    def _start(self, key: tuple[int, int], speculative: bool) -> Slot | None:
        layout = self.source.layout(*key)
        slot = self.cache.allocate(key, layout, speculative)
        if slot is None:
            self._settle_finished()
            slot = self.cache.allocate(key, layout, speculative)
        if slot is None:
            return None
        slot.speculative = speculative
        slot.future = self.pool.submit(self._read, self.cache.base(slot), key[0], key[1],
                                       priority=PREFETCH if speculative else DEMAND)
        if speculative:
            self.stats["prefetch_reads"] += 1
        return slot

    def _issue(self, layer: int, missing: list[int], slots: dict[int, Slot]) -> int:
        """Start demand reads for ``missing`` (in order) while slots allow; returns how many."""
        n = 0
        while missing:
            slot = self._start((layer, missing[0]), speculative=False)
            if slot is None:
                break
            slot.pins += 1
            slots[missing.pop(0)] = slot
            n += 1
        return n

    def _settle(self, slot: Slot) -> None:
        try:
            slot.future.result()
        except BaseException:
            self.cache.discard(slot)
            raise
        self.cache.ready(slot)

    def _settle_finished(self) -> None:
        for slot in self.cache.loading():
            if slot.pins == 0 and slot.future is not None and slot.future.done():
                try:
                    self._settle(slot)
                except Exception:
                    pass

    def _wait_any(self) -> None:
        loading = [s.future for s in self.cache.loading() if s.future is not None]
        if not loading:
            raise BudgetError(f"expert worker {self.index}: its cache of {self.cache.capacity} slots cannot hold "
                              "the experts one request needs at once; raise --worker-memory")
        wait(loading, return_when=FIRST_COMPLETED)
        self._settle_finished()

    def close(self) -> None:
        self.pool.shutdown()
