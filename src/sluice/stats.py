"""Typed statistics: one generation's ``GenerationStats``, the engine's running ``EngineCounters``
and the ``EngineInfo`` every generation reports.

``GenerationStats`` is a dataclass that is also a ``dict`` of its fields (in the order the
README lists them), so ``stats["decode_tok_s"]``, ``.get``, ``in``, iteration, ``dict(stats)``
and ``json.dumps(stats)`` work as they did when the stats were a plain dict. The keys are
only ever added to (the README's promise); a key that is not a field is refused.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields


def _from(source: str, name: str, default=0):
    """An ``EngineCounters`` field collected from the field ``name`` of the source ``source``."""
    return field(default=default, metadata={"from": (source, name)})


@dataclass(frozen=True)
class EngineCounters:
    """Monotonic counters since the engine was loaded (a snapshot; ``a - b`` is the delta).

    Engine totals: a read shared by several sequences counts once here, and in full in the
    ``GenerationStats`` of each generation that needed it.
    """

    # ``_from(source, name)``: collected from that field of one of the runner's sources
    # (``collect``): "experts" (``ExpertCounters``), "spine" (``SpineStats``), "io" (``ReadStats``)
    expert_lookups: int = _from("experts", "lookups")  # decode-time expert lookups
    expert_hits: int = _from("experts", "hits")  # ... that did not wait on a read
    expert_misses: int = _from("experts", "misses")
    prefill_lookups: int = _from("experts", "prefill_lookups")
    demand_reads: int = _from("experts", "demand_reads")
    prefetch_reads: int = _from("experts", "prefetch_reads")
    prefetch_used: int = _from("experts", "prefetch_used")
    prefetch_cancelled: int = _from("experts", "prefetch_cancelled")
    lookahead_predictions: int = _from("experts", "predicted")
    lookahead_hits: int = _from("experts", "predicted_hits")
    read_wait_s: float = _from("experts", "read_wait_s", 0.0)  # decode-time seconds waiting on expert reads
    expert_compute_s: float = _from("experts", "compute_s", 0.0)  # decode-time seconds computing experts
    evictions: int = 0
    bytes_read: int = 0  # every byte read from storage: experts (demand and prefetch) and spine
    spine_bytes_read: int = _from("spine", "bytes_read")
    spine_read_wait_s: float = _from("spine", "wait_s", 0.0)
    forwards: int = 0  # model forwards run (one per prefill chunk or decode step)
    tokens_forwarded: int = 0  # positions those forwards computed
    remote_bytes_read: int = _from("io", "remote_bytes")  # of bytes_read: fetched from a remote store (S3, HTTP)
    disk_tier_hits: int = _from("io", "tier_hits")  # reads the local disk tier served
    disk_tier_misses: int = _from("io", "tier_misses")  # reads the disk tier did not have (fetched remotely)
    disk_tier_bytes_read: int = _from("io", "tier_bytes")  # of bytes_read: from the disk tier
    # per forward and MoE layer (summed): expert computations (one per expert of the union, however
    # many sequences' rows routed to it), the union's size, and the sum of each sequence's own union
    # (what the sequences would have looked up run alone; equal to expert_union for one sequence)
    expert_compute_calls: int = _from("experts", "compute_calls")
    expert_union: int = _from("experts", "union")
    expert_seq_union: int = _from("experts", "seq_union")
    # the row store (rows/: token-keyed tables): distinct rows looked up per gather, rows read from
    # storage (the rest from its cache or resident tables), their bytes (also counted in bytes_read)
    row_lookups: int = _from("rows", "looked_up")
    rows_read: int = _from("rows", "read")
    row_bytes_read: int = _from("rows", "bytes_read")
    rows_read_ahead: int = _from("rows", "ahead")  # reads issued for the step's next forward (next chunk)
    # ids known early (experts/certain.py): the experts the token ids decide (hash-routed layers), read
    # before their layer runs (of demand_reads), their bytes; the hash layers' decode lookups, misses
    # and read wait (of expert_lookups, expert_misses, read_wait_s: the rest are the router layers')
    certain_reads: int = _from("experts", "certain_reads")
    certain_bytes: int = _from("experts", "certain_bytes")
    hash_lookups: int = _from("experts", "hash_lookups")
    hash_misses: int = _from("experts", "hash_misses")
    hash_read_wait_s: float = _from("experts", "hash_read_wait_s", 0.0)

    @classmethod
    def collect(cls, sources: dict[str, object | None], **own) -> EngineCounters:
        """The counters of every ``_from`` field read from ``sources`` (name -> object; None: that
        source is absent, its counters are 0); ``own``: every other field, all of them."""
        missing = [f.name for f in fields(cls) if "from" not in f.metadata and f.name not in own]
        if missing:
            raise TypeError(f"EngineCounters.collect needs {missing}")
        values = dict(own)
        for f in fields(cls):
            if "from" in f.metadata:
                source, name = f.metadata["from"]
                obj = sources[source]
                values[f.name] = getattr(obj, name) if obj is not None else f.default
        return cls(**values)

    def __sub__(self, other: EngineCounters) -> EngineCounters:
        return EngineCounters(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})

    def __add__(self, other: EngineCounters) -> EngineCounters:
        return EngineCounters(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class EngineInfo:
    """What every generation reports about the engine it ran on (from the plan and the load)."""

    budget_bytes: int
    cache_slots: int
    total_experts: int
    direct_io: bool
    load_s: float
    lossy: dict
    spine_resident_bytes: int
    spine_streamed_layers: int


@dataclass(eq=False)
class GenerationStats(dict):
    """One generation's statistics; a ``dict`` of its fields as well (see the module docstring)."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    reused_prefix_tokens: int = 0
    prefill_tok_s: float = 0.0
    decode_tok_s: float = 0.0
    ttft_s: float = 0.0
    total_s: float = 0.0
    hit_rate: float = 0.0
    expert_lookups: int = 0
    expert_hits: int = 0
    expert_misses: int = 0
    demand_reads: int = 0
    prefetch_reads: int = 0
    prefetch_used: int = 0
    prefetch_cancelled: int = 0
    lookahead_recall: float = 0.0
    lookahead_predictions: int = 0
    evictions: int = 0
    bytes_read: int = 0  # every byte read from storage: demand, prefetch and spine
    read_wait_s: float = 0.0
    expert_compute_s: float = 0.0
    decode_forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    tokens_per_forward: float = 0.0
    peak_rss_bytes: int = 0
    budget_bytes: int = 0
    cache_slots: int = 0
    total_experts: int = 0
    direct_io: bool = False
    load_s: float = 0.0
    lossy: dict = field(default_factory=dict)
    spine_resident_bytes: int = 0
    spine_streamed_layers: int = 0
    spine_bytes_read: int = 0
    spine_read_wait_s: float = 0.0
    remote_bytes_read: int = 0  # of bytes_read: fetched from a remote store
    disk_tier_hits: int = 0
    disk_tier_misses: int = 0
    disk_tier_bytes_read: int = 0  # of bytes_read: from the local disk tier
    # the row store's (token-keyed tables; 0 for models without): counts, then per token of the
    # generation (prompt positions computed plus generated tokens), beside the experts' bytes
    row_lookups: int = 0
    rows_read: int = 0
    row_bytes_read: int = 0  # of bytes_read: table rows
    rows_read_ahead: int = 0  # of the row reads: issued during the previous prefill chunk
    row_hit_rate: float = 0.0  # rows served without a read (cache or resident) / rows looked up
    rows_read_per_token: float = 0.0
    row_bytes_per_token: float = 0.0
    expert_bytes_per_token: float = 0.0  # bytes_read less spine and row bytes, per token
    # the experts the token ids decide (hash-routed layers, DeepSeek-V4): read before their layer
    # runs, their bytes, and the hash layers' share of the decode lookups, misses and read wait
    certain_reads: int = 0
    certain_bytes: int = 0
    hash_lookups: int = 0
    hash_misses: int = 0
    hash_read_wait_s: float = 0.0

    # the attributes and the dict entries are kept equal: every write goes through __setattr__
    def __setattr__(self, name, value) -> None:
        object.__setattr__(self, name, value)
        if name in _KEYS:
            dict.__setitem__(self, name, value)

    def __setitem__(self, key, value) -> None:
        if key not in _KEYS:
            raise KeyError(f"{key!r} is not a generation stats key")
        setattr(self, key, value)

    def update(self, *args, **kwargs) -> None:
        for k, v in dict(*args, **kwargs).items():
            self[k] = v

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = default
        return self[key]

    def _fixed(self, *args, **kwargs):
        raise TypeError("generation stats keys cannot be removed")

    __delitem__ = pop = popitem = clear = _fixed

    def __ior__(self, other):
        self.update(other)
        return self

    def __reduce__(self):  # pickle and copy as the dataclass (a dict subclass would pickle its items twice)
        return (self.__class__, tuple(getattr(self, k) for k in _KEYS))

    @classmethod
    def from_run(cls, *, prompt_tokens: int, generated: int, reused: int, t_prefill: float, total_s: float,
                 forwards: list[tuple[int, float]], drafted: int, accepted: int, delta: EngineCounters,
                 info: EngineInfo, peak_rss_bytes: int) -> GenerationStats:
        """The stats of one generation: ``forwards`` holds its decode forwards as (tokens, seconds),
        ``delta`` the engine counters it caused."""
        steady = forwards[1:]  # the first decode step is excluded (it pays for warm-up)
        steady_t = sum(t for _, t in steady)
        lookups = delta.expert_lookups
        tokens = max(1, prompt_tokens - reused + generated)
        expert_bytes = delta.bytes_read - delta.spine_bytes_read - delta.row_bytes_read
        counted = {f.name: getattr(delta, f.name) for f in fields(delta) if f.name not in NOT_PER_GENERATION}
        return cls(
            **counted,
            **dataclasses.asdict(info),  # a copy (``lossy`` included)
            prompt_tokens=prompt_tokens,
            generated_tokens=generated,
            reused_prefix_tokens=reused,
            prefill_tok_s=(prompt_tokens - reused) / t_prefill if t_prefill > 0 else 0.0,
            decode_tok_s=sum(n for n, _ in steady) / steady_t if steady_t > 0 else 0.0,
            ttft_s=t_prefill,
            total_s=total_s,
            hit_rate=delta.expert_hits / lookups if lookups else 0.0,
            lookahead_recall=(delta.lookahead_hits / delta.lookahead_predictions
                              if delta.lookahead_predictions else 0.0),
            decode_forwards=len(forwards),
            drafted=drafted,
            accepted=accepted,
            tokens_per_forward=sum(n for n, _ in forwards) / len(forwards) if forwards else 0.0,
            peak_rss_bytes=peak_rss_bytes,
            row_hit_rate=1.0 - delta.rows_read / delta.row_lookups if delta.row_lookups else 0.0,
            rows_read_per_token=delta.rows_read / tokens,
            row_bytes_per_token=delta.row_bytes_read / tokens,
            expert_bytes_per_token=max(0, expert_bytes) / tokens,
        )


# the engine counters a generation's stats do not carry under their own name; every other
# ``EngineCounters`` field is a ``GenerationStats`` key of the same name (``from_run`` copies them)
NOT_PER_GENERATION = (
    "prefill_lookups",  # prefill is not a cache test; decode lookups are
    "lookahead_hits",  # in ``lookahead_recall``
    "forwards", "tokens_forwarded",  # engine totals (``decode_forwards``, ``tokens_per_forward``: this generation's)
    "expert_compute_calls", "expert_union", "expert_seq_union",  # the batch's sharing: ``SchedulerStats``, /metrics
)

_KEYS: tuple[str, ...] = tuple(f.name for f in fields(GenerationStats))
STATS_KEYS = _KEYS  # every key, in the order ``--json`` prints them

__all__ = ["NOT_PER_GENERATION", "STATS_KEYS", "EngineCounters", "EngineInfo", "GenerationStats"]
