"""Serving logic: up to N generations in the engine's batch, a bounded FIFO queue, cancellation
(the metrics it counts: ``metrics.py``).

The engine runs up to ``--parallel`` N generations at once, every one in each step of its
scheduler (``sluice/scheduler.py``), and keeps the one waiting queue: a request is submitted to
it at once. Beyond N running, requests wait there, at most ``max_queue`` of them (the engine
scheduler's own counts); beyond that they are refused (429) at once. One reader thread per
request (``sluice-request-<id>``) reads its generation's steps; tokens travel to the request's
event loop through ``loop.call_soon_threadsafe`` into an ``asyncio.Queue``, so the event loop
never blocks on the engine.

Cancellation: ``Scheduler.cancel(job)`` sets the job's ``cancel`` event: the engine drops a
waiting sequence from its queue, or takes a running one out of the batch before the next step.

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
from dataclasses import dataclass, field

from ..errors import CheckpointError, GenerationCancelled, SluiceError
from .metrics import Metrics

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


# -- the scheduler -----------------------------------------------------------------------------


class QueueFull(Exception):
    pass


class ShuttingDown(Exception):
    pass


class Scheduler:
    """The server's admission to the engine's own scheduler (``sluice/scheduler.py``): one queue.

    A request is submitted to the engine's waiting queue at once (``Engine.request`` ->
    ``engine.scheduler.submit``); the engine admits waiting sequences into its ``parallel`` state
    slots first come first served, cancels them (a waiting one is dropped, a running one leaves
    the batch before the next step) and counts them (``scheduler.stats()``: running, waiting).
    Here: the limit (beyond ``parallel`` running and ``max_queue`` waiting, 429 at once), and one
    reader thread per request carrying its steps to the request's event loop."""

    def __init__(self, engine, max_queue: int, metrics: Metrics, reuse_prefix: bool = True):
        if max_queue < 0:
            raise ValueError("max_queue must be >= 0")
        self.engine = engine
        self.max_queue = max_queue
        self.metrics = metrics
        self.reuse_prefix = reuse_prefix
        self.parallel = max(1, int(getattr(engine, "parallel", 1)))
        self._lock = threading.Lock()
        self._jobs: dict[Job, threading.Thread] = {}  # submitted and not yet finished
        self._closed = False

    # -- the request side (event loop thread) --

    def start(self) -> None:
        """Nothing to start: the engine's scheduler thread runs while it has work."""

    @property
    def alive(self) -> bool:
        return not self._closed

    def depth(self) -> tuple[int, int]:
        """(waiting, running) from the engine scheduler's own counts: a sequence that has a slot free
        for it runs (the scheduler admits it before its next step), the rest wait."""
        st = self.batch()
        total = st.waiting + st.running
        running = min(self.parallel, total)
        return total - running, running

    def batch(self):
        """The engine scheduler's running totals (batch sizes, steps, expert unions, waiting, running)."""
        return self.engine.scheduler.stats()

    def submit(self, job: Job) -> None:
        """Submit a job to the engine's queue, or raise ``QueueFull`` (``parallel`` generations running
        and ``max_queue`` waiting) or ``ShuttingDown``."""
        with self._lock:
            if self._closed:
                raise ShuttingDown()
            waiting, running = self.depth()
            if waiting + running >= self.parallel + self.max_queue:
                raise QueueFull()
            p = job.params
            req = self.engine.request(p.prompt_ids, reuse_prefix=self.reuse_prefix, cancel=job.cancel,
                                      **p.stream_kwargs())
            seq = self.engine.scheduler.submit(req)  # counted in depth() from here on
            job.state = "queued"
            reader = threading.Thread(target=self._read, args=(job, seq), name=f"sluice-request-{job.id}", daemon=True)
            self._jobs[job] = reader
        reader.start()

    def retry_after(self) -> int:
        """Seconds after which a refused request may find room: the expected time to drain one slot."""
        waiting, running = self.depth()
        return max(1, math.ceil(self.metrics.mean_generation_s() * max(1, waiting) / self.parallel))

    def cancel(self, job: Job) -> None:
        """Drop the job from the engine's queue, or take it out of the batch before its next step."""
        job.cancel.set()
        self.engine.scheduler.wake()

    def stop(self) -> None:
        """Refuse new jobs and cancel every submitted one; does not wait (signal-safe)."""
        with self._lock:
            self._closed = True
            jobs = list(self._jobs)
        for job in jobs:
            job.cancel.set()

    def close(self, timeout: float = 30.0) -> None:
        """``stop``, then wait for the readers."""
        self.stop()
        self.engine.scheduler.wake()
        end = time.monotonic() + timeout
        with self._lock:
            readers = list(self._jobs.values())
        for t in readers:
            if t.is_alive() and t is not threading.current_thread():
                t.join(max(0.0, end - time.monotonic()))

    # -- the reader threads --

    def _read(self, job: Job, seq) -> None:
        try:
            self._run(job, seq)
        except BaseException:  # never let a reader die silently
            log.exception("internal error reading generation %d", job.id)
        finally:
            with self._lock:
                self._jobs.pop(job, None)

    def _run(self, job: Job, seq) -> None:
        p = job.params
        outcome, stats, event = "completed", None, None
        started = False
        try:
            for step in self.engine.follow(seq):
                if not started:
                    started, job.state = True, "running"
                    self.metrics.started(seq.queue_wait_s or 0.0)
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
            if not started and seq.queue_wait_s is not None:
                self.metrics.started(seq.queue_wait_s)  # admitted, then failed or cancelled before a token
            job.state = {"completed": "done"}.get(outcome, outcome)
            self.metrics.finished(outcome, len(p.prompt_ids), job.tokens, stats)
        if event is not None:
            job.post(event)
