"""The model runner: executes steps of sequences, each at its own positions on its own state.

The generator (``generation.py``) and the speculative verifier see the model only through
this interface; the engine builds the runner over its parts (model, expert provider and
cache, checkpoint, spine streamer, routing trace) and owns it.

A step is a list of ``SeqWork`` items: a sequence's state slot (``SeqState``), the tokens to
run at positions ``start..`` (a prefill chunk, a decode token, or a token plus a speculative
draft) and how many of the last positions' logits to return. Today ``step`` runs the items
one after another, each split into prefill chunks exactly as when it runs alone, and the
engine holds one state slot; continuous batching runs the items of a step as one forward
(docs/architecture.md, "Engine: scheduler and model runner").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .errors import InvalidArgumentError
from .stats import EngineCounters, EngineInfo

TORCH_SERIAL_TOKENS = 64


class SeqState:
    """A sequence's state slot: its KV caches and recurrent states, and the tokens they hold.

    Positions continue where the state ends (``length``); ``rewind`` cuts back (a KV cache to
    any length, a recurrent state only to a position it kept a snapshot of with ``mark``).
    """

    def __init__(self, model_state, slot: int):
        self.model_state = model_state  # the family's State (models/base.py)
        self.slot = slot

    @property
    def max_context(self) -> int:
        return self.model_state.max_ctx

    @property
    def length(self) -> int:
        """Positions the state holds."""
        return self.model_state.length

    @property
    def tokens(self) -> list[int]:
        """The tokens at positions 0..length (a copy)."""
        return self.model_state.tokens[: self.model_state.length]

    @property
    def recurrent(self) -> bool:
        """True if some layer keeps recurrent state (rolling back needs a snapshot)."""
        return self.model_state.recurrent

    def rewind(self, n: int) -> int:
        """Roll back to the first ``n`` positions, or fewer if a layer cannot; returns the length."""
        return self.model_state.rewind(n)

    def mark(self) -> None:
        """Keep a snapshot of every recurrent layer at the current length (costs nothing)."""
        self.model_state.mark()


@dataclass
class SeqWork:
    """One sequence's part of a step: forward ``tokens`` at positions ``start..`` on ``seq``."""

    seq: SeqState
    tokens: list[int]
    start: int  # must equal seq.length: a step continues the state (rewind first)
    last_n: int = 1  # return the logits of the last n positions (0: none)
    decoding: bool = False  # the sequence is past its prefill: its lookups count toward hit_rate etc.
    record_routing: bool = False  # return each MoE layer's routed expert ids, weights and lookahead predictions


@dataclass
class SeqResult:
    logits: torch.Tensor | None  # [last_n, V] fp32, None when last_n == 0
    routing: dict[int, torch.Tensor] | None = None  # MoE layer -> expert ids [len(tokens), K]
    weights: dict[int, torch.Tensor] | None = None  # MoE layer -> their mixing weights [len(tokens), K]
    predicted: dict[int, torch.Tensor] | None = None  # MoE layer -> the lookahead's prediction [len(tokens), K]


class ModelRunner:
    """Runs forward steps on the engine's model for sequences with their own state slots."""

    def __init__(self, model, experts, cache, checkpoint, spine, *, max_context: int, prefill_chunk: int,
                 threads: int, tokenizer, eos_token_ids: list[int], moe_layers: list[int], trace=None,
                 info: Callable[[], EngineInfo], slots: int = 1):
        self._model, self._experts, self._cache = model, experts, cache
        self._checkpoint, self._spine, self._trace = checkpoint, spine, trace
        self._info = info
        self.prefill_chunk = prefill_chunk
        self.threads = threads
        self.tokenizer = tokenizer  # None for a checkpoint without tokenizer.json
        self.eos_token_ids = list(eos_token_ids)
        self.moe_layers = list(moe_layers)
        self.slots = [SeqState(model.new_state(max_context), i) for i in range(slots)]
        self._forwards = 0
        self._tokens = 0

    # -- execution -------------------------------------------------------------------------

    def step(self, work: list[SeqWork]) -> list[SeqResult]:
        """Run one step: every item on its own state; one ``SeqResult`` per item, in order."""
        seen: set[int] = set()
        for w in work:
            if id(w.seq) in seen:
                raise InvalidArgumentError(f"state slot {w.seq.slot} appears twice in one step")
            seen.add(id(w.seq))
            self._check(w)
        with torch.inference_mode():
            return [self._run(w) for w in work]

    def run(self, seq: SeqState, tokens: list[int], start: int, last_n: int = 1, *, decoding: bool = False,
            record_routing: bool = False) -> torch.Tensor | None:
        """A step of one sequence; its logits (``step`` for the routing too)."""
        return self.step([SeqWork(seq, tokens, start, last_n, decoding, record_routing)])[0].logits

    @staticmethod
    def _check(w: SeqWork) -> None:
        if w.start != w.seq.length:
            raise InvalidArgumentError(f"tokens at position {w.start}, but the state holds {w.seq.length} "
                                       "positions (rewind the state first)")
        if w.start + len(w.tokens) > w.seq.max_context:
            raise InvalidArgumentError(
                f"positions up to {w.start + len(w.tokens)} exceed max_context {w.seq.max_context}")
        if not 0 <= w.last_n <= len(w.tokens):
            raise InvalidArgumentError(f"last_n={w.last_n} with {len(w.tokens)} tokens")

    def _run(self, w: SeqWork) -> SeqResult:
        """Forward the tokens in prefill chunks; logits [last_n, V] of the last positions."""
        state, ids, start = w.seq.model_state, w.tokens, w.start
        outs: list[torch.Tensor] = []
        routed: dict[int, list[torch.Tensor]] | None = {} if w.record_routing else None
        weighed: dict[int, list[torch.Tensor]] = {}
        predicted: dict[int, list[torch.Tensor]] = {}
        chunks = 0
        chunk = self.prefill_chunk
        first_logit = len(ids) - w.last_n
        self._experts.decoding = w.decoding
        try:
            for c0 in range(0, len(ids), chunk):
                part = ids[c0 : c0 + chunk]
                # steps of up to 64 tokens (decode, speculation, short prompts) run torch single-threaded:
                # their ops are too small to share, and an OpenMP barrier stalls the whole step whenever
                # another process holds the other core (measured: index_add_ on [15, 1024] took 76 ms);
                # the C kernels split the large matrix products with their own work-claiming pool.
                torch.set_num_threads(1 if len(part) <= TORCH_SERIAL_TOKENS else self.threads)
                self._experts.tick()
                if routed is not None:
                    self._experts.routing, self._experts.predicted_routing = {}, {}
                h = self._model.forward(torch.tensor(part, dtype=torch.long), state, start + c0)
                state.length = start + c0 + len(part)
                state.tokens[start + c0 :] = part
                self._forwards += 1
                self._tokens += len(part)
                if routed is not None:
                    chunks += 1
                    for layer, (r, wt) in self._experts.routing.items():
                        routed.setdefault(layer, []).append(r)
                        weighed.setdefault(layer, []).append(wt)
                    for layer, r in self._experts.predicted_routing.items():
                        predicted.setdefault(layer, []).append(r)
                if c0 + len(part) > first_logit and w.last_n:
                    outs.append(self._model.logits(h[max(0, first_logit - c0) :]))
        finally:
            self._experts.decoding = False
            self._experts.routing = self._experts.predicted_routing = None
        logits = (torch.cat(outs) if len(outs) > 1 else outs[0]) if outs else None
        if routed is None:
            return SeqResult(logits)

        def joined(parts: dict[int, list[torch.Tensor]]) -> dict[int, torch.Tensor]:
            # a layer predicted in some chunks only (its router was still streaming) has no prediction
            return {layer: torch.cat(r) if len(r) > 1 else r[0] for layer, r in parts.items() if len(r) == chunks}

        return SeqResult(logits, joined(routed), joined(weighed), joined(predicted))

    # -- routing trace ---------------------------------------------------------------------

    @property
    def tracing(self) -> bool:
        """True when the engine writes a routing trace (``--trace-routing``)."""
        return self._trace is not None

    def write_trace(self, start: int, result: SeqResult, n: int) -> None:
        """Append the routing of positions start..start+n (the rows a step kept) to the trace: expert
        ids, their mixing weights and what the lookahead predicted for each layer (``[]``: nothing)."""
        moe, routing, weights, predicted = self.moe_layers, result.routing, result.weights, result.predicted or {}
        for i in range(n):
            self._trace.write(start + i, [routing[layer][i].tolist() for layer in moe],
                              [weights[layer][i].tolist() for layer in moe],
                              [predicted[layer][i].tolist() if layer in predicted else [] for layer in moe])
        self._trace.flush()

    # -- counters --------------------------------------------------------------------------

    def counters(self) -> EngineCounters:
        """A snapshot of the engine's counters since load (subtract two for a delta)."""
        c = self._experts.counters
        spine = self._spine.stats if self._spine is not None else None
        io = self._checkpoint.stats
        return EngineCounters(
            expert_lookups=c.lookups, expert_hits=c.hits, expert_misses=c.misses,
            prefill_lookups=c.prefill_lookups, demand_reads=c.demand_reads, prefetch_reads=c.prefetch_reads,
            prefetch_used=c.prefetch_used, prefetch_cancelled=c.prefetch_cancelled,
            lookahead_predictions=c.predicted, lookahead_hits=c.predicted_hits,
            read_wait_s=c.read_wait_s, expert_compute_s=c.compute_s,
            evictions=self._experts.evictions,
            bytes_read=self._checkpoint.stats.bytes_read + self._experts.bytes_read_elsewhere,
            spine_bytes_read=spine.bytes_read if spine is not None else 0,
            spine_read_wait_s=spine.wait_s if spine is not None else 0.0,
            forwards=self._forwards, tokens_forwarded=self._tokens,
            remote_bytes_read=io.remote_bytes, disk_tier_hits=io.tier_hits, disk_tier_misses=io.tier_misses,
            disk_tier_bytes_read=io.tier_bytes,
        )

    def info(self) -> EngineInfo:
        """What the engine reports in every generation's stats (budget, cache, load time, ...)."""
        return self._info()


__all__ = ["ModelRunner", "SeqResult", "SeqState", "SeqWork", "TORCH_SERIAL_TOKENS"]
