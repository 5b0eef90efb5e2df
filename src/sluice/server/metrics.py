"""The server's metrics (``GET /metrics``), rendered in the Prometheus text format.

Where a metric carries an engine counter, the name it is read under is declared once in the
tables below: ``GENERATION_SUMS`` (``GenerationStats`` keys summed over completed generations),
``ENGINE_METRICS`` (``EngineCounters`` fields since load) and ``BATCH_METRICS``
(``SchedulerStats`` fields). ``NOT_EXPORTED`` names the engine counters no metric carries; a
test keeps every ``EngineCounters`` field in one of them.
"""

from __future__ import annotations

import math
import threading

# (metric, GenerationStats key, help): counters summed over completed generations
GENERATION_SUMS: tuple[tuple[str, str, str], ...] = (
    ("sluice_expert_cache_lookups_total", "expert_lookups", "Expert cache lookups during decode."),
    ("sluice_expert_cache_hits_total", "expert_hits", "Expert cache lookups that did not wait on a read."),
    ("sluice_bytes_read_total", "bytes_read", "Bytes read from storage: experts (on demand and prefetched) and "
     "streamed spine layers."),
    ("sluice_remote_bytes_read_total", "remote_bytes_read", "Of those, bytes fetched from a remote store (S3, HTTP)."),
    ("sluice_disk_tier_hits_total", "disk_tier_hits", "Reads served by the local disk tier (--disk-cache)."),
    ("sluice_disk_tier_misses_total", "disk_tier_misses", "Reads the disk tier did not have (fetched remotely)."),
    ("sluice_disk_tier_bytes_read_total", "disk_tier_bytes_read", "Of the bytes read, bytes served by the disk tier."),
)

# (metric, help, ((labels, EngineCounters field), ...)): the engine's counters since load
ENGINE_METRICS: tuple[tuple[str, str, tuple[tuple[dict, str], ...]], ...] = (
    ("sluice_engine_bytes_read_total", "Bytes the engine read from storage since load, each read once however many "
     "generations needed it.", (({}, "bytes_read"),)),
    ("sluice_engine_expert_reads_total", "Expert reads the engine made since load, by kind.",
     (({"kind": "demand"}, "demand_reads"), ({"kind": "prefetch"}, "prefetch_reads"))),
    ("sluice_engine_forwards_total", "Model forwards the engine ran since load.", (({}, "forwards"),)),
    ("sluice_engine_table_rows_total", "Rows of token-keyed tables (PLE n-gram tables) since load: looked up, and "
     "read from storage (the rest from the row cache or resident tables), and reads issued ahead (while the "
     "previous prefill chunk ran).",
     (({"kind": "looked_up"}, "row_lookups"), ({"kind": "read"}, "rows_read"),
      ({"kind": "read_ahead"}, "rows_read_ahead"))),
    ("sluice_engine_table_bytes_read_total", "Of the bytes read, bytes of table rows, since load.",
     (({}, "row_bytes_read"),)),
    ("sluice_engine_tokens_forwarded_total", "Positions those forwards computed.", (({}, "tokens_forwarded"),)),
)

# (metric, kind, SchedulerStats field, help): the engine scheduler's batches
BATCH_METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("sluice_batch_size", "gauge", "last_batch_size", "Sequences in the engine's most recent step."),
    ("sluice_engine_steps_total", "counter", "steps", "Engine steps run (one forward for every sequence in it)."),
    ("sluice_batched_sequences_total", "counter", "stepped_sequences", "Sequences summed over engine steps "
     "(divided by sluice_engine_steps_total: the mean batch size)."),
    ("sluice_expert_union_size", "gauge", "union_last", "Distinct experts the rows of the engine's most recent step "
     "routed to, over all its sequences, summed over MoE layers."),
    ("sluice_expert_union_total", "counter", "union_total", "Those per-step unions summed over steps."),
    ("sluice_expert_sequence_union_total", "counter", "seq_union_total", "Each sequence's own union of experts "
     "summed over the sequences of each step and over steps: what they would have looked up one by one."),
)

# the EngineCounters fields no metric carries (neither above nor through a SchedulerStats field)
NOT_EXPORTED = ("expert_misses", "prefill_lookups", "prefetch_used", "prefetch_cancelled", "lookahead_predictions",
                "lookahead_hits", "read_wait_s", "expert_compute_s", "evictions", "spine_bytes_read",
                "spine_read_wait_s", "expert_compute_calls", "certain_reads", "certain_bytes", "hash_lookups",
                "hash_misses", "hash_read_wait_s")

_WORKER_METRICS = (
    ("calls_total", "counter", "Calls (one per MoE layer it had experts in) answered by each Ray expert worker."),
    ("experts_computed_total", "counter", "Expert outputs computed by each Ray expert worker."),
    ("rows_computed_total", "counter", "Token rows computed by each Ray expert worker."),
    ("lookups_total", "counter", "Decode-time expert lookups in each Ray expert worker's cache."),
    ("hits_total", "counter", "Those lookups that did not wait on a read."),
    ("bytes_read_total", "counter", "Expert bytes each Ray expert worker read from storage."),
    ("lost_total", "counter", "Calls to each Ray expert worker that failed because the worker was lost."),
)


class Metrics:
    """Counters and gauges, rendered in the Prometheus text format."""

    def __init__(self, model: str):
        self.model = model
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str], int] = {}
        self.generations = {"completed": 0, "cancelled": 0, "failed": 0}
        self.totals = dict(prompt_tokens=0, prefilled_tokens=0, reused_prefix_tokens=0, generated_tokens=0,
                           **{key: 0 for _, key, _ in GENERATION_SUMS}, prefill_seconds=0.0,
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
                for _, key, _ in GENERATION_SUMS:
                    t[key] += int(stats.get(key, 0))
                ttft, total = float(stats.get("ttft_s", 0.0)), float(stats.get("total_s", 0.0))
                t["prefill_seconds"] += ttft
                t["decode_seconds"] += max(0.0, total - ttft)
                t["decode_tokens"] += max(0, generated - 1)
                t["request_seconds"] += total
                self.last = {k: float(stats.get(k, 0.0)) for k in self.last}

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
        for name, kind, key, help_ in BATCH_METRICS:
            metric(name, kind, help_, [({}, getattr(batch, key) if batch else 0)])
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
        for name, key, help_ in GENERATION_SUMS:
            metric(name, "counter", help_, [({}, t[key])])
        lookups = t["expert_lookups"]
        metric("sluice_expert_cache_hit_rate", "gauge", "Expert cache hit rate over all completed generations.",
               [({}, t["expert_hits"] / lookups if lookups else 0.0)])
        for name, help_, samples in ENGINE_METRICS:
            metric(name, "counter", help_, [(labels, getattr(totals, key) if totals else 0) for labels, key in samples])
        if workers:  # experts on Ray workers (docs/scale-out.md): one sample per worker
            for key, kind, help_ in _WORKER_METRICS:
                metric(f"sluice_expert_worker_{key}", kind, help_, [({"worker": w["index"]}, w[key]) for w in workers])
        return "\n".join(out) + "\n"


def _num(v) -> str:
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else ("NaN" if math.isnan(v) else ("+Inf" if v > 0 else "-Inf"))
    return str(v)


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


__all__ = ["BATCH_METRICS", "ENGINE_METRICS", "GENERATION_SUMS", "NOT_EXPORTED", "Metrics"]
