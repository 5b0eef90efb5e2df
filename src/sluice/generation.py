"""The step generator: prefill, then decode token by token (or several per forward with
lossless n-gram speculation), yielding ``Step``s with text deltas, log-probabilities and,
on the last step, the stats.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from .errors import GenerationCancelled
from .layers.sampling import Sampler, SamplingParams, logprobs
from .speculative import NgramDrafter
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
    stats: dict = field(default_factory=dict)


@dataclass
class Result:
    """A finished generation: the generated tokens only (not the prompt)."""

    token_ids: list[int]
    text: str
    finish_reason: str
    stats: dict
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

    def __init__(self, engine, req: Request):
        self.detok = Detokenizer(engine.tokenizer, req.ids) if engine.tokenizer is not None else None
        self.stopper = StopStrings(req.stops)
        self.stop_on = set(req.stop_ids) | (set() if req.ignore_eos else set(engine.eos_token_ids))
        self.budget = min(req.max_new_tokens, engine.max_context - len(req.ids))
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


def _verify(engine, pending: list[int], draft: list[int], pos: int) -> torch.Tensor:
    """Forward ``pending`` (+ ``draft``) at ``pos``; logits of the last pending token and each draft token.

    With a recurrent layer, the draft runs as a second forward after a snapshot, so that a
    rejected draft can be rolled back by reference instead of recomputing the prompt.
    """
    state = engine.state
    if not draft:
        return engine._run(pending, pos, last_n=1)
    if state.recurrent:
        first = engine._run(pending, pos, last_n=1)
        state.mark()
        return torch.cat([first, engine._run(draft, pos + len(pending), last_n=len(draft))])
    state.mark()
    return engine._run(pending + draft, pos, last_n=1 + len(draft))


def run(engine, req: Request) -> Iterator[Step]:
    """The core generator (the engine lock is held by the caller).

    Each iteration forwards the tokens not yet in the cache (the prompt, then the last
    token), plus an n-gram draft when speculating (greedy only). The draft's longest prefix
    that the model agrees with is accepted with the model's own next token, the state is
    rolled back past the rejected rest, and every accepted token is emitted as a Step.
    """
    t0 = time.perf_counter()
    counters0 = dict(vars(engine.experts.counters))
    spine0 = dict(vars(engine.spine.stats)) if engine.spine is not None else None
    bytes0 = engine.checkpoint.stats.bytes_read
    evict0 = engine.cache.evictions
    state = engine.state
    sampler = Sampler(req.params)
    out = _Emitter(engine, req)
    spec = req.speculate and req.params.greedy
    drafter = NgramDrafter(req.ids) if spec else None

    common = 0
    if req.reuse_prefix:
        old = state.tokens[: state.length]
        while common < min(len(old), len(req.ids) - 1) and old[common] == req.ids[common]:
            common += 1
    engine.experts.decoding = False
    reused = state.rewind(common)
    pending, pos = req.ids[reused:], reused
    t_start = time.perf_counter()
    if state.recurrent and len(pending) > 1:
        # Recurrent layers return only to snapshots: keep one before the prompt's last token, so
        # a later prompt that shares all of this one but its last token (a regeneration) or
        # extends it (a continued conversation) resumes from there.
        with torch.inference_mode():
            engine._run(pending[:-1], pos, last_n=0)
        state.mark()
        pos, pending = pos + len(pending) - 1, pending[-1:]
    forwards: list[tuple[int, float]] = []  # decode forwards: (tokens produced, seconds)
    t_prefill, prefill = 0.0, True
    drafted = accepted = 0

    def finish(step: Step) -> Step:
        step.stats = engine.last_stats = _stats(engine, req, out.generated, reused, t0, t_prefill, forwards,
                                                counters0, bytes0, evict0, drafted, accepted, spine0)
        return step

    while True:
        if req.cancel is not None and req.cancel.is_set():
            raise GenerationCancelled("generation cancelled")
        draft: list[int] = []
        if drafter is not None:
            room = min(out.budget - len(out.generated) - 1, state.max_ctx - pos - len(pending))
            draft = drafter.propose()[: max(0, room)]
        t1 = time.perf_counter()
        tracing = engine.trace is not None and not prefill
        if tracing:
            engine.experts.routing, engine.experts.predicted_routing = {}, {}
        with torch.inference_mode():
            rows = _verify(engine, pending, draft, pos)  # [1 + d, V]
            routed, engine.experts.routing = engine.experts.routing, None
            predicted, engine.experts.predicted_routing = engine.experts.predicted_routing, None
            a = 0
            if draft:
                preds = rows.argmax(dim=-1).tolist()
                while a < len(draft) and draft[a] == preds[a]:
                    a += 1
                keep = pos + len(pending) + a
                if state.length > keep and state.rewind(keep) < keep:  # no snapshot there: recompute
                    done = state.length
                    seq = pending + draft
                    engine._run(seq[done - pos : keep - pos], done, last_n=0)
                drafter.feedback(len(draft), a)
                drafted += len(draft)
                accepted += a
        if prefill:
            t_prefill, prefill = time.perf_counter() - t_start, False
            state.mark()
        else:
            forwards.append((1 + a, time.perf_counter() - t1))
        if tracing:
            moe = engine.desc.moe_layers
            for i in range(len(pending) + a):  # the tokens this forward processed and kept
                engine.trace.write(pos + i, [routed[layer][0][i].tolist() for layer in moe],
                                   [routed[layer][1][i].tolist() for layer in moe],
                                   [predicted[layer][i].tolist() if layer in predicted else [] for layer in moe])
            engine.trace.flush()
        engine.experts.decoding = True
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


def _stats(engine, req, generated, reused, t0, t_prefill, forwards, c0, bytes0, evict0, drafted, accepted,
           spine0) -> dict:
    c = engine.experts.counters
    d = {k: getattr(c, k) - v for k, v in c0.items()}
    steady = forwards[1:]  # the first decode step is excluded (it pays for warm-up)
    steady_t = sum(t for _, t in steady)
    lookups = d["lookups"]
    return {
        "prompt_tokens": len(req.ids),
        "generated_tokens": len(generated),
        "reused_prefix_tokens": reused,
        "prefill_tok_s": (len(req.ids) - reused) / t_prefill if t_prefill > 0 else 0.0,
        "decode_tok_s": sum(n for n, _ in steady) / steady_t if steady_t > 0 else 0.0,
        "ttft_s": t_prefill,
        "total_s": time.perf_counter() - t0,
        "hit_rate": d["hits"] / lookups if lookups else 0.0,
        "expert_lookups": lookups,
        "expert_hits": d["hits"],
        "expert_misses": d["misses"],
        "demand_reads": d["demand_reads"],
        "prefetch_reads": d["prefetch_reads"],
        "prefetch_used": d["prefetch_used"],
        "prefetch_cancelled": d["prefetch_cancelled"],
        "lookahead_recall": d["predicted_hits"] / d["predicted"] if d["predicted"] else 0.0,
        "lookahead_predictions": d["predicted"],
        "evictions": engine.cache.evictions - evict0,
        "bytes_read": engine.checkpoint.stats.bytes_read - bytes0,
        "read_wait_s": d["read_wait_s"],
        "expert_compute_s": d["compute_s"],
        "decode_forwards": len(forwards),
        "drafted": drafted,
        "accepted": accepted,
        "tokens_per_forward": sum(n for n, _ in forwards) / len(forwards) if forwards else 0.0,
        "peak_rss_bytes": peak_rss(),
        "budget_bytes": engine.plan.budget,
        "cache_slots": engine.plan.cache_slots,
        "total_experts": engine.plan.total_experts,
        "direct_io": engine.experts_source.direct_io,
        "load_s": engine.load_s,
        "lossy": dict(engine.lossy),
        "spine_resident_bytes": engine.plan.spine_bytes - engine.plan.stream_buffer_bytes,
        "spine_streamed_layers": len(engine.plan.streamed_layers),
        "spine_bytes_read": (engine.spine.stats.bytes_read - spine0["bytes_read"]) if spine0 else 0,
        "spine_read_wait_s": (engine.spine.stats.wait_s - spine0["wait_s"]) if spine0 else 0.0,
    }
