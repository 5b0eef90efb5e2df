"""The scheduler: many generations at once, each step one ``ModelRunner.step`` for all of them.

It owns the sequences (waiting, prefilling, decoding, then finished, cancelled or failed) and
the runner's N state slots (``--parallel``). Each generation is the coroutine
``generation.sequence``: it yields the ``SeqWork`` of its next forward and is sent the
``SeqResult``, so the per-sequence logic (prefix reuse, snapshots, speculation, sampling, stop
strings, stats) is the one a generation alone runs, token for token. One thread (started on
the first generation) runs the loop:

1. admit waiting sequences into idle slots (a request that reuses prefixes takes the idle slot
   whose tokens share the longest prefix with its prompt; otherwise an empty slot, else the
   least recently used idle one is evicted);
2. drop the sequences that were cancelled or whose reader went away (they leave the batch
   before the next step);
3. gather the next work of every active sequence into one step: decode tokens and speculative
   drafts whole, prefill chunks under a per-step token budget (what the decodes leave of
   ``step_tokens``), so that a long prompt is prefilled over several steps and never stalls
   the decodes; a cut prefill continues in the next step (the kernels are batch-invariant, so
   where a prompt is cut does not change a bit of its logits);
4. run the step and send each finished item its result; the ``Step``s a sequence emits go to
   its reader's queue.

Stats: each sequence is charged the engine counters of every step it took part in, in full (a
read shared by several sequences counts for each of them); the engine's totals count it once.

Callers on any thread: ``submit`` a ``generation.Request``, then iterate ``steps`` (or
``cancel``); ``exclusive`` runs a function on an idle slot between steps (``Engine.forward``).
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import logging
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields

import torch

from . import generation
from .errors import GenerationCancelled, SluiceError
from .generation import Request, Step
from .runner import ModelRunner, SeqResult, SeqState, SeqWork
from .stats import EngineCounters

log = logging.getLogger("sluice.scheduler")
IDLE_EXIT_S = 2.0  # an idle scheduler thread ends after this long
_END = object()  # a sequence's queue: nothing more follows


_open: weakref.WeakSet = weakref.WeakSet()  # schedulers whose thread may run


@atexit.register
def _close_all() -> None:
    """At exit, end every scheduler thread before the interpreter tears down: a thread that ran
    torch and is still alive then can abort the process ("terminate called without an active
    exception")."""
    for sched in list(_open):
        sched.close(timeout=5.0)


class EngineClosed(SluiceError):
    """The engine was closed while a generation waited or ran."""


class Sequence:
    """One generation in the scheduler. Read its ``Step``s with ``Scheduler.steps``."""

    _ids = itertools.count(1)

    def __init__(self, req: Request):
        self.id = next(self._ids)
        self.req = req
        self.phase = "waiting"  # -> prefilling -> decoding -> finished | cancelled | failed
        self.slot: SeqState | None = None
        self.out: queue.SimpleQueue = queue.SimpleQueue()
        self.dropped = threading.Event()  # the reader went away: leave at the next step
        self.submitted = time.monotonic()
        self.queue_wait_s = 0.0
        self.charged = EngineCounters()
        self.coro = None
        self.work: SeqWork | None = None  # the forward the generation waits for
        self.done = 0  # tokens of ``work`` run in earlier steps (a prefill cut by the token budget)
        self.logits: list[torch.Tensor] = []  # of those earlier pieces

    @property
    def cancelled(self) -> bool:
        return self.dropped.is_set() or (self.req.cancel is not None and self.req.cancel.is_set())


@dataclass
class SchedulerStats:
    """Running totals of the scheduler (a snapshot)."""

    steps: int = 0  # steps run
    stepped_sequences: int = 0  # sum over steps of the sequences in each (mean batch size = this / steps)
    last_batch_size: int = 0  # sequences in the most recent step
    max_batch_size: int = 0
    tokens: int = 0  # tokens forwarded in those steps
    admitted: int = 0  # sequences that got a slot
    queue_wait_s: float = 0.0  # their summed wait for a slot
    running: int = 0  # sequences holding a slot now
    waiting: int = 0  # sequences waiting for one
    # from the step's ``EngineCounters`` delta (``charge``): {"last": field} the step's value,
    # {"sums": field} summed over steps
    union_last: int = field(default=0, metadata={"last": "expert_union"})  # distinct experts of the last
    # step's rows, summed over MoE layers
    union_total: int = field(default=0, metadata={"sums": "expert_union"})  # ... summed over steps
    # each sequence's own union summed over sequences and steps (no sharing)
    seq_union_total: int = field(default=0, metadata={"sums": "expert_seq_union"})

    def charge(self, delta: EngineCounters) -> None:
        """Take in one step's engine counters (the fields declared from them)."""
        for f in fields(self):
            if "last" in f.metadata:
                setattr(self, f.name, getattr(delta, f.metadata["last"]))
            elif "sums" in f.metadata:
                setattr(self, f.name, getattr(self, f.name) + getattr(delta, f.metadata["sums"]))


class Scheduler:
    """Runs every submitted generation on the runner's state slots, one step for all at a time."""

    def __init__(self, runner: ModelRunner, *, step_tokens: int):
        self.runner = runner
        self.step_tokens = max(1, step_tokens)
        self._slots = list(runner.slots)
        self._used: dict[int, int] = {id(s): 0 for s in self._slots}  # slot -> last use (a counter)
        self._tick = itertools.count(1)
        self._busy: set[int] = set()
        self._waiting: deque[Sequence] = deque()
        self._active: list[Sequence] = []
        self._calls: deque[tuple[Callable, dict]] = deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._last: EngineCounters | None = None
        self._stats = SchedulerStats()
        self.last_slot: SeqState = self._slots[0]  # the slot of the most recently admitted generation

    @property
    def parallel(self) -> int:
        return len(self._slots)

    # -- the callers' side (any thread) ----------------------------------------------------------

    def submit(self, req: Request) -> Sequence:
        """Queue a generation; it joins the running batch as soon as a slot is idle."""
        seq = Sequence(req)
        with self._cond:
            if self._closed:
                raise EngineClosed("the engine is closed")
            self._waiting.append(seq)
            self._start()
            self._cond.notify_all()
        return seq

    def steps(self, seq: Sequence) -> Iterator[Step]:
        """The ``Step``s of a submitted generation as they come; closing this iterator (or the
        request's ``cancel`` event) takes the sequence out of the batch before the next step."""
        try:
            while True:
                item = seq.out.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                if seq.req.cancel is not None and seq.req.cancel.is_set():  # steps computed ahead are not shown
                    raise GenerationCancelled("generation cancelled")
                yield item
        finally:
            self.cancel(seq)

    def cancel(self, seq: Sequence) -> None:
        """Take a sequence out (a no-op once it ended)."""
        seq.dropped.set()
        with self._cond:
            self._cond.notify_all()

    def wake(self) -> None:
        """A ``cancel`` event was set: drop a waiting sequence now (from the caller's thread, even while
        a step runs), a running one before the next step."""
        with self._cond:
            self._drop_cancelled_waiting()
            self._cond.notify_all()

    def exclusive(self, fn: Callable[[SeqState], object]):
        """Run ``fn(slot)`` on an idle slot between two steps (waits for one); returns its result."""
        box: dict = {}
        done = threading.Event()
        box["done"] = done
        with self._cond:
            if self._closed:
                raise EngineClosed("the engine is closed")
            self._calls.append((fn, box))
            self._start()
            self._cond.notify_all()
        done.wait()
        if "error" in box:
            raise box["error"]
        return box["value"]

    def stats(self) -> SchedulerStats:
        with self._cond:
            return dataclasses.replace(self._stats, running=len(self._active), waiting=len(self._waiting))

    def close(self, timeout: float = 30.0) -> None:
        """Stop: waiting and running generations end with ``EngineClosed``."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    # -- the loop (the scheduler's thread) -------------------------------------------------------

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="sluice-scheduler", daemon=True)
            self._thread.start()
            _open.add(self)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        break
                    self._drop_cancelled_waiting()
                    if self._calls and self._idle():
                        break
                    self._admit()
                    if self._active:
                        break
                    self._last = None  # idle: the next step starts a fresh count
                    if self._waiting or self._calls:
                        # a waiting request's ``cancel`` event is set without telling us: look again soon
                        self._cond.wait(0.05)
                    elif not self._cond.wait(IDLE_EXIT_S) and not (self._waiting or self._calls or self._closed):
                        # nothing to do: the thread ends (the next generation starts another), so that
                        # an engine dropped without close() is not kept alive by its scheduler thread
                        self._thread = None
                        return
                if self._closed:
                    self._fail_all()
                    return
                calls = []
                while self._calls and self._idle():
                    fn, box = self._calls.popleft()
                    slot = self._take_slot(None)
                    calls.append((fn, box, slot))
            for fn, box, slot in calls:
                try:
                    box["value"] = fn(slot)
                except BaseException as e:  # noqa: BLE001  (handed to the caller)
                    box["error"] = e
                finally:
                    self._release(slot)
                    box["done"].set()
            if calls:
                self._last = None  # what the calls ran is charged to no generation
                continue
            try:
                self._step()
            except BaseException as e:  # noqa: BLE001  never let the loop die with sequences waiting on it
                log.exception("internal error in the scheduler")
                for seq in list(self._active):  # they fail; the loop goes on with the next ones
                    self._end(seq, "failed", e)

    def _idle(self) -> list[SeqState]:
        return [s for s in self._slots if id(s) not in self._busy]

    def _take_slot(self, req: Request | None) -> SeqState:
        idle = self._idle()
        best, best_common = None, 0
        if req is not None and req.reuse_prefix:
            for s in idle:
                old, ids = s.tokens, req.ids
                n, cap = 0, min(len(old), len(ids) - 1)
                while n < cap and old[n] == ids[n]:
                    n += 1
                if n > best_common or (n == best_common and best is not None
                                       and self._used[id(s)] > self._used[id(best)]):
                    best, best_common = s, n
        if best is None or best_common == 0:
            empty = [s for s in idle if s.length == 0]
            best = empty[0] if empty else min(idle, key=lambda s: self._used[id(s)])
        self._busy.add(id(best))
        self._used[id(best)] = next(self._tick)
        return best

    def _release(self, slot: SeqState) -> None:
        with self._cond:
            self._busy.discard(id(slot))
            self._used[id(slot)] = next(self._tick)
            self._cond.notify_all()

    def _drop_cancelled_waiting(self) -> None:
        for seq in [s for s in self._waiting if s.cancelled]:
            self._waiting.remove(seq)
            seq.phase = "cancelled"
            seq.out.put(GenerationCancelled("generation cancelled"))

    def _admit(self) -> None:
        """Give idle slots to waiting sequences, first come first served (holding ``_cond``)."""
        while self._waiting and self._idle():
            seq = self._waiting.popleft()
            if seq.cancelled:
                seq.phase = "cancelled"
                seq.out.put(GenerationCancelled("generation cancelled"))
                continue
            seq.slot = self.last_slot = self._take_slot(seq.req)
            seq.queue_wait_s = time.monotonic() - seq.submitted
            self._stats.admitted += 1
            self._stats.queue_wait_s += seq.queue_wait_s
            seq.coro = generation.sequence(self.runner, seq.slot, seq.req, meter=lambda s=seq: s.charged)
            self._active.append(seq)
            self._advance(seq, None)

    def _advance(self, seq: Sequence, value: SeqResult | None) -> None:
        """Run the generation's own logic until it asks for its next forward (or ends)."""
        try:
            while True:
                item = seq.coro.send(value)
                value = None
                if isinstance(item, SeqWork):
                    seq.work, seq.done, seq.logits = item, 0, []
                    seq.phase = "decoding" if item.decoding else "prefilling"
                    return
                seq.out.put(item)
        except StopIteration:
            self._end(seq, "finished", _END)
        except GenerationCancelled as e:
            self._end(seq, "cancelled", e)
        except BaseException as e:  # noqa: BLE001  (the reader raises it)
            self._end(seq, "failed", e)

    def _end(self, seq: Sequence, phase: str, event) -> None:
        seq.phase = phase
        seq.work = None
        if seq.coro is not None:
            seq.coro.close()
        if phase == "failed" and seq.slot is not None:
            seq.slot.rewind(0)  # what a failed forward left in it is not trusted again
        with self._cond:
            if seq in self._active:
                self._active.remove(seq)
        if seq.slot is not None:
            self._release(seq.slot)
        seq.out.put(event)

    def _fail_all(self) -> None:
        for seq in list(self._waiting) + list(self._active):
            seq.phase = "failed"
            if seq.coro is not None:
                seq.coro.close()
            seq.out.put(EngineClosed("the engine was closed while this generation ran"))
        self._waiting.clear()
        self._active.clear()
        for _fn, box in self._calls:
            box["error"] = EngineClosed("the engine is closed")
            box["done"].set()
        self._calls.clear()

    def _plan(self, active: list[Sequence]) -> list[tuple[Sequence, SeqWork, bool]]:
        """This step's items: every decode whole, then prefill pieces while the token budget lasts
        (at least one piece per step, so a step always makes progress)."""
        plan: list[tuple[Sequence, SeqWork, bool]] = []
        left = self.step_tokens
        for seq in active:
            if seq.work.decoding:
                plan.append((seq, seq.work, True))
                left -= len(seq.work.tokens)
        for seq in active:
            w = seq.work
            if w.decoding:
                continue
            rest = len(w.tokens) - seq.done
            n = rest if w.record_routing else min(rest, left)  # routing is recorded for whole items only
            if n <= 0:
                if plan:
                    continue
                n = min(rest, self.step_tokens)
            left -= n
            if n == rest and seq.done == 0:
                plan.append((seq, w, True))
                continue
            piece = w.piece(seq.done, seq.done + n)
            # its next step's tokens (at most a step's budget of the prompt's rest): read ahead by id
            piece.next_tokens = w.tokens[seq.done + n : seq.done + n + self.step_tokens] or None
            plan.append((seq, piece, seq.done + n == len(w.tokens)))
        return plan

    def _step(self) -> None:
        for seq in [s for s in self._active if s.cancelled]:
            self._end(seq, "cancelled", GenerationCancelled("generation cancelled"))
        active = [s for s in self._active if s.work is not None]
        if not active:
            return
        plan = self._plan(active)
        if self._last is None:
            self._last = self.runner.counters()
        try:
            results = self.runner.step([w for _, w, _ in plan])
        except BaseException as e:  # noqa: BLE001  (the step's sequences fail; the others go on)
            for seq, _, _ in plan:
                self._end(seq, "failed", e)
            self._last = None
            return
        now = self.runner.counters()
        delta = now - self._last
        self._last = now
        with self._cond:
            st = self._stats
            st.steps += 1
            st.stepped_sequences += len(plan)
            st.last_batch_size = len(plan)
            st.max_batch_size = max(st.max_batch_size, len(plan))
            st.tokens += sum(len(w.tokens) for _, w, _ in plan)
            st.charge(delta)
        for (seq, w, whole), result in zip(plan, results):
            seq.charged = seq.charged + delta
            error = getattr(result, "error", None)
            if isinstance(error, BaseException):  # the runner failed this item only
                self._end(seq, "failed", error)
                continue
            if w is not seq.work or not whole:  # a piece of a cut prefill
                if result.logits is not None:
                    seq.logits.append(result.logits)
                seq.done += len(w.tokens)
                if not whole:
                    continue
                result = SeqResult(torch.cat(seq.logits) if len(seq.logits) > 1 else
                                   (seq.logits[0] if seq.logits else None))
            self._advance(seq, result)


__all__ = ["EngineClosed", "Scheduler", "SchedulerStats", "Sequence"]
