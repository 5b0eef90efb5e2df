"""The step generator: prefill, then decode token by token (or several per forward with
lossless n-gram speculation), yielding ``Step``s with text deltas, log-probabilities and,
on the last step, the stats.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field

import torch

from .errors import GenerationCancelled
from .layers.sampling import Sampler, SamplingParams, logprobs
from .runner import ModelRunner, SeqResult, SeqState, SeqWork
from .speculative import NgramDrafter
from .stats import EngineCounters, GenerationStats
from .sysmem import peak_rss
from .text import Detokenizer, StopStrings


@dataclass
class Step:
    """One generated token, as the step generator yields it."""

    token_id: int
    text_delta: str
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" on the last step
    stats: GenerationStats | dict = field(default_factory=dict)  # GenerationStats on the last step, else {}


@dataclass
class Result:
    """A finished generation: the generated tokens only (not the prompt)."""

    token_ids: list[int]
    text: str
    finish_reason: str
    stats: GenerationStats | dict
    logprobs: list[float] | None = None


@dataclass
class Request:
    ids: list[int]
    params: SamplingParams
    max_new_tokens: int
    stops: list[str]
    stop_ids: set[int]
    ignore_eos: bool
    n_logprobs: int | None
    reuse_prefix: bool
    cancel: threading.Event | None
    speculate: bool


class _Emitter:
    """Turns accepted tokens into Steps: detokenization, stop tokens, stop strings, length."""

    def __init__(self, runner: ModelRunner, seq: SeqState, req: Request):
        self.detok = Detokenizer(runner.tokenizer, req.ids) if runner.tokenizer is not None else None
        self.stopper = StopStrings(req.stops)
        self.stop_on = set(req.stop_ids) | (set() if req.ignore_eos else set(runner.eos_token_ids))
        self.budget = min(req.max_new_tokens, seq.max_context - len(req.ids))
        self.n_logprobs = req.n_logprobs
        self.generated: list[int] = []

    def emit(self, token: int, logits: torch.Tensor) -> Step:
        lp, top = logprobs(logits, token, self.n_logprobs) if self.n_logprobs is not None else (None, None)
        self.generated.append(token)
        finish = None
        if token in self.stop_on:
            return Step(token, self.stopper.flush(), lp, top, "stop")
        delta = self.detok.push(token) if self.detok is not None else ""
        delta, hit = self.stopper.feed(delta)
        if hit:
            finish = "stop"
        elif len(self.generated) >= self.budget:
            more, hit = self.stopper.feed(self.detok.flush() if self.detok is not None else "")
            delta += more + ("" if hit else self.stopper.flush())
            finish = "stop" if hit else "length"
        return Step(token, delta, lp, top, finish)


def _verify(seq: SeqState, pending: list[int], draft: list[int], pos: int, decoding: bool,
            tracing: bool) -> Iterator[SeqWork]:
    """Forward ``pending`` (+ ``draft``) at ``pos``; logits of the last pending token and each draft token.

    A coroutine (``result = yield from _verify(...)``): it yields each ``SeqWork`` and is sent its
    ``SeqResult``. With a recurrent layer, the draft runs as a second forward after a snapshot, so
    that a rejected draft can be rolled back by reference instead of recomputing the prompt.
    """
    if not draft:
        return (yield SeqWork(seq, pending, pos, 1, decoding, tracing))
    if seq.recurrent:
        first = yield SeqWork(seq, pending, pos, 1, decoding, tracing)
        seq.mark()
        rest = yield SeqWork(seq, draft, pos + len(pending), len(draft), decoding, tracing)
        logits = torch.cat([first.logits, rest.logits])
        if not tracing:
            return SeqResult(logits)

        def joined(a: dict, b: dict) -> dict:
            return {layer: torch.cat([t, b[layer]]) for layer, t in a.items() if layer in b}

        return SeqResult(logits, joined(first.routing, rest.routing), joined(first.weights, rest.weights),
                         joined(first.predicted, rest.predicted), joined(first.probs or {}, rest.probs or {}),
                         step=first.step)
    seq.mark()
    return (yield SeqWork(seq, pending + draft, pos, 1 + len(draft), decoding, tracing))


def drive(runner: ModelRunner, coroutine) -> Iterator:
    """Run a generation coroutine alone: each ``SeqWork`` it yields as a step of its own, every
    other value it yields passed on (the ``Step``s of ``sequence``); returns what it returns."""
    result = None
    while True:
        try:
            item = coroutine.send(result)
        except StopIteration as stop:
            return stop.value
        if isinstance(item, SeqWork):
            result = runner.step([item])[0]
        else:
            result = None
            yield item


def run(runner: ModelRunner, seq: SeqState, req: Request) -> Iterator[Step]:
    """One generation alone on its state slot (the caller owns the slot): the ``Step``s of
    ``sequence``, each forward a step of its own (the scheduler runs many at once instead)."""
    gen = sequence(runner, seq, req)
    try:
        yield from drive(runner, gen)
    finally:
        gen.close()


def sequence(runner: ModelRunner, seq: SeqState, req: Request, meter: Callable[[], EngineCounters] | None = None
             ) -> Generator[SeqWork | Step, SeqResult | None, None]:
    """The core generator for one sequence on its state slot, as a coroutine: it yields the
    ``SeqWork`` of its next forward and is sent its ``SeqResult``, and yields each emitted ``Step``
    (sent nothing back). ``drive`` runs it alone; the scheduler runs many in one step each.

    ``meter``: the engine counters this generation caused so far (default: the runner's counters
    since it started; the scheduler passes the sum of the steps it took part in).

    Each iteration forwards the tokens not yet in the state (the prompt, then the last
    token), plus an n-gram draft when speculating (greedy only). The draft's longest prefix
    that the model agrees with is accepted with the model's own next token, the state is
    rolled back past the rejected rest, and every accepted token is emitted as a Step. The
    last Step carries the ``GenerationStats``.
    """
    t0 = time.perf_counter()
    if meter is None:
        counters0 = runner.counters()

        def meter() -> EngineCounters:
            return runner.counters() - counters0

    sampler = Sampler(req.params)
    out = _Emitter(runner, seq, req)
    spec = req.speculate and req.params.greedy
    drafter = NgramDrafter(req.ids) if spec else None

    common = 0
    if req.reuse_prefix:
        old = seq.tokens
        while common < min(len(old), len(req.ids) - 1) and old[common] == req.ids[common]:
            common += 1
    reused = seq.rewind(common)
    pending, pos = req.ids[reused:], reused
    t_start = time.perf_counter()
    if seq.recurrent and len(pending) > 1:
        # Recurrent layers return only to snapshots: keep one before the prompt's last token, so
        # a later prompt that shares all of this one but its last token (a regeneration) or
        # extends it (a continued conversation) resumes from there.
        yield SeqWork(seq, pending[:-1], pos, last_n=0)
        seq.mark()
        pos, pending = pos + len(pending) - 1, pending[-1:]
    forwards: list[tuple[int, float]] = []  # decode forwards: (tokens produced, seconds)
    t_prefill, prefill = 0.0, True
    drafted = accepted = 0

    def finish(step: Step) -> Step:
        step.stats = GenerationStats.from_run(
            prompt_tokens=len(req.ids), generated=len(out.generated), reused=reused, t_prefill=t_prefill,
            total_s=time.perf_counter() - t0, forwards=forwards, drafted=drafted, accepted=accepted,
            delta=meter(), info=runner.info(), peak_rss_bytes=peak_rss())
        return step

    while True:
        if req.cancel is not None and req.cancel.is_set():
            raise GenerationCancelled("generation cancelled")
        draft: list[int] = []
        if drafter is not None:
            room = min(out.budget - len(out.generated) - 1, seq.max_context - pos - len(pending))
            draft = drafter.propose()[: max(0, room)]
        t1 = time.perf_counter()
        tracing = runner.tracing and not prefill
        result = yield from _verify(seq, pending, draft, pos, not prefill, tracing)
        rows = result.logits  # [1 + d, V]
        a = 0
        if draft:
            preds = rows.argmax(dim=-1).tolist()
            while a < len(draft) and draft[a] == preds[a]:
                a += 1
            keep = pos + len(pending) + a
            if seq.length > keep:
                kept = seq.tokens[:keep]
                # no snapshot there (recurrent), or the window is gone (sliding-window cache): recompute
                done = seq.rewind(keep)
                if done < keep:
                    yield SeqWork(seq, kept[done:], done, last_n=0, decoding=not prefill)
            drafter.feedback(len(draft), a)
            drafted += len(draft)
            accepted += a
        if prefill:
            t_prefill, prefill = time.perf_counter() - t_start, False
            seq.mark()
        else:
            forwards.append((1 + a, time.perf_counter() - t1))
        if tracing:
            runner.write_trace(pos, result, len(pending) + a, seq.slot)  # the tokens this forward processed and kept
        for i in range(a + 1):
            token = draft[i] if i < a else sampler(rows[a])
            if drafter is not None:
                drafter.append(token)
            step = out.emit(token, rows[i])
            if step.finish_reason:
                yield finish(step)
                return
            yield step
            if req.cancel is not None and req.cancel.is_set():
                raise GenerationCancelled("generation cancelled")
        pos += len(pending) + a
        pending = [token]
