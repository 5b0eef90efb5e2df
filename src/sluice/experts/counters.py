"""The expert side's counters (``ExpertProvider.counters``; the Ray driver's ``RayExperts.counters``
sums its workers' into the same fields)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ExpertCounters:
    # the engine reports these as ``EngineCounters`` fields, each declaring the name it reads here
    # (``sluice/stats.py``, ``_from("experts", ...)``)
    lookups: int = 0  # decode-time expert lookups (experts some decoding row of the forward routed to)
    hits: int = 0  # decode-time lookups that did not wait on a read
    misses: int = 0
    prefill_lookups: int = 0
    demand_reads: int = 0
    prefetch_reads: int = 0
    prefetch_used: int = 0  # speculative reads later used by the layer they were for
    prefetch_cancelled: int = 0  # wrong guesses cancelled before their read started
    prefetch_aborted: int = 0  # wrong guesses stopped between pieces while being read
    # lookahead predictions checked against the real routing (decode); none are made, so none
    # counted, while the cache holds every expert READY (``Lookahead``: nothing to prefetch)
    predicted: int = 0
    predicted_hits: int = 0  # ... that the layer really used
    predicted_far: int = 0  # the same for predictions made two layers ahead
    predicted_far_hits: int = 0
    read_wait_s: float = 0.0  # decode-time seconds spent waiting on expert reads
    compute_s: float = 0.0  # decode-time seconds spent computing experts
    compute_calls: int = 0  # expert computations: one per expert of a layer's union per forward
    union: int = 0  # per forward and MoE layer, the distinct experts its rows routed to (summed)
    seq_union: int = 0  # ... counted per sequence of the forward: what the sequences would look up alone
    # certain reads (``experts/certain.py``): experts of hash-routed layers read from the step's
    # token ids before their layer runs (also counted in ``demand_reads``), and their bytes
    certain_reads: int = 0
    certain_bytes: int = 0
    # the decode-time lookups, misses and read wait of hash-routed layers (of ``lookups``,
    # ``misses`` and ``read_wait_s``; the rest are the router layers')
    hash_lookups: int = 0
    hash_misses: int = 0
    hash_read_wait_s: float = 0.0
