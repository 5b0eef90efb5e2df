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


@dataclass(frozen=True)
class EngineCounters:
    """Monotonic counters since the engine was loaded (a snapshot; ``a - b`` is the delta).

    Engine totals: a read shared by several sequences counts once here, and in full in the
    ``GenerationStats`` of each generation that needed it.
    """

    expert_lookups: int = 0  # decode-time expert lookups
    expert_hits: int = 0  # ... that did not wait on a read
    expert_misses: int = 0
    prefill_lookups: int = 0
    demand_reads: int = 0
    prefetch_reads: int = 0
    prefetch_used: int = 0
    prefetch_cancelled: int = 0
    lookahead_predictions: int = 0
    lookahead_hits: int = 0
    read_wait_s: float = 0.0  # decode-time seconds waiting on expert reads
    expert_compute_s: float = 0.0  # decode-time seconds computing experts
    evictions: int = 0
    bytes_read: int = 0  # every byte read from storage: experts (demand and prefetch) and spine
    spine_bytes_read: int = 0
    spine_read_wait_s: float = 0.0
    forwards: int = 0  # model forwards run (one per prefill chunk or decode step)
    tokens_forwarded: int = 0  # positions those forwards computed
    remote_bytes_read: int = 0  # of bytes_read: fetched from a remote store (S3, HTTP)
    disk_tier_hits: int = 0  # reads the local disk tier served
    disk_tier_misses: int = 0  # reads the disk tier did not have (fetched from the remote store)
    disk_tier_bytes_read: int = 0  # of bytes_read: from the disk tier

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
        return cls(
            prompt_tokens=prompt_tokens,
            generated_tokens=generated,
            reused_prefix_tokens=reused,
            prefill_tok_s=(prompt_tokens - reused) / t_prefill if t_prefill > 0 else 0.0,
            decode_tok_s=sum(n for n, _ in steady) / steady_t if steady_t > 0 else 0.0,
            ttft_s=t_prefill,
            total_s=total_s,
            hit_rate=delta.expert_hits / lookups if lookups else 0.0,
            expert_lookups=lookups,
            expert_hits=delta.expert_hits,
            expert_misses=delta.expert_misses,
            demand_reads=delta.demand_reads,
            prefetch_reads=delta.prefetch_reads,
            prefetch_used=delta.prefetch_used,
            prefetch_cancelled=delta.prefetch_cancelled,
            lookahead_recall=(delta.lookahead_hits / delta.lookahead_predictions
                              if delta.lookahead_predictions else 0.0),
            lookahead_predictions=delta.lookahead_predictions,
            evictions=delta.evictions,
            bytes_read=delta.bytes_read,
            read_wait_s=delta.read_wait_s,
            expert_compute_s=delta.expert_compute_s,
            decode_forwards=len(forwards),
            drafted=drafted,
            accepted=accepted,
            tokens_per_forward=sum(n for n, _ in forwards) / len(forwards) if forwards else 0.0,
            peak_rss_bytes=peak_rss_bytes,
            budget_bytes=info.budget_bytes,
            cache_slots=info.cache_slots,
            total_experts=info.total_experts,
            direct_io=info.direct_io,
            load_s=info.load_s,
            lossy=dict(info.lossy),
            spine_resident_bytes=info.spine_resident_bytes,
            spine_streamed_layers=info.spine_streamed_layers,
            spine_bytes_read=delta.spine_bytes_read,
            spine_read_wait_s=delta.spine_read_wait_s,
            remote_bytes_read=delta.remote_bytes_read,
            disk_tier_hits=delta.disk_tier_hits,
            disk_tier_misses=delta.disk_tier_misses,
            disk_tier_bytes_read=delta.disk_tier_bytes_read,
        )


_KEYS: tuple[str, ...] = tuple(f.name for f in fields(GenerationStats))
STATS_KEYS = _KEYS  # every key, in the order ``--json`` prints them

__all__ = ["STATS_KEYS", "EngineCounters", "EngineInfo", "GenerationStats"]
