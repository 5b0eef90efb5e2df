"""The model runner: executes steps of sequences, each at its own positions on its own state.

The generator (``generation.py``) and the speculative verifier see the model only through
this interface; the engine builds the runner over its parts (the model and the expert side,
typed by the ``Model`` and ``Experts`` protocols, the lookahead, checkpoint, spine streamer,
routing trace) and owns it.

A step is a list of ``SeqWork`` items: a sequence's state slot (``SeqState``), the tokens to
run at positions ``start..`` (a prefill chunk, a decode token, or a token plus a speculative
draft) and how many of the last positions' logits to return. ``step`` runs the items as
one forward: one ``layers.context.ForwardContext`` (token ids, each sequence's ``Segment`` of
rows, positions and state, what to record, the lookahead) handed to ``model.forward`` and by
the model to each MoE layer's ``experts.moe``. Attention per sequence on its own state and
positions, everything per-row (norms, routers, experts, MLPs, head) on all rows at once, so
an expert two sequences route to is read and computed once. An item longer than
``prefill_chunk`` is split into the chunks it gets alone (``SeqWork.pieces``; forward k of the step holds chunk k
of every item), so with batch-invariant kernels each item's logits are bit-identical to its
solo run (docs/architecture.md, "Engine: scheduler and model runner").

Ids known early: a forward's token ids decide some experts outright (hash-routed layers,
``Model.certain_experts``). The runner puts them in the forward's context and, with
``certain_reads``, has the expert side read them before the embedding runs, and the next
forward's (the step's next prefill chunk) while this one computes (``ExpertInterface.read_certain``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from .errors import ExpertReadError, InvalidArgumentError
from .layers.context import ForwardContext, Recording, Segment
from .stats import EngineCounters, EngineInfo

TORCH_SERIAL_TOKENS = 64


class Model(Protocol):
    """What the runner calls on the family's model (``models.base.CausalLM``)."""

    def new_state(self, max_ctx: int): ...

    def forward(self, ctx: ForwardContext) -> torch.Tensor: ...  # final hidden [T, H]

    def logits(self, h: torch.Tensor) -> torch.Tensor: ...


class Experts(Protocol):
    """What the runner calls on the expert side (``experts.interface.ExpertInterface``)."""

    counters: object

    def begin(self, ctx: ForwardContext) -> None: ...

    def read_certain(self, certain: dict[int, torch.Tensor], rows: int, ahead: bool = False) -> None: ...

    @property
    def evictions(self) -> int: ...

    @property
    def bytes_read_elsewhere(self) -> int: ...


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
    # the tokens the sequence runs in its next step, when known now (the scheduler: the rest of a
    # prompt cut by the step's token budget); what is keyed by token ids is read for them ahead
    next_tokens: list[int] | None = None

    def piece(self, start: int, stop: int) -> "SeqWork":
        """Tokens ``start..stop`` of this work as work of their own: at positions ``self.start +
        start..``, returning the logits of those of this work's last ``last_n`` positions that
        fall in the piece. The one place a step's work is cut (the scheduler's token budget,
        the runner's prefill chunks)."""
        stop = min(stop, len(self.tokens))
        first_logit = len(self.tokens) - self.last_n  # this work's logits are of positions first_logit..
        return SeqWork(self.seq, self.tokens[start:stop], self.start + start, max(0, stop - max(start, first_logit)),
                       self.decoding, self.record_routing)

    def pieces(self, chunk: int) -> list["SeqWork"]:
        """This work cut into pieces of at most ``chunk`` tokens (one piece if it fits, none if empty)."""
        if not self.tokens:
            return []
        if len(self.tokens) <= chunk:
            return [self]
        return [self.piece(c, c + chunk) for c in range(0, len(self.tokens), chunk)]


@dataclass
class SeqResult:
    logits: torch.Tensor | None  # [last_n, V] fp32, None when last_n == 0
    routing: dict[int, torch.Tensor] | None = None  # MoE layer -> expert ids [len(tokens), K]
    weights: dict[int, torch.Tensor] | None = None  # MoE layer -> their mixing weights [len(tokens), K]
    predicted: dict[int, torch.Tensor] | None = None  # MoE layer -> the lookahead's prediction [len(tokens), K]
    probs: dict[int, torch.Tensor] | None = None  # MoE layer -> router probabilities of all experts [len(tokens), E]
    step: int | None = None  # the runner's step count when this item ran (rows of one step share it)
    # the step failed this item (an expert its rows needed could not be read; the others ran):
    # its state is as before the step and the other fields are None
    error: BaseException | None = None


class ModelRunner:
    """Runs forward steps on the engine's model for sequences with their own state slots."""

    def __init__(self, model: Model, experts: Experts, checkpoint, spine, *, max_context: int, prefill_chunk: int,
                 threads: int, tokenizer, eos_token_ids: list[int], moe_layers: list[int], trace=None,
                 info: Callable[[], EngineInfo], slots: int = 1, lookahead=None, certain_reads: bool = True):
        self._model, self._experts, self._lookahead = model, experts, lookahead
        # the experts the token ids decide (None: a model that cannot tell), read early if asked
        self._certain_of = getattr(model, "certain_experts", None)
        self.certain_reads = certain_reads
        self._checkpoint, self._spine, self._trace = checkpoint, spine, trace
        self._info = info
        self.prefill_chunk = prefill_chunk
        self.threads = threads
        self.tokenizer = tokenizer  # None for a checkpoint without tokenizer.json
        self.eos_token_ids = list(eos_token_ids)
        self.moe_layers = list(moe_layers)
        self.slots = [SeqState(model.new_state(max_context), i) for i in range(slots)]
        self._forwards = 0
        self._steps = 0  # steps run (a step is one or more forwards), numbering the trace's rows
        self._tokens = 0
        self._rows: list[tuple[int, int, int, int]] = []  # the running forward's (item, first row, end row, offset)

    # -- execution -------------------------------------------------------------------------

    def step(self, work: list[SeqWork]) -> list[SeqResult]:
        """Run one step: every item on its own state; one ``SeqResult`` per item, in order.

        The items run as one forward (several when an item is longer than ``prefill_chunk``:
        forward k holds chunk k of every item that has one, so each item is split exactly as
        when it runs alone). A step either happens for an item or not: on an error every state
        returns to where it was. An expert read that fails (``ExpertReadError``) fails only the
        items whose rows routed to that expert: the others are re-run without them, and the
        failed ones get a ``SeqResult`` with ``error`` set. A step of one item raises instead.
        """
        seen: set[int] = set()
        for w in work:
            if id(w.seq) in seen:
                raise InvalidArgumentError(f"state slot {w.seq.slot} appears twice in one step")
            seen.add(id(w.seq))
            self._check(w)
        with torch.inference_mode():
            return self._step(list(work))

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

    def _step(self, work: list[SeqWork]) -> list[SeqResult]:
        saved = [w.seq.model_state.save() for w in work]
        self._rows = []
        try:
            return self._run_forwards(work)
        except BaseException as err:
            for w, state in zip(work, saved):
                w.seq.model_state.restore(state)
            failed = self._failed(err)
            if len(work) == 1 or not failed:
                raise
            error = err
        survivors = [w for i, w in enumerate(work) if i not in failed]
        rerun = iter(self._step(survivors) if survivors else ())
        return [SeqResult(None, error=error) if i in failed else next(rerun) for i in range(len(work))]

    def _failed(self, err: BaseException) -> set[int]:
        """The items of the forward that raised ``err`` whose rows needed the expert it could not read."""
        rows = getattr(err, "rows", None) if isinstance(err, ExpertReadError) else None
        if not rows:
            return set()
        return {i for i, r0, r1, _ in self._rows if any(r0 <= r < r1 for r in rows)}

    def _run_forwards(self, work: list[SeqWork]) -> list[SeqResult]:
        """Forward the items' tokens, chunk k of each item in forward k (``SeqWork.pieces``); logits
        of each item's last ``last_n`` positions, and its routing when asked."""
        pieces = [w.pieces(self.prefill_chunk) for w in work]
        n_forwards = max((len(p) for p in pieces), default=0)
        outs: list[list[torch.Tensor]] = [[] for _ in work]
        record = any(w.record_routing for w in work)
        routed: list[dict[int, list[torch.Tensor]]] = [{} for _ in work]
        weighed: list[dict[int, list[torch.Tensor]]] = [{} for _ in work]
        predicted: list[dict[int, list[torch.Tensor]]] = [{} for _ in work]
        probed: list[dict[int, list[torch.Tensor]]] = [{} for _ in work]
        self._steps += 1
        chunks = [0] * len(work)
        offsets = [0] * len(work)
        certain_of, upcoming = self._certain_of, None
        for k in range(n_forwards):
            segments: list[Segment] = []
            rows: list[tuple[int, int, int, int]] = []  # (item, first row, end row, its token offset)
            parts: list[SeqWork] = []
            r = 0
            for i, p in enumerate(pieces):
                if k < len(p):
                    part = p[k]
                    n = len(part.tokens)
                    segments.append(Segment(r, r + n, part.start, part.seq.model_state, part.decoding))
                    rows.append((i, r, r + n, offsets[i]))
                    parts.append(part)
                    offsets[i] += n
                    r += n
            self._rows = rows
            ids = [t for part in parts for t in part.tokens]
            # each segment's next chunk (the step's next forward, or for its last piece the next
            # step's, when the scheduler knows it), for what is read ahead by token ids
            nxt = [list(pieces[i][k + 1].tokens) if k + 1 < len(pieces[i]) else list(work[i].next_tokens or [])
                   for i, *_ in rows]
            nxt = nxt if any(nxt) else None
            ctx = ForwardContext(torch.tensor(ids, dtype=torch.long), segments,
                                 record=Recording() if record else None, lookahead=self._lookahead,
                                 next_tokens=nxt)
            # steps of up to 64 tokens (decode, speculation, short prompts) run torch single-threaded:
            # their ops are too small to share, and an OpenMP barrier stalls the whole step whenever
            # another process holds the other core (measured: index_add_ on [15, 1024] took 76 ms);
            # the C kernels split the large matrix products with their own work-claiming pool.
            torch.set_num_threads(1 if r <= TORCH_SERIAL_TOKENS else self.threads)
            if certain_of is not None:
                ctx.certain = upcoming if upcoming is not None else certain_of(ctx.token_ids)
                upcoming = None
            self._experts.begin(ctx)
            if ctx.certain and self.certain_reads:
                self._experts.read_certain(ctx.certain, r)
                if k + 1 < n_forwards:  # the next chunk's, read as this forward leaves their layers
                    following = [t for p in pieces if k + 1 < len(p) for t in p[k + 1].tokens]
                    upcoming = certain_of(torch.tensor(following, dtype=torch.long))
                    self._experts.read_certain(upcoming, len(following), ahead=True)
                elif nxt:  # the step's last forward: the next step's chunks, when the scheduler knows them
                    following = [t for toks in nxt for t in toks]
                    self._experts.read_certain(certain_of(torch.tensor(following, dtype=torch.long)),
                                               len(following), ahead=True)
            h = self._model.forward(ctx)
            for (_i, r0, r1, _off), part in zip(rows, parts):
                state = part.seq.model_state
                state.length = part.start + r1 - r0
                state.tokens[part.start :] = part.tokens
            self._forwards += 1
            self._tokens += r
            if record:
                for i, r0, r1, _ in rows:
                    if not work[i].record_routing:
                        continue
                    chunks[i] += 1
                    for layer, (lids, wt, probs) in ctx.record.routing.items():
                        routed[i].setdefault(layer, []).append(lids[r0:r1])
                        weighed[i].setdefault(layer, []).append(wt[r0:r1])
                        if probs is not None:
                            probed[i].setdefault(layer, []).append(probs[r0:r1])
                    for layer, lids in ctx.record.predicted.items():
                        predicted[i].setdefault(layer, []).append(lids[r0:r1])
            want = [(i, r1 - part.last_n, r1) for (i, r0, r1, _), part in zip(rows, parts) if part.last_n]
            if want:
                picked = h[want[0][1] : want[0][2]] if len(want) == 1 else torch.cat([h[a:b] for _, a, b in want])
                logits = self._model.logits(picked)
                at = 0
                for i, a, b in want:
                    outs[i].append(logits[at : at + b - a])
                    at += b - a
        results = []
        for i, w in enumerate(work):
            logits = (torch.cat(outs[i]) if len(outs[i]) > 1 else outs[i][0]) if outs[i] else None
            if not w.record_routing:
                results.append(SeqResult(logits))
                continue

            def joined(parts: dict[int, list[torch.Tensor]], n: int = chunks[i]) -> dict[int, torch.Tensor]:
                # a layer predicted in some chunks only (its router was still streaming) has no prediction
                return {layer: torch.cat(r) if len(r) > 1 else r[0] for layer, r in parts.items() if len(r) == n}

            results.append(SeqResult(logits, joined(routed[i]), joined(weighed[i]), joined(predicted[i]),
                                     joined(probed[i]), step=self._steps))
        return results

    # -- routing trace ---------------------------------------------------------------------

    @property
    def tracing(self) -> bool:
        """True when the engine writes a routing trace (``--trace-routing``)."""
        return self._trace is not None

    def write_trace(self, start: int, result: SeqResult, n: int, seq: int = 0) -> None:
        """Append the routing of positions start..start+n (the rows a step kept) of sequence ``seq``
        (its state slot) to the trace: the step that computed them, expert ids, their mixing
        weights, what the lookahead predicted for each layer (``[]``: nothing) and the router's
        probabilities of all experts."""
        moe, routing, weights, predicted = self.moe_layers, result.routing, result.weights, result.predicted or {}
        probs = result.probs if result.probs and all(layer in result.probs for layer in moe) else None
        for i in range(n):
            self._trace.write(start + i, [routing[layer][i].tolist() for layer in moe],
                              [weights[layer][i].tolist() for layer in moe],
                              [predicted[layer][i].tolist() if layer in predicted else [] for layer in moe],
                              [probs[layer][i].tolist() for layer in moe] if probs is not None else None,
                              seq=seq, step=result.step if result.step is not None else 0)
        self._trace.flush()

    # -- counters --------------------------------------------------------------------------

    def counters(self) -> EngineCounters:
        """A snapshot of the engine's counters since load (subtract two for a delta)."""
        spine = self._spine.stats if self._spine is not None else None
        io = self._checkpoint.stats
        return EngineCounters.collect(
            {"experts": self._experts.counters, "spine": spine, "io": io,
             "rows": rows.stats if (rows := getattr(self._model, "rows", None)) is not None else None},
            evictions=self._experts.evictions, bytes_read=io.bytes_read + self._experts.bytes_read_elsewhere,
            forwards=self._forwards, tokens_forwarded=self._tokens)

    def info(self) -> EngineInfo:
        """What the engine reports in every generation's stats (budget, cache, load time, ...)."""
        return self._info()


__all__ = ["ModelRunner", "SeqResult", "SeqState", "SeqWork", "TORCH_SERIAL_TOKENS"]
