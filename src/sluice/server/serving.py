"""Serving logic: up to N generations in the engine's batch, a bounded FIFO queue, cancellation,
metrics.

The engine runs up to ``--parallel`` N generations at once, every one in each step of its
scheduler (``sluice/scheduler.py``); here N worker threads (``sluice-engine-<i>``) each take
the next job from a FIFO queue and read its generation's steps. Beyond N running, requests
wait in the queue, at most ``max_queue`` of them; beyond that they are refused (429) at once.
Tokens travel from a worker to the request's event loop through ``loop.call_soon_threadsafe``
into an ``asyncio.Queue``, so the event loop never blocks on the engine.

Cancellation: ``Scheduler.cancel(job)`` removes a queued job from the queue at once, or
sets the running job's ``cancel`` event, which takes its sequence out of the batch before the
next step. The generation is always closed, so its slot is free for the next job.

Every generation runs with ``reuse_prefix=True``: each of the engine's N state slots keeps the
KV cache of its last sequence, a request takes the slot sharing the longest prefix with it and
prefills only what follows, which makes a growing chat cost only its new tokens.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from ..errors import CheckpointError, GenerationCancelled, SluiceError

log = logging.getLogger("sluice.server")


class APIError(Exception):
    """An error answered in the OpenAI error shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}


def error_for_exception(e: BaseException) -> APIError:
    """The HTTP error of an exception raised inside a generation."""
    if isinstance(e, ValueError) and not isinstance(e, (CheckpointError, OSError)):
        return APIError(400, str(e))
    from ..storage.interrupt import interrupted

    why = interrupted()
    if why is not None and isinstance(e, OSError):  # a read in flight stopped by the shutdown
        return APIError(503, f"the server is shutting down: {why} (a model read in flight was stopped)",
                        "server_error", code="shutting_down")
    kind = type(e).__name__
    return APIError(500, f"generation failed: {kind}: {e}", "server_error", code="generation_failed")


# -- jobs --------------------------------------------------------------------------------------


@dataclass
class GenParams:
    """What the engine is asked for: the prompt as token ids and ``Engine.stream`` arguments."""

    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None

    def stream_kwargs(self) -> dict:
        return dict(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                    top_k=self.top_k, seed=self.seed, stop=self.stop or None, stop_token_ids=self.stop_token_ids,
                    ignore_eos=self.ignore_eos, logprobs=self.logprobs)


class Cancelled:
    """Event: the generation was cancelled (or dropped from the queue)."""


class Failed:
    """Event: the generation raised; ``error`` is the exception."""

    def __init__(self, error: BaseException):
        self.error = error


_ids = itertools.count(1)


class Job:
    """One request's generation. Events (``Step``, ``Cancelled``, ``Failed``) arrive on ``events``."""

    def __init__(self, params: GenParams, loop: asyncio.AbstractEventLoop, endpoint: str = ""):
        self.id = next(_ids)
        self.params = params
        self.endpoint = endpoint
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancel = threading.Event()
        self.state = "new"  # queued -> running -> done | cancelled
        self.submitted = time.monotonic()
        self.tokens = 0
        self.disconnected = False  # set when the client went away
        self.recorded = False  # its answer (or the client's departure) is counted in the metrics

    def post(self, event) -> None:
        """Hand an event to the request's event loop (from any thread)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancel.set()


# -- metrics -----------------------------------------------------------------------------------


class Metrics:
    """Counters and gauges, rendered in the Prometheus text format."""

    def __init__(self, model: str):
        self.model = model
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str], int] = {}
        self.generations = {"completed": 0, "cancelled": 0, "failed": 0}
        self.totals = dict(prompt_tokens=0, prefilled_tokens=0, reused_prefix_tokens=0, generated_tokens=0,
                           expert_lookups=0, expert_hits=0, bytes_read=0, remote_bytes_read=0, disk_tier_hits=0,
                           disk_tier_misses=0, disk_tier_bytes_read=0, prefill_seconds=0.0,
                           decode_seconds=0.0, decode_tokens=0, request_seconds=0.0, queue_seconds=0.0)
        self.last = dict(prefill_tok_s=0.0, decode_tok_s=0.0, hit_rate=0.0)
        self.queue_wait_count = 0

    def request(self, endpoint: str, status: int) -> None:
        with self._lock:
            key = (endpoint, str(status))
            self.requests[key] = self.requests.get(key, 0) + 1

    def started(self, queue_s: float) -> None:
        with self._lock:
            self.totals["queue_seconds"] += queue_s
            self.queue_wait_count += 1

    def finished(self, outcome: str, prompt_tokens: int, generated: int, stats: dict | None) -> None:
        with self._lock:
            self.generations[outcome] += 1
            t = self.totals
            t["prompt_tokens"] += prompt_tokens
            t["generated_tokens"] += generated
            if stats:
                reused = int(stats.get("reused_prefix_tokens", 0))
                t["reused_prefix_tokens"] += reused
                t["prefilled_tokens"] += prompt_tokens - reused
                t["expert_lookups"] += int(stats.get("expert_lookups", 0))
                t["expert_hits"] += int(stats.get("expert_hits", 0))
                t["bytes_read"] += int(stats.get("bytes_read", 0))
                for k in ("remote_bytes_read", "disk_tier_hits", "disk_tier_misses", "disk_tier_bytes_read"):
                    t[k] += int(stats.get(k, 0))
                ttft, total = float(stats.get("ttft_s", 0.0)), float(stats.get("total_s", 0.0))
                t["prefill_seconds"] += ttft
                t["decode_seconds"] += max(0.0, total - ttft)
                t["decode_tokens"] += max(0, generated - 1)
                t["request_seconds"] += total
                self.last = dict(prefill_tok_s=float(stats.get("prefill_tok_s", 0.0)),
                                 decode_tok_s=float(stats.get("decode_tok_s", 0.0)),
                                 hit_rate=float(stats.get("hit_rate", 0.0)))

    def mean_generation_s(self) -> float:
        with self._lock:
            n = self.generations["completed"]
            return self.totals["request_seconds"] / n if n else 1.0

    def snapshot(self) -> dict:
        with self._lock:
            return dict(requests=dict(self.requests), generations=dict(self.generations), totals=dict(self.totals),
                        last=dict(self.last), queue_waits=self.queue_wait_count)

    def render(self, queue_depth: int, running: int, capacity: int, batch=None, parallel: int = 1,
               totals=None, workers: list[dict] | None = None) -> str:
        """The Prometheus text; ``batch``: the engine scheduler's ``SchedulerStats``, ``totals``: the
        engine's ``EngineCounters`` since load (None: not known); ``workers``: per expert worker
        counters (``--ray``), else none."""
        s = self.snapshot()
        t = s["totals"]
        out: list[str] = []

        def metric(name, kind, help_, samples):
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                lab = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
                out.append(f"{name}{lab} {_num(value)}")

        metric("sluice_info", "gauge", "Model served by this process.", [({"model": _esc(self.model)}, 1)])
        metric("sluice_requests_total", "counter", "HTTP API requests by endpoint and status code "
               "(499: the client went away before the answer).",
               [({"endpoint": e, "status": c}, n) for (e, c), n in sorted(s["requests"].items())])
        metric("sluice_generations_total", "counter", "Generations run on the engine, by outcome.",
               [({"outcome": k}, v) for k, v in s["generations"].items()])
        metric("sluice_queue_depth", "gauge", "Requests waiting for the engine.", [({}, queue_depth)])
        metric("sluice_queue_capacity", "gauge", "Most requests that may wait (--max-queue).", [({}, capacity)])
        metric("sluice_requests_running", "gauge", "Generations running on the engine (at most --parallel).",
               [({}, running)])
        metric("sluice_parallel", "gauge", "Generations the engine runs at once (--parallel).", [({}, parallel)])
        b = batch
        metric("sluice_batch_size", "gauge", "Sequences in the engine's most recent step.",
               [({}, b.last_batch_size if b else 0)])
        metric("sluice_engine_steps_total", "counter", "Engine steps run (one forward for every sequence in it).",
               [({}, b.steps if b else 0)])
        metric("sluice_batched_sequences_total", "counter", "Sequences summed over engine steps (divided by "
               "sluice_engine_steps_total: the mean batch size).", [({}, b.stepped_sequences if b else 0)])
        metric("sluice_expert_union_size", "gauge", "Distinct experts the rows of the engine's most recent step "
               "routed to, over all its sequences, summed over MoE layers.",
               [({}, b.union_last if b else 0)])
        metric("sluice_expert_union_total", "counter", "Those per-step unions summed over steps.",
               [({}, b.union_total if b else 0)])
        metric("sluice_expert_sequence_union_total", "counter", "Each sequence's own union of experts summed over "
               "the sequences of each step and over steps: what they would have looked up one by one.",
               [({}, b.seq_union_total if b else 0)])
        metric("sluice_prompt_tokens_total", "counter", "Prompt tokens of generations run.", [({}, t["prompt_tokens"])])
        metric("sluice_prefilled_tokens_total", "counter", "Prompt tokens actually prefilled (not reused).",
               [({}, t["prefilled_tokens"])])
        metric("sluice_reused_prefix_tokens_total", "counter", "Prompt tokens served from the previous "
               "sequence's KV cache (prefix reuse).", [({}, t["reused_prefix_tokens"])])
        metric("sluice_generated_tokens_total", "counter", "Tokens generated.", [({}, t["generated_tokens"])])
        metric("sluice_prefill_seconds_total", "counter", "Time spent prefilling.", [({}, t["prefill_seconds"])])
        metric("sluice_decode_seconds_total", "counter", "Time spent decoding.", [({}, t["decode_seconds"])])
        metric("sluice_queue_wait_seconds_total", "counter", "Time generations waited in the queue.",
               [({}, t["queue_seconds"])])
        metric("sluice_queue_waits_total", "counter", "Generations that left the queue for the engine (divides "
               "sluice_queue_wait_seconds_total into the mean queue wait).", [({}, s["queue_waits"])])
        metric("sluice_prefill_tokens_per_second", "gauge", "Prefill speed of the last completed generation.",
               [({}, s["last"]["prefill_tok_s"])])
        metric("sluice_decode_tokens_per_second", "gauge", "Steady-state decode speed of the last completed "
               "generation.", [({}, s["last"]["decode_tok_s"])])
        metric("sluice_expert_cache_lookups_total", "counter", "Expert cache lookups during decode.",
               [({}, t["expert_lookups"])])
        metric("sluice_expert_cache_hits_total", "counter", "Expert cache lookups that did not wait on a read.",
               [({}, t["expert_hits"])])
        lookups = t["expert_lookups"]
        metric("sluice_expert_cache_hit_rate", "gauge", "Expert cache hit rate over all completed generations.",
               [({}, t["expert_hits"] / lookups if lookups else 0.0)])
        metric("sluice_bytes_read_total", "counter", "Bytes read from storage: experts (on demand and "
               "prefetched) and streamed spine layers.", [({}, t["bytes_read"])])
        e = totals
        metric("sluice_engine_bytes_read_total", "counter", "Bytes the engine read from storage since load, each "
               "read once however many generations needed it.", [({}, e.bytes_read if e else 0)])
        metric("sluice_engine_expert_reads_total", "counter", "Expert reads the engine made since load, by kind.",
               [({"kind": "demand"}, e.demand_reads if e else 0), ({"kind": "prefetch"}, e.prefetch_reads if e else 0)])
        metric("sluice_engine_forwards_total", "counter", "Model forwards the engine ran since load.",
               [({}, e.forwards if e else 0)])
        metric("sluice_engine_tokens_forwarded_total", "counter", "Positions those forwards computed.",
               [({}, e.tokens_forwarded if e else 0)])
        metric("sluice_remote_bytes_read_total", "counter", "Of those, bytes fetched from a remote store (S3, HTTP).",
               [({}, t["remote_bytes_read"])])
        metric("sluice_disk_tier_hits_total", "counter", "Reads served by the local disk tier (--disk-cache).",
               [({}, t["disk_tier_hits"])])
        metric("sluice_disk_tier_misses_total", "counter", "Reads the disk tier did not have (fetched remotely).",
               [({}, t["disk_tier_misses"])])
        metric("sluice_disk_tier_bytes_read_total", "counter", "Of the bytes read, bytes served by the disk tier.",
               [({}, t["disk_tier_bytes_read"])])
        if workers:  # experts on Ray workers (docs/scale-out.md): one sample per worker
            for key, kind, help_ in _WORKER_METRICS:
                metric(f"sluice_expert_worker_{key}", kind, help_, [({"worker": w["index"]}, w[key]) for w in workers])
        return "\n".join(out) + "\n"


_WORKER_METRICS = (
    ("calls_total", "counter", "Calls (one per MoE layer it had experts in) answered by each Ray expert worker."),
    ("experts_computed_total", "counter", "Expert outputs computed by each Ray expert worker."),
    ("rows_computed_total", "counter", "Token rows computed by each Ray expert worker."),
    ("lookups_total", "counter", "Decode-time expert lookups in each Ray expert worker's cache."),
    ("hits_total", "counter", "Those lookups that did not wait on a read."),
    ("bytes_read_total", "counter", "Expert bytes each Ray expert worker read from storage."),
    ("lost_total", "counter", "Calls to each Ray expert worker that failed because the worker was lost."),
)


def _num(v) -> str:
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else ("NaN" if math.isnan(v) else ("+Inf" if v > 0 else "-Inf"))
    return str(v)


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


# -- the scheduler -----------------------------------------------------------------------------


class QueueFull(Exception):
    pass


class ShuttingDown(Exception):
    pass


class Scheduler:
    """A FIFO of jobs served by ``parallel`` worker threads, each reading one generation of the
    engine's batch at a time."""

    def __init__(self, engine, max_queue: int, metrics: Metrics, reuse_prefix: bool = True):
        if max_queue < 0:
            raise ValueError("max_queue must be >= 0")
        self.engine = engine
        self.max_queue = max_queue
        self.metrics = metrics
        self.reuse_prefix = reuse_prefix
        self.parallel = max(1, int(getattr(engine, "parallel", 1)))
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._running: set[Job] = set()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"sluice-engine-{i}", daemon=True)
                         for i in range(self.parallel)]

    # -- the request side (event loop thread) --

    def start(self) -> None:
        for t in self._threads:
            t.start()

    @property
    def alive(self) -> bool:
        return all(t.is_alive() for t in self._threads) and not self._closed

    def depth(self) -> tuple[int, int]:
        """(waiting, running)."""
        with self._cond:
            return len(self._waiting), len(self._running)

    def batch(self):
        """The engine scheduler's running totals (batch sizes, steps, expert unions), or None."""
        sched = getattr(self.engine, "scheduler", None)
        return sched.stats() if sched is not None else None

    def submit(self, job: Job) -> None:
        """Queue a job, or raise ``QueueFull`` (``parallel`` jobs running and ``max_queue`` waiting)."""
        with self._cond:
            if self._closed:
                raise ShuttingDown()
            if len(self._waiting) + len(self._running) >= self.parallel + self.max_queue:
                raise QueueFull()
            job.state = "queued"
            self._waiting.append(job)
            self._cond.notify()

    def retry_after(self) -> int:
        """Seconds after which a refused request may find room: the expected time to drain one slot."""
        waiting, running = self.depth()
        return max(1, math.ceil(self.metrics.mean_generation_s() * max(1, waiting) / self.parallel))

    def cancel(self, job: Job) -> None:
        """Drop a queued job, or take the running one out of the batch before its next step."""
        with self._cond:
            job.cancel.set()
            if job.state == "queued":
                try:
                    self._waiting.remove(job)
                except ValueError:
                    pass
                else:
                    job.state = "cancelled"
                    self.metrics.finished("cancelled", 0, 0, None)
                    job.post(Cancelled())

    def stop(self) -> None:
        """Refuse new jobs, drop waiting ones and cancel the running ones; does not wait (signal-safe)."""
        with self._cond:
            self._closed = True
            dropped = list(self._waiting)
            self._waiting.clear()
            for job in self._running:
                job.cancel.set()
            self._cond.notify_all()
        for job in dropped:
            job.state = "cancelled"
            job.cancel.set()
            job.post(Cancelled())

    def close(self, timeout: float = 30.0) -> None:
        """``stop``, then wait for the workers."""
        self.stop()
        end = time.monotonic() + timeout
        for t in self._threads:
            if t.is_alive():
                t.join(max(0.0, end - time.monotonic()))

    # -- the worker threads --

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job = self._waiting.popleft()
                job.state = "running"
                self._running.add(job)
            try:
                self._run(job)
            except BaseException:  # never let a worker die: log and go on
                log.exception("internal error in the engine worker")
            finally:
                with self._cond:
                    self._running.discard(job)

    def _run(self, job: Job) -> None:
        p = job.params
        self.metrics.started(time.monotonic() - job.submitted)
        outcome, stats, event = "completed", None, None
        gen = None
        try:
            if job.cancel.is_set():
                raise GenerationCancelled("cancelled before it started")
            gen = self.engine.stream(p.prompt_ids, reuse_prefix=self.reuse_prefix, cancel=job.cancel,
                                     **p.stream_kwargs())
            for step in gen:
                job.tokens += 1
                if step.finish_reason:
                    stats = step.stats
                job.post(step)
        except GenerationCancelled:
            outcome, event = "cancelled", Cancelled()
        except Exception as e:  # one request's failure; the server goes on
            if isinstance(e, SluiceError) or isinstance(e, (OSError, ValueError)):
                log.error("generation %d failed: %s: %s", job.id, type(e).__name__, e)
            else:
                log.exception("generation %d failed", job.id)
            outcome, event = "failed", Failed(e)
        finally:
            if gen is not None:
                gen.close()
            job.state = {"completed": "done"}.get(outcome, outcome)
            self.metrics.finished(outcome, len(p.prompt_ids), job.tokens, stats)
        if event is not None:
            job.post(event)
