"""The expert interface: "give me these experts of layer L for these tokens".

``ExpertProvider.moe(layer, x, ids, weights, ctx)`` looks every routed expert up in the cache,
starts reads for the missing ones on the reader pool, computes the experts already in
memory while the reads run, and sums the weighted outputs in ascending expert order, so
results are bit-identical whatever was cached, prefetched or read in which order. The
grouping of rows by expert and the sum are ``fold.Groups`` and ``fold.Fold``, shared with the
Ray driver (``cluster.provider.RayExperts``), so its logits are the same bits; what runs between
them, ``run_experts`` (lookups, reads, pins, compute), is also each Ray worker's entry.

Shape legend: T tokens, H hidden, K experts per token, n_e tokens routed to expert e.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import FIRST_COMPLETED, wait

import torch

from ..errors import ExpertReadError
from ..storage.file import PIECE_BYTES, PIECE_THREADS
from .cache import LOADING, READY, ExpertCache, Slot
from .certain import CertainReads
from .reader import DEMAND, PREFETCH, ReaderPool, Ticket
from .compute import expert_forward, expert_output, expert_outputs
from .counters import ExpertCounters
from .fold import Fold, Groups, weigh
from .interface import ExpertInterface
from .source import ExpertSource
from .spec import ExpertSpec

# Decode-sized batches may compute experts out of order and fold them in order later;
# larger (prefill) batches compute strictly in ascending order to bound held outputs.
_OUT_OF_ORDER_BYTES = 8 << 20
# the policy hears the router's ranking of forwards of at most this many rows (decode, batched
# decodes, speculative verification), not of prefill chunks (Policy.ranked). A grouped router
# (DeepSeek-V3) is ranked by its raw logits, without its correction bias and groups.
SCORE_MAX_ROWS = 64


class ExpertProvider(ExpertInterface):
    def __init__(self, source: ExpertSource, cache: ExpertCache, spec: ExpertSpec, n_experts: int,
                 reader_threads: int = 4, verify_reads: bool = False, *, pool=None, compute=None,
                 total_experts: int | None = None):
        """``pool`` (default: a ``ReaderPool`` of ``reader_threads``) runs the reads: anything with
        ``submit(fn, *args, priority=...) -> Future`` and ``shutdown()``. ``compute`` (default:
        ``compute.expert_output`` and ``expert_forward``) is a pair of functions with their
        signatures. The trace replay (``sluice.replay``) passes reads that complete at once and
        compute that does nothing, so it simulates exactly this cache and this lookup loop.
        ``total_experts``: the model's routed experts (all MoE layers), for ``holds_all``."""
        self.source, self.cache, self.spec, self.n_experts = source, cache, spec, n_experts
        self.pool = pool if pool is not None else ReaderPool(reader_threads)
        self._output, self._forward = compute if compute is not None else (expert_output, expert_forward)
        # one token's experts in one call (the warm fast path), with the default compute only
        self._outputs = expert_outputs if compute is None else None
        self.verify_reads = verify_reads
        self.total_experts = total_experts
        self.counters = ExpertCounters()
        self._predictions: dict[int, list[int]] = {}  # layer -> experts predicted one layer ahead
        self._far: dict[int, list[int]] = {}  # layer -> experts predicted two layers ahead
        self._issued: dict[int, set[int]] = {}  # layer -> experts speculatively read for it
        self._deferred: tuple[int, object] | None = None  # (layer, fn): see ``after_reads``
        # measured at run time for the lookahead's depth (``lookahead_more``): reads submitted and
        # not yet seen done, a read's time on its reader thread and a decode layer's time outside
        # read waits (moving averages, seconds; None until measured)
        self._inflight: list = []
        self._backlog: list[tuple[int, int, int, float]] = []  # (layer, expert, priority, prob) not yet worth a read
        self.read_s: float | None = None
        self.layer_s: float | None = None
        self._last_moe: tuple[int, float, float] | None = None  # (layer, time, read_wait_s) at its entry
        self.certain = CertainReads(self)  # reads of experts the token ids decide (``read_certain``)
        # reads in flight that keep the readers busy, in units of what runs in parallel: a record
        # of two pieces or more is read in 4 MiB pieces by the piece threads (``storage/file.py``),
        # a smaller one by one reader thread
        threads = len(getattr(self.pool, "_threads", ())) or reader_threads
        split = source.slot_bytes >= 2 * PIECE_BYTES
        self._units = -(-source.slot_bytes // PIECE_BYTES) if split else 1  # per read
        self.queue_target = PIECE_THREADS if split else threads

    def holds_all(self) -> bool:
        """Every expert of the model is in the cache and READY (``total_experts`` given): nothing
        can be read or evicted any more (a read is only ever started for a key not in the cache),
        so what only informs reads and the choice of victims is skipped from then on: the
        engine's lookahead, and the policy's events (``begin_layer``, accesses, the router
        ranking). Results never depend on them; the counters count the same lookups and hits."""
        return self.total_experts is not None and self.cache.ready_count >= self.total_experts

    def _wants_logits(self, rows: int) -> bool:
        """The policy ranks the router's view of a forward of ``rows`` rows (``_router_probs``)."""
        return rows <= SCORE_MAX_ROWS and bool(self.cache.policy.ranks) and not self.holds_all()

    def _router_probs(self, layer: int, routed: list[int], logits: torch.Tensor, trace: bool) -> torch.Tensor | None:
        """After ``begin_layer``: the policy hears ``layer``'s experts ranked by router probability
        (the best over the rows; ``Policy.ranked``). Returns the softmax of the router logits
        [T, E] when tracing (``trace``; else None)."""
        ranks = self.cache.policy.ranks
        probs = torch.softmax(logits.float(), dim=-1) if trace or logits.shape[0] > 1 else None
        if ranks and logits.shape[0] <= SCORE_MAX_ROWS:
            n = min(logits.shape[1], math.ceil(ranks * len(routed)))
            best = logits[0] if probs is None else probs.amax(0)  # one row: the logits rank alike
            self.cache.policy.ranked(layer, best.topk(n).indices.tolist(), set(routed))
        return probs if trace else None

    def resident_mask(self, layer: int) -> torch.Tensor:
        """[E] float: 1 for experts of ``layer`` that are in memory (ready or being read), else 0."""
        mask = torch.zeros(self.n_experts)
        for key in self.cache.keys():
            if key[0] == layer:
                mask[key[1]] = 1.0
        return mask

    def close(self) -> None:
        self.pool.shutdown()

    def begin(self, ctx) -> None:
        self.cache.policy.tick()
        self._backlog = []  # guesses of the previous forward
        if self.certain.pins or self.certain.ahead_pins or self.certain.ahead:
            self.certain.begin()

    def read_certain(self, certain: dict[int, torch.Tensor], rows: int, ahead: bool = False) -> None:
        """Read the experts the token ids decide (``experts/certain.py``): this forward's now, at
        demand priority, or (``ahead``) the next forward's as this one leaves each of their layers."""
        self.certain.issue(certain, rows, ahead)

    @property
    def evictions(self) -> int:
        return self.cache.evictions

    # -- reads ---------------------------------------------------------------------------

    def _read(self, base: int, layer: int, expert: int) -> None:
        """Runs on a reader thread: fill the slot at ``base`` with the expert's bytes."""
        t0 = time.perf_counter()
        self.source.read(layer, expert, self.cache.arena, base, self.verify_reads)
        dt = time.perf_counter() - t0  # one float store: no lock needed
        self.read_s = dt if self.read_s is None else 0.8 * self.read_s + 0.2 * dt

    def _start_read(self, key: tuple[int, int], speculative: bool, priority: int = PREFETCH,
                    prob: float | None = None, certain: bool = False) -> Slot | None:
        """Allocate a slot for ``key`` and submit its read: a guess (``speculative``) at ``priority``,
        else at demand priority, or at ``priority`` for a ``certain`` read of a later forward."""
        layout = self.source.layout(*key)
        slot = self.cache.allocate(key, layout, speculative, prob)
        if slot is None:
            self._settle_finished()
            slot = self.cache.allocate(key, layout, speculative, prob)
        if slot is None:
            return None
        slot.speculative = speculative
        slot.ticket = Ticket(priority if speculative or certain else DEMAND)
        slot.future = self.pool.submit(self._read, self.cache.base(slot), key[0], key[1],
                                       priority=slot.ticket.priority, ticket=slot.ticket)
        self._inflight.append(slot.future)  # each counts ``_units``
        if len(self._inflight) > 256:
            self.in_flight()  # drop finished ones (nothing else may ask while the gate is off)
        if speculative:
            self.counters.prefetch_reads += 1
        else:
            self.counters.demand_reads += 1
        return slot

    def _settle(self, slot: Slot) -> None:
        """Turn a finished read into a READY slot, or discard it and raise its error."""
        try:
            slot.future.result()
        except BaseException:
            self.cache.discard(slot)
            raise
        self.cache.ready(slot)  # the one quant.assemble of this read

    def _settle_finished(self) -> None:
        """Settle unpinned reads that have finished, so their slots become evictable."""
        for slot in self.cache.loading():
            if slot.pins == 0 and slot.future is not None and slot.future.done():
                try:
                    self._settle(slot)
                except Exception:
                    pass  # a failed speculative read: nothing cached, nobody waiting

    def prefetch(self, layer: int, experts: list[int], read: bool = True, distance: int = 1,
                 probs: list[float] | None = None) -> None:
        """Start speculative reads for experts predicted for ``layer`` (never evicts pinned ones).

        ``experts`` in the order to read them (the most likely first); ``distance``: how many
        layers ahead the prediction was made (1: the next layer; its reads go before those of
        farther predictions, and it replaces them). ``probs``: each guess's chance of being
        used (``lookahead.weigh_guesses``); with it a guess is read only if it is worth its
        read time (``worth_reading``) and the cache policy's admission gate weighs it against
        the victim's chance of reuse (a guess made further ahead is discounted by how much
        less often such guesses were right, ``far_discount``). The cache
        policy hears of the prediction first (``Policy.predict``); ``read=False`` stops there
        (the prediction informs eviction, nothing is read). When the layer runs, its wrong
        guesses are cancelled: dropped if their read has not started, stopped between pieces
        if it has; right ones still being read are raised to demand priority. Results never
        depend on prefetching.
        """
        experts = list(experts)
        (self._predictions if distance <= 1 else self._far)[layer] = experts
        self.cache.policy.predict(layer, experts)
        if not read:
            return
        priority = PREFETCH + max(0, distance - 1)
        discount = self.far_discount() ** max(0, distance - 1) if probs is not None else 1.0
        issued = self._issued.setdefault(layer, set())
        for i, e in enumerate(experts):
            key = (layer, e)
            slot = self.cache.lookup(key)
            if slot is not None:
                if slot.ticket is not None and slot.speculative:
                    slot.ticket.raise_to(priority)  # a nearer prediction of a read already queued
                continue
            prob = None if probs is None else probs[i] * discount
            if prob is not None and not self.worth_reading(prob, distance):
                # the rest are less likely still: kept until the readers would idle (``_top_up``)
                self._backlog = [b for b in self._backlog if b[0] != layer]
                self._backlog += [(layer, e2, priority, probs[j] * discount) for j, e2 in enumerate(experts)
                                  if j >= i and self.cache.lookup((layer, e2)) is None]
                break
            if self._start_read(key, speculative=True, priority=priority, prob=prob) is None:
                break
            issued.add(e)

    def _top_up(self, layer: int) -> None:
        """While fewer reads are in flight than keep the readers busy, start the guesses that were
        not worth a read when they were made (layers after ``layer`` only; likeliest layer
        first, in their order), so the queue does not run dry between layers."""
        self._backlog = [b for b in self._backlog if b[0] > layer]
        while self._backlog and self.in_flight() < self.queue_target:
            lay, e, priority, prob = self._backlog.pop(0)
            if self.cache.lookup((lay, e)) is not None:
                continue
            if self._start_read((lay, e), speculative=True, priority=priority, prob=prob) is None:
                self._backlog = [b for b in self._backlog if b[0] != lay]  # the gate keeps the rest out too
                continue
            self._issued.setdefault(lay, set()).add(e)

    def worth_reading(self, prob: float, distance: int) -> bool:
        """Whether a guess with chance ``prob`` of being used, for the layer ``distance`` layers
        ahead, is worth a read now. While fewer reads are in flight than reader threads, yes:
        the read uses time the readers would idle. Otherwise the read takes bandwidth the
        coming demand reads need: if wrong it delays them by about one read's time
        (``read_s``); if right it saves the wait that the compute before its layer hides, at
        most ``distance x layer_s`` (both measured). Read it only if the expected saving
        beats the expected delay: ``prob x min(read_s, distance x layer_s) > (1 - prob) x
        read_s``. Before both times are measured: yes."""
        if self.in_flight() < self.queue_target or self.read_s is None or self.layer_s is None:
            return True
        hidden = min(self.read_s, distance * self.layer_s)
        return prob * hidden > (1.0 - prob) * self.read_s

    def far_discount(self) -> float:
        """How much less often a guess one layer further ahead was right: (recall two layers ahead)
        / (recall one layer ahead) over this run's decode, 0.8 until both have 64 checks."""
        c = self.counters
        if c.predicted < 64 or c.predicted_far < 64 or c.predicted_hits == 0:
            return 0.8
        return min(1.0, (c.predicted_far_hits / c.predicted_far) / (c.predicted_hits / c.predicted))

    def in_flight(self) -> int:
        """Reads submitted and not yet finished (demand and prefetch)."""
        self._inflight = [f for f in self._inflight if not f.done()]
        return len(self._inflight) * self._units

    def lookahead_more(self, distance: int, latency: bool = False) -> bool:
        """Predict one layer further than ``distance`` if the readers would otherwise idle (fewer
        reads in flight than reader threads: a layer's demand reads and the next layer's guesses
        are too few, e.g. small quantized records), or, with ``latency``, if a read takes longer
        than the ``distance`` layers of compute left before the predicted layer runs (both
        times measured while decoding: ``read_s``, ``layer_s``)."""
        if self.in_flight() < self.queue_target:
            return True
        return (latency and self.read_s is not None and self.layer_s is not None
                and distance * self.layer_s < self.read_s)

    def _time_layer(self, layer: int, decoding: bool) -> None:
        """Measure a decode layer's time outside read waits, from one MoE call to the next."""
        now, waited = time.perf_counter(), self.counters.read_wait_s
        last, self._last_moe = self._last_moe, (layer, now, waited)
        if last is None or not decoding or layer <= last[0]:
            return
        dt = max(0.0, (now - last[1]) - (waited - last[2])) / (layer - last[0])
        self.layer_s = dt if self.layer_s is None else 0.8 * self.layer_s + 0.2 * dt

    def after_reads(self, layer: int, fn) -> None:
        """Run ``fn()`` inside ``moe(layer, ...)`` once that layer's demand reads are issued (the
        engine's lookahead: guessing later layers must not delay the reads this layer waits
        on). Dropped if the next ``moe`` call is for another layer."""
        self._deferred = (layer, fn)

    def _run_deferred(self, layer: int) -> None:
        deferred, self._deferred = self._deferred, None
        if deferred is not None and deferred[0] == layer:
            deferred[1]()

    def _check_predictions(self, layer: int, used: set[int], decoding: bool) -> None:
        """Count the lookahead's predictions for ``layer`` against ``used`` (the experts its rows
        routed to; counted while ``decoding``), then cancel its speculative reads of experts not used."""
        self._count_predictions(used, self._predictions.pop(layer, None), self._far.pop(layer, None), decoding)
        issued = self._issued.pop(layer, ())
        for e in issued:
            if e in used:
                continue
            slot = self.cache.lookup((layer, e))
            if slot is None or not slot.speculative or slot.state != LOADING:
                continue
            if slot.ticket is not None:
                slot.ticket.cancel()
            if slot.future.cancel():
                self.cache.discard(slot)
                self.counters.prefetch_cancelled += 1
            elif not slot.future.done():
                self.cache.abandon(slot)  # its remaining pieces are skipped; the slot frees when it stops
                self.counters.prefetch_aborted += 1
            else:
                try:  # it finished before the cancel was seen: keep it like any other expert
                    self._settle(slot)
                except Exception:
                    pass

    def drain(self) -> None:
        """Wait for every read in flight and settle it (errors of speculative reads are dropped)."""
        for slot in self.cache.draining():
            if slot.future is not None:
                wait([slot.future])
        for slot in self.cache.loading():
            if slot.future is not None:
                try:
                    self._settle(slot)
                except Exception:
                    pass

    # -- compute -------------------------------------------------------------------------

    def moe(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, ctx,
            logits: torch.Tensor | None = None) -> torch.Tensor:
        """Weighted sum of routed experts. x [T, H] fp32, ids/weights [T, K] -> [T, H].

        The rows may belong to several sequences (``ctx.segments``): each expert of the union is
        read once and computed once on all its rows. A failed read raises its
        ``ExpertReadError`` with ``layer``, ``expert`` and ``rows`` (the rows that needed it)."""
        t = x.shape[0]
        groups = Groups(ids, weights)
        out_of_order = t * x.shape[1] * 4 * len(groups.experts) <= _OUT_OF_ORDER_BYTES
        decode_experts = self._count_union(ids, groups.experts, ctx)
        fold = Fold(x, groups.experts)
        record = ctx.record
        if logits is not None and record is None and not self._wants_logits(t):
            logits = None
        certain = self.certain
        try:
            probs = self.run_experts(layer, x, groups, fold.add, decode_experts, out_of_order, decoding=ctx.decoding,
                                     logits=logits, trace=record is not None, keyed=layer in ctx.certain)
        finally:
            if certain.pins or certain.ahead:
                certain.layer_done(layer)  # its pins go; the next forward's reads of this layer start
        if record is not None:
            record.routing[layer] = (ids, weights, probs)
        return fold.result()

    def run_experts(self, layer: int, x: torch.Tensor, work, sink, decode_experts: set[int],
                    out_of_order: bool = True, *, decoding: bool = False, logits: torch.Tensor | None = None,
                    trace: bool = False, keyed: bool = False) -> torch.Tensor | None:
        """The grouping-free part of ``moe`` (also the Ray worker's entry: its driver groups and folds).

        ``work``: the layer's rows grouped by expert, as ``fold.Groups`` gives them: ``experts``
        (ascending), ``work(e)`` -> ``(rows or None, w)`` and ``rows(e)`` (the rows a failed read's
        error names). Looks each expert up, reads the missing ones, computes each expert's weighted
        output (one row: ``expert_output`` with ``w`` as scale; more: ``expert_forward`` on
        ``x[rows]`` then ``weigh``) and hands it to ``sink(e, rows, y)``: in ascending expert order,
        or, if ``out_of_order``, as the experts come into memory. ``decode_experts``: the experts
        that count as decode lookups (the others count as prefill lookups); ``decoding``: some row
        decodes (read waits and compute time are counted). ``logits``: the rows' router logits
        (the policy's ranking, ``_router_probs``; None: no ranking). Returns the router
        probabilities [T, E] when ``trace`` (else None). ``keyed``: a hash-routed layer (its lookups,
        misses and waits also count as ``hash_*``). When every expert is already READY (warm
        decode), ``_run_ready`` does the same with less bookkeeping."""
        experts = work.experts
        if self._deferred is not None and self._deferred[0] != layer:
            self._deferred = None  # a lookahead left over from a forward that did not reach it
        self._time_layer(layer, decoding)
        if self._predictions or self._far or self._issued:  # else nothing to count or cancel
            self._check_predictions(layer, set(experts), decoding)
        tell = not self.holds_all()  # else the policy picks no victim ever again: it hears nothing more
        if tell:
            self.cache.policy.begin_layer(layer)
        probs = self._router_probs(layer, experts, logits, trace) if logits is not None else None
        keys = [(layer, e) for e in experts]
        ready = self.cache.ready_slots(keys)
        if ready is not None:
            self._run_ready(layer, x, work, sink, decode_experts, keys, ready, tell, decoding, keyed)
            return probs
        c = self.counters

        slots: dict[int, Slot] = {}
        missing: list[int] = []
        for e in experts:
            key = (layer, e)
            slot = self.cache.lookup(key)
            if e in decode_experts:
                c.lookups += 1
                if slot is not None and (slot.state == READY or (slot.future is not None and slot.future.done())):
                    c.hits += 1
                else:
                    c.misses += 1
                    if keyed:
                        c.hash_misses += 1
                if keyed:
                    c.hash_lookups += 1
            else:
                c.prefill_lookups += 1
            if slot is None:
                missing.append(e)
            else:
                if slot.speculative:
                    slot.speculative = False
                    c.prefetch_used += 1
                if slot.ticket is not None:
                    slot.ticket.raise_to(DEMAND)  # a prefetch still being read: now the layer waits on it
                slot.pins += 1
                slots[e] = slot
                self.cache.policy.access(key)

        done: set[int] = set()
        first = 0  # experts[:first] are done
        error: BaseException | None = None
        try:
            while first < len(experts):
                while missing:  # issue reads while slots allow
                    slot = self._start_read((layer, missing[0]), speculative=False)
                    if slot is None:
                        break
                    slot.pins += 1
                    slots[missing.pop(0)] = slot
                if self._deferred is not None:
                    self._run_deferred(layer)  # the lookahead, now that this layer's reads are on their way
                if self._backlog:
                    self._top_up(layer)
                pick = self._pick(experts, first, slots, done, out_of_order)
                if pick is None:
                    self._wait(experts, first, slots, done, out_of_order, missing, decoding, keyed)
                    if self._backlog:
                        self._top_up(layer)  # a read finished: keep the readers busy with guesses
                    continue
                slot = slots[pick]
                if slot.state == LOADING:
                    try:
                        self._settle(slot)
                    except ExpertReadError as err:  # name the rows that needed it: the runner fails only them
                        err.layer, err.expert = layer, pick
                        err.rows = sorted(set(work.rows(pick)))
                        raise
                t0 = time.perf_counter()
                idx, w = work.work(pick)
                if idx is None:
                    y = self._output(self.spec, slot.weights, x, w)
                else:
                    y = weigh(self._forward(self.spec, slot.weights, x[idx]), w)
                c.compute_calls += 1
                if decoding:
                    c.compute_s += time.perf_counter() - t0
                slot.pins -= 1
                done.add(pick)
                while first < len(experts) and experts[first] in done:
                    first += 1
                sink(pick, idx, y)
        except BaseException as e:  # leave the cache consistent, then report
            error = e
        finally:
            for e, slot in slots.items():
                if e not in done and slot.key == (layer, e):
                    slot.pins = max(0, slot.pins - 1)
        if error is not None:
            self._quiesce(slots)
            raise error
        return probs

    def _run_ready(self, layer: int, x: torch.Tensor, work, sink, decode_experts: set[int],
                   keys: list[tuple[int, int]], slots: list[Slot], tell: bool = True, decoding: bool = False,
                   keyed: bool = False) -> None:
        """``run_experts`` when every expert of the layer is READY (warm decode): the same counters,
        policy events (``tell``: the cache does not hold every expert, see ``holds_all``), pins
        and lookahead, and the outputs handed to ``sink`` in ascending expert order (what the
        general loop does when nothing waits on a read: the same bits), without its per-expert
        bookkeeping for reads; one token's experts are computed in one call."""
        c = self.counters
        experts = work.experts
        n = len(experts)
        decode = sum(1 for e in experts if e in decode_experts)
        c.lookups += decode
        c.hits += decode
        if keyed:
            c.hash_lookups += decode
        c.prefill_lookups += n - decode
        access = self.cache.policy.access if tell else None
        for key, slot in zip(keys, slots):
            if slot.speculative:
                slot.speculative = False
                c.prefetch_used += 1
            slot.pins += 1
            if access is not None:
                access(key)
        try:
            if self._deferred is not None:
                self._run_deferred(layer)  # the lookahead (no reads of this layer to issue first)
            if self._outputs is not None and getattr(work, "one_row", False) and not self._backlog:
                t0 = time.perf_counter()
                ys = self._outputs(self.spec, [s.weights for s in slots], x, [work.work(e)[1] for e in experts])
                if decoding:
                    c.compute_s += time.perf_counter() - t0
                c.compute_calls += n
                for e, y in zip(experts, ys):
                    sink(e, None, y)
                return
            output, forward, spec = self._output, self._forward, self.spec
            for e, slot in zip(experts, slots):
                if self._backlog:
                    self._top_up(layer)  # as the general loop does before each expert (the opt-in gate's guesses)
                t0 = time.perf_counter()
                idx, w = work.work(e)
                if idx is None:
                    y = output(spec, slot.weights, x, w)
                else:
                    y = weigh(forward(spec, slot.weights, x[idx]), w)
                c.compute_calls += 1
                if decoding:
                    c.compute_s += time.perf_counter() - t0
                sink(e, idx, y)
        finally:
            for slot in slots:
                slot.pins -= 1

    def _pick(self, experts, next_fold, slots, done, out_of_order) -> int | None:
        if not out_of_order:
            e = experts[next_fold]
            s = slots.get(e)
            return e if s is not None and (s.state == READY or s.future.done()) else None
        for e in experts[next_fold:]:
            if e in done:
                continue
            s = slots.get(e)
            if s is not None and (s.state == READY or s.future.done()):
                return e
        return None

    def _wait(self, experts, next_fold, slots, done, out_of_order, missing, decoding: bool,
              keyed: bool = False) -> None:
        t0 = time.perf_counter()
        mine = [s.future for e, s in slots.items() if e not in done and s.state == LOADING]
        if not out_of_order:
            s = slots.get(experts[next_fold])
            mine = [s.future] if s is not None else []
        if not mine and missing:
            # every slot is pinned or loading: wait for any read in flight (e.g. a prefetch)
            mine = [s.future for s in self.cache.loading() + self.cache.draining() if s.future is not None]
            if not mine:
                raise RuntimeError(
                    f"expert cache of {self.cache.capacity} slots cannot hold the experts one layer needs; "
                    "raise --cache-experts or --memory"
                )
            wait(mine, return_when=FIRST_COMPLETED)
            self._settle_finished()
        elif mine:
            wait(mine, return_when=FIRST_COMPLETED)
        if decoding:
            dt = time.perf_counter() - t0
            self.counters.read_wait_s += dt
            if keyed:
                self.counters.hash_read_wait_s += dt

    def _quiesce(self, slots: dict[int, Slot]) -> None:
        """After an error: let every read in flight finish, keep good ones, drop failed ones."""
        for slot in list(slots.values()) + self.cache.loading():
            if slot.state == LOADING and slot.future is not None:
                try:
                    self._settle(slot)
                except BaseException:
                    pass
