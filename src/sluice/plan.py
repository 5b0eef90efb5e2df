"""The memory planner: a budget becomes spine residency, KV cache, buffers and expert cache.

Peak RSS = baseline (Python + torch, measured at load) + spine + per-sequence state (KV
cache for ``max_context`` positions, once per sequence that runs at once: ``--parallel``) +
activations and I/O buffers + expert cache slots.
The floor is what one step of one layer needs (``floor_slots``): the experts one decoding
sequence routes to in a layer (top-k) plus the lookahead's reads in flight, beside the spine
(resident or streamed) and the buffers of a prefill chunk small enough that its union fits
in the cache. Between the floor and one token's working set (top-k per MoE layer:
``working_set_budget``) the cache cannot keep experts across tokens: every token reads its
experts again, the prefill chunk shrinks until its union fits and a batch's union streams
through the cache (each expert released once computed). A budget below the floor is refused
with the breakdown.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from .errors import BudgetError, InvalidArgumentError
from .units import format_size

_MARGIN_BYTES = 48 << 20  # allocator slack, Python objects, thread stacks
_MARGIN_SHARE = 0.03
DEFAULT_PARALLEL = 4  # sequences at once by default, when the budget allows it


def margin_for(budget: int) -> int:
    return _MARGIN_BYTES + int(_MARGIN_SHARE * budget)


def budget_for(fixed: int, nbytes: int) -> int:
    """The smallest budget B with B - margin(B) >= fixed + nbytes."""
    return int((fixed + nbytes + _MARGIN_BYTES) / (1 - _MARGIN_SHARE)) + 1


@dataclass
class Plan:
    budget: int
    baseline: int
    spine_bytes: int
    state_bytes: int  # KV caches and recurrent states of all ``parallel`` sequences
    activation_bytes: int
    margin_bytes: int
    slot_bytes: int
    working_set: int
    total_experts: int
    cache_slots: int
    max_context: int
    prefill_chunk: int
    floor: int  # the smallest budget that runs (streaming the spine if needed)
    floor_resident: int = 0  # the smallest budget with the whole spine resident
    streamed_layers: list[int] = field(default_factory=list)
    spine_streamed_bytes: int = 0  # read per forward when layers are streamed
    stream_buffer_bytes: int = 0
    parallel: int = 1  # sequences that run at once, each with its own state for max_context positions
    seq_state_bytes: int = 0  # one sequence's state
    floor_slots: int = 0  # the cache slots the floor holds: one step of one layer (top-k + lookahead reads)
    working_set_budget: int = 0  # the smallest budget whose cache keeps one token's working set
    requested_chunk: int = 0  # the prefill chunk asked for (``prefill_chunk``: what the cache allows of it)
    reduced: bool = False  # the budget gave a cache below the working set (not --cache-experts): warn at load
    # the second pool (docs/architecture.md, "Backends"): bytes a device offers for expert weights,
    # and the expert slots placed there (beside the host cache, which reads still land in). 0 on CPU.
    device_bytes: int = 0
    device_slots: int = 0
    # the row store (rows/: token-keyed tables): the bytes it holds (the tables resident, or its row
    # cache), whether the tables are resident, and the tables' bytes
    row_bytes: int = 0
    rows_resident: bool = False
    row_table_bytes: int = 0

    @property
    def below_working_set(self) -> bool:
        """The cache holds less than one token's working set: no expert is kept across tokens."""
        return self.cache_slots < self.working_set

    @property
    def cache_bytes(self) -> int:
        return self.cache_slots * self.slot_bytes

    @property
    def device_cache_bytes(self) -> int:
        """The device pool's bytes that hold expert slots (0 on CPU)."""
        return self.device_slots * self.slot_bytes

    @property
    def fixed_bytes(self) -> int:
        """Everything but the expert cache and the safety margin."""
        return self.baseline + self.spine_bytes + self.state_bytes + self.activation_bytes + self.row_bytes

    def to_dict(self) -> dict:
        d = asdict(self)
        d["cache_bytes"] = self.cache_bytes
        d["device_cache_bytes"] = self.device_cache_bytes
        return d

    def slots_for(self, budget: int) -> int:
        """Cache slots a given budget gives (0 below the floor)."""
        if budget < self.floor:
            return 0
        free = budget - margin_for(budget) - self.fixed_bytes
        return max(0, min(self.total_experts, free // self.slot_bytes))

    def budget_for_slots(self, slots: int) -> int:
        """The smallest budget whose cache holds ``slots`` experts."""
        return budget_for(self.fixed_bytes, slots * self.slot_bytes)


def activation_bytes(hidden: int, intermediate: int, vocab: int, chunk: int, heads: int, max_ctx: int,
                     score_block: int) -> int:
    """Bound on transient tensors during a forward of ``chunk`` tokens.

    ``score_block``: the most bytes of attention scores the attention layers hold at once
    (``layers.attention.SCORE_BLOCK_BYTES``; the engine passes it, the planner knows no layers).
    """
    per_token = 4 * (24 * hidden + 4 * intermediate)
    scores = 3 * min(score_block, 4 * max(heads, 1) * chunk * max_ctx)
    logits = 4 * 4 * vocab
    upcast = 2 * (16 << 20)  # bounded half->fp32 weight chunks
    staging = 8 << 20  # aligned staging buffer for spine reads
    return chunk * per_token + scores + logits + upcast + staging


def step_slots(top_k: int, lookahead_slots: int, working_set: int) -> int:
    """Cache slots one step of one layer needs: one decoding sequence's top-k plus the lookahead's
    reads in flight (never more than one token's working set)."""
    return min(top_k + lookahead_slots, working_set)


def chunk_for(slots: int, *, chunk: int, top_k: int, layer_experts: int, lookahead_slots: int,
              working_set: int) -> int:
    """The largest prefill chunk (at most ``chunk``) whose union in one layer (at most
    ``min(layer_experts, chunk x top_k)`` experts) fits in ``slots`` beside the lookahead's reads.
    A cache of one token's working set or more keeps ``chunk``."""
    if slots >= working_set or top_k <= 0 or chunk <= 1:
        return chunk
    room = slots - lookahead_slots
    if min(layer_experts, chunk * top_k) <= room:
        return chunk
    return max(1, min(chunk, room // top_k))


def below_working_set_warning(plan: Plan) -> str | None:
    """The load-time warning of a plan whose cache is smaller than one token's working set."""
    if not (plan.reduced and plan.below_working_set):
        return None
    chunk = (f"; the prefill chunk shrinks from {plan.requested_chunk} to {plan.prefill_chunk} tokens"
             if plan.prefill_chunk < plan.requested_chunk else "")
    return (f"memory budget {format_size(plan.budget)} holds {plan.cache_slots} experts, less than one token's working "
            f"set ({plan.working_set}): the expert cache cannot keep experts across tokens, every token reads its "
            f"experts again{chunk}. {format_size(plan.working_set_budget)} keeps the working set")


def spread(layers: list[int], count: int) -> list[int]:
    """``count`` of ``layers`` spread evenly (streamed layers alternate with resident ones)."""
    if count <= 0:
        return []
    if count >= len(layers):
        return list(layers)
    step = len(layers) / count
    return sorted({layers[int(i * step)] for i in range(count)})


def make_plan(*, budget: int, baseline: int, spine_global: int, spine_layers: dict[int, int],
              stream_buffer: int, state_bytes: int, activations: int, slot_bytes: int, working_set: int,
              total_experts: int, top_k: int, max_context: int, prefill_chunk: int,
              cache_experts: int | None = None, stream_buffers: int = 2,
              max_resident_layers: int | None = None, parallel: int | None = 1,
              lookahead_slots: int = 0, layer_experts: int | None = None,
              activations_for: Callable[[int], int] | None = None, device_bytes: int = 0,
              row_bytes: int = 0) -> Plan:
    """Split ``budget`` between spine, per-sequence state, buffers and the expert cache.

    ``state_bytes`` is one sequence's state; ``parallel`` sequences get one each. ``parallel=None``
    takes the default: ``DEFAULT_PARALLEL``, or fewer when the budget cannot hold that many states
    without streaming more of the spine than one sequence would (or at all: then 1), or without
    one token's working set in the cache.
    ``lookahead_slots``: the prefetch reads the lookahead keeps in flight (part of the floor);
    ``layer_experts``: experts per MoE layer (bounds a prefill chunk's union; None: ``total_experts``);
    ``activations_for(chunk)``: the buffers of a prefill chunk (None: ``activations`` for any chunk),
    so that a chunk shrunk to fit a small cache also frees its buffers.
    ``device_bytes``: the device pool (0 on CPU), filled with up to that many bytes of expert
    slots (``Plan.device_slots``); it changes nothing of the host plan.
    ``row_bytes``: what the row store holds (``rows_for``), fixed like the baseline.
    """
    if device_bytes < 0:
        raise InvalidArgumentError(f"device memory for experts must be at least 0 bytes, got {device_bytes}")
    args = dict(budget=budget, baseline=baseline, spine_global=spine_global, spine_layers=spine_layers,
                stream_buffer=stream_buffer, state_bytes=state_bytes, activations=activations,
                slot_bytes=slot_bytes, working_set=working_set, total_experts=total_experts, top_k=top_k,
                max_context=max_context, prefill_chunk=prefill_chunk, cache_experts=cache_experts,
                stream_buffers=stream_buffers, max_resident_layers=max_resident_layers,
                lookahead_slots=lookahead_slots, layer_experts=layer_experts, activations_for=activations_for,
                device_bytes=device_bytes, row_bytes=row_bytes)
    if parallel is not None:
        if parallel < 1:
            raise InvalidArgumentError(f"parallel (--parallel) must be at least 1, got {parallel}")
        return _make_plan(parallel=parallel, **args)
    one = _make_plan(parallel=1, **args)
    for n in range(DEFAULT_PARALLEL, 1, -1):
        try:
            p = _make_plan(parallel=n, **args)
        except BudgetError:
            continue
        if p.streamed_layers == one.streamed_layers and not p.below_working_set:
            return p
    return one


ROW_SHARE = 10  # row tables stay resident when they fit in 1/ROW_SHARE of the budget above the floor


def rows_for(table_bytes: int, min_cache: int, budget: int, floor: int, cache: int | None = None) -> tuple[bool, int]:
    """(resident, bytes) of the row store: the tables resident when they fit in a tenth of what the
    budget leaves above the floor (``floor``: the plan's without the row store) and no row cache
    size is asked for (``cache``); else a row cache of ``cache`` bytes, or that tenth (at least
    ``min_cache``: one row per table; at most the tables)."""
    room = max(0, budget - floor) // ROW_SHARE
    if cache is None and table_bytes <= room:
        return True, table_bytes
    want = room if cache is None else cache
    return False, max(min_cache, min(table_bytes, want))


def max_parallel(limit: int = 1 << 16, **plan_args) -> int:
    """The most sequences ``make_plan`` fits in the budget at once (0 below the floor), up to ``limit``."""
    def fits(n: int) -> bool:
        try:
            make_plan(parallel=n, **plan_args)
        except BudgetError:
            return False
        return True

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _make_plan(*, budget: int, baseline: int, spine_global: int, spine_layers: dict[int, int],
               stream_buffer: int, state_bytes: int, activations: int, slot_bytes: int, working_set: int,
               total_experts: int, top_k: int, max_context: int, prefill_chunk: int,
               cache_experts: int | None, stream_buffers: int, max_resident_layers: int | None,
               parallel: int, lookahead_slots: int, layer_experts: int | None,
               activations_for: Callable[[int], int] | None, device_bytes: int = 0,
               row_bytes: int = 0) -> Plan:
    """``make_plan`` for a given number of sequences.

    Rule when the spine does not fit: keep the expert cache at one token's working set and
    make as many layers resident as possible, streaming the rest. A resident spine byte
    saves one byte read per token for certain; a cached expert byte beyond the working set
    saves less than that on average (each expert serves only a fraction of tokens).
    Below the working set (``working_set_budget``): the cache starts at the floor's slots
    (one step of one layer), as many layers as then fit are resident, and what is left goes
    to more slots, each with the largest prefill chunk whose union fits (``chunk_for``). A
    cache below the working set keeps no expert across tokens, so a resident layer is worth
    more than a slot there too.
    """
    margin = margin_for(budget)
    seq_state = state_bytes
    state_bytes = parallel * seq_state
    kv = (f"KV/state for {max_context} tokens {format_size(state_bytes)}" if parallel == 1 else
          f"KV/state for {parallel} sequences (--parallel) x {max_context} tokens {format_size(state_bytes)}")
    lower = "lower --max-context" if parallel == 1 else "lower --parallel or --max-context"
    all_layers = sorted(spine_layers)
    spine_all = spine_global + sum(spine_layers.values())
    acts_for = activations_for or (lambda chunk: activations)
    fit = dict(chunk=prefill_chunk, top_k=top_k,
               layer_experts=total_experts if layer_experts is None else layer_experts,
               lookahead_slots=lookahead_slots, working_set=working_set)
    if cache_experts is not None and cache_experts < top_k:
        raise BudgetError(
            f"--cache-experts {cache_experts} is below the {top_k} experts one layer uses at once; "
            f"use at least {top_k} (one token's working set is {working_set})"
        )
    buffers = stream_buffers * stream_buffer if all_layers else 0
    fixed0 = baseline + state_bytes + row_bytes  # what every plan holds besides spine, buffers and cache
    ws_resident = budget_for(fixed0 + activations + spine_all, working_set * slot_bytes)
    ws_budget = min(ws_resident, budget_for(fixed0 + activations + spine_global + buffers, working_set * slot_bytes))
    floor_slots = step_slots(top_k, lookahead_slots, working_set)
    floor_chunk = chunk_for(floor_slots, **fit)
    floor_base = fixed0 + acts_for(floor_chunk)
    floor_resident = budget_for(floor_base + spine_all, floor_slots * slot_bytes)
    floor = min(floor_resident, budget_for(floor_base + spine_global + buffers, floor_slots * slot_bytes))
    if floor_resident >= ws_budget:  # there the working set comes first (layers streamed): resident with it
        floor_resident = ws_resident
    reduced = cache_experts is None and budget < ws_budget  # between the floor and the working set
    if cache_experts is not None:
        want_slots = min(cache_experts, total_experts)
    else:
        want_slots = floor_slots if reduced else working_set
    chunk = chunk_for(want_slots, **fit) if reduced else prefill_chunk  # --cache-experts: its union streams through
    acts = acts_for(chunk)
    base = fixed0 + acts
    streamed: list[int] = []
    forced = max_resident_layers is not None and max_resident_layers < len(all_layers)
    if not forced and budget >= budget_for(base + spine_all, want_slots * slot_bytes):
        spine_bytes = spine_all
    else:
        if budget < floor:
            chunk_note = (f" (prefill chunk {floor_chunk} of {prefill_chunk} tokens, so that its experts fit)"
                          if floor_chunk < prefill_chunk else "")
            raise BudgetError(
                f"memory budget {format_size(budget)} is below the floor {format_size(floor)} for this model: "
                f"baseline {format_size(baseline)} + spine {format_size(spine_global)} resident (embeddings, head, "
                f"norms) + {stream_buffers} layers' spine buffers {format_size(buffers)} + one step of one layer's "
                f"experts (top-{top_k} + {lookahead_slots} lookahead reads = {floor_slots} x {format_size(slot_bytes)} "
                f"= {format_size(floor_slots * slot_bytes)}) + {kv} + buffers "
                f"{format_size(acts_for(floor_chunk) + margin_for(floor))}{chunk_note}. Raise --memory to at least "
                f"{format_size(floor)}, or {lower} ({format_size(ws_budget)} keeps one token's working set of "
                f"{working_set} experts)"
            )
        free = budget - margin - base - spine_global - buffers - want_slots * slot_bytes
        if free < 0:
            raise BudgetError(
                f"memory budget {format_size(budget)} cannot hold a cache of {want_slots} experts: that needs "
                f"{format_size(budget_for(base + spine_global + buffers, want_slots * slot_bytes))}. "
                "Raise --memory or lower --cache-experts"
            )
        resident = 0
        for layer in sorted(all_layers, key=lambda i: spine_layers[i]):
            if spine_layers[layer] > free or (forced and resident >= max_resident_layers):
                break
            free -= spine_layers[layer]
            resident += 1
        streamed = spread(all_layers, len(all_layers) - resident)
        spine_bytes = spine_global + sum(spine_layers[i] for i in all_layers if i not in streamed) + buffers
    fixed = base + spine_bytes
    if cache_experts is not None:
        slots = want_slots
        need = budget_for(fixed, slots * slot_bytes)
        if need > budget:
            raise BudgetError(
                f"memory budget {format_size(budget)} cannot hold a cache of {slots} experts: that needs "
                f"{format_size(need)} ({format_size(fixed)} for baseline, spine, KV and buffers + {slots} x "
                f"{format_size(slot_bytes)} per expert). Raise --memory or lower --cache-experts"
            )
    elif reduced:
        rest = fixed - acts  # the most slots whose chunk's buffers still fit (both grow with the slots)
        lo, hi = want_slots, total_experts + 1  # fits(lo), not fits(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if budget_for(rest + acts_for(chunk_for(mid, **fit)), mid * slot_bytes) <= budget:
                lo = mid
            else:
                hi = mid
        slots, chunk = lo, chunk_for(lo, **fit)
        acts = acts_for(chunk)
    else:
        slots = min(total_experts, (budget - margin - fixed) // slot_bytes)
    return Plan(budget=budget, baseline=baseline, spine_bytes=spine_bytes, state_bytes=state_bytes,
                activation_bytes=acts, margin_bytes=margin, slot_bytes=slot_bytes, working_set=working_set,
                total_experts=total_experts, cache_slots=int(slots), max_context=max_context,
                prefill_chunk=chunk, floor=floor, floor_resident=floor_resident,
                streamed_layers=streamed,
                spine_streamed_bytes=sum(spine_layers[i] for i in streamed),
                stream_buffer_bytes=buffers if streamed else 0, parallel=parallel, seq_state_bytes=seq_state,
                floor_slots=floor_slots, working_set_budget=ws_budget, requested_chunk=prefill_chunk, reduced=reduced,
                device_bytes=device_bytes, device_slots=min(total_experts, device_bytes // slot_bytes),
                row_bytes=row_bytes)
