"""Serving logic: up to N generations in the engine's batch, a bounded FIFO queue, cancellation
(the metrics it counts: ``metrics.py``).

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
