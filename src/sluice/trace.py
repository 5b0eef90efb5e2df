"""Expert-routing traces and pin lists: the small file formats around the expert cache.

Trace (JSON Lines), one object per decode token::

    {"tok": 1, "layers": [[6, 8, 15, 23, 31, 37, 53, 63], [7, 16, ...], ...]}

``tok`` is the token's index, ``layers[i]`` the distinct expert ids that MoE layer ``i``
(MoE layers in model order) routed the token to, sorted ascending (set order, not rank
order). Every line has the same number of layers. Two optional fields, written by
``--trace-routing`` (older traces and other tools' traces lack them)::

    "weights": [[0.31, 0.08, ...], ...]   # layer i's router weight of each id in layers[i]
    "pred": [[], [3, 8, 15, ...], ...]    # what the engine's lookahead predicted for layer i

``weights[i][j]`` is the mixing weight (the router's top-k probability, renormalised where
the model does) of expert ``layers[i][j]``. ``pred[i]`` is the experts the lookahead
predicted for layer ``i`` before it ran (the next layer's router applied to layer ``i-1``'s
post-attention hidden state: what the engine prefetches), ``[]`` where there is no
prediction (the first layer, a layer after a dense one). A file has both on every line or
on none. Three more, written by ``--trace-routing`` since the replay learned them (each on
every line or on none)::

    "seq": 0          # the state slot of the sequence this row belongs to
    "step": 17        # the engine step (forward) that computed it: rows of one step share it
    "probs": [[0.02, 0.11, ...], ...]   # layer i's router probabilities over ALL its experts

Under concurrency (``--parallel``) the scheduler runs several sequences in one step, and
each row is one sequence's token: ``seq`` names it, ``step`` groups the rows the engine
looked up together (a speculative verification's rows share a step too). ``probs[i][e]`` is
the softmax of layer ``i``'s router logits at expert ``e`` (whatever the routing rule: it
ranks experts, e.g. the ones just below the top-k), from the engine's real routing.

Pin list (JSON), the experts a previous run used most, for ``experts.policy.Pinned``::

    {"format": "sluice-pins-v1", "pins": [[layer, expert], ...]}

Layer indices in both files are positions in a trace's ``layers`` list.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from .errors import SluiceError
from .outputs import open_output
from .storage.jsonfile import JSONFileError, read_json_path

PINS_FORMAT = "sluice-pins-v1"


class TraceFormatError(SluiceError, ValueError):
    """A trace or pin file is malformed; the message names the file, the line and the problem."""


@dataclass
class Trace:
    """A routing trace: ``steps[t][layer]`` is the sorted list of experts token ``t`` used."""

    steps: list[list[list[int]]]
    tok: list[int]
    source: str = ""
    weights: list[list[list[float]]] | None = None  # weights[t][layer][j]: router weight of steps[t][layer][j]
    pred: list[list[list[int]]] | None = None  # pred[t][layer]: the lookahead's prediction for that layer
    probs: list[list[list[float]]] | None = None  # probs[t][layer][e]: router probability of expert e
    seq: list[int] | None = None  # seq[t]: the state slot of row t's sequence
    step: list[int] | None = None  # step[t]: the engine step that computed row t

    @property
    def layers(self) -> int:
        return len(self.steps[0]) if self.steps else 0

    @property
    def tokens(self) -> int:
        return len(self.steps)

    @property
    def top_k(self) -> int:
        return max((len(ids) for step in self.steps for ids in step), default=0)

    @property
    def step_width(self) -> int:
        """The most experts one layer needs at once: the largest union of a step's rows (``top_k``
        for a trace of one sequence without speculation)."""
        if self.step is None:
            return self.top_k
        return max((len({e for t in g for e in self.steps[t][layer]}) for g in self.groups()
                    for layer in range(self.layers)), default=0)

    @property
    def experts(self) -> int:
        """Experts per layer as far as the trace shows: largest id + 1."""
        return 1 + max((e for step in self.steps for ids in step for e in ids), default=-1)

    @property
    def lookups(self) -> int:
        return sum(len(ids) for step in self.steps for ids in step)

    def slice(self, start: int | None, stop: int | None) -> Trace:
        def cut(x):
            return None if x is None else x[start:stop]
        return Trace(self.steps[start:stop], self.tok[start:stop], self.source, cut(self.weights), cut(self.pred),
                     cut(self.probs), cut(self.seq), cut(self.step))

    def rows(self, keep) -> Trace:
        """The rows ``keep`` (indices, in order) as a trace of their own."""
        def pick(x):
            return None if x is None else [x[i] for i in keep]
        return Trace(pick(self.steps), pick(self.tok), self.source, pick(self.weights), pick(self.pred),
                     pick(self.probs), pick(self.seq), pick(self.step))

    def sequences(self) -> list[int]:
        """The sequences (state slots) the rows belong to, ascending; ``[0]`` without ``seq``."""
        return sorted(set(self.seq)) if self.seq is not None else [0]

    def of_sequence(self, seq: int) -> Trace:
        """Only the rows of sequence ``seq`` (the whole trace when it names no sequences)."""
        if self.seq is None:
            return self
        return self.rows([i for i, s in enumerate(self.seq) if s == seq])

    def groups(self) -> list[list[int]]:
        """Row indices grouped by the engine step that computed them, in step order (a trace
        without ``step``: every row a step of its own). The replay looks a group up as one
        ``moe`` call per layer, as the engine did."""
        if self.step is None:
            return [[i] for i in range(len(self.steps))]
        by: dict[int, list[int]] = {}
        for i, s in enumerate(self.step):
            by.setdefault(s, []).append(i)
        return [by[s] for s in sorted(by)]

    def prediction_recall(self) -> float:
        """The share of the routed experts (layers with a prediction) that the lookahead predicted."""
        if self.pred is None:
            return 0.0
        hit = total = 0
        for step, pred in zip(self.steps, self.pred):
            for ids, p in zip(step, pred):
                if p:
                    hit += len(set(ids).intersection(p))
                    total += len(ids)
        return hit / total if total else 0.0

    def counts(self) -> Counter:
        """How often each ``(layer, expert)`` was used."""
        c: Counter = Counter()
        for step in self.steps:
            for layer, ids in enumerate(step):
                c.update((layer, e) for e in ids)
        return c

    def reuse(self) -> float:
        """Next-token same-layer reuse: the share of a token's experts (tokens 2..n) that the
        previous token (of the same sequence) used in the same layer."""
        inter = total = 0
        for seq in self.sequences():
            steps = self.of_sequence(seq).steps
            for prev, cur in zip(steps, steps[1:]):
                for a, b in zip(prev, cur):
                    inter += len(set(a).intersection(b))
                    total += len(b)
        return inter / total if total else 0.0


def _where(path: str, line: int) -> str:
    return f"{path}:{line}"


def _check_layers(layers, where: str, n_layers: int | None) -> list[list[int]]:
    if not isinstance(layers, list):
        raise TraceFormatError(f"{where}: \"layers\" must be a list of expert-id lists, got {type(layers).__name__}")
    if not layers:
        raise TraceFormatError(f"{where}: \"layers\" is empty")
    if n_layers is not None and len(layers) != n_layers:
        raise TraceFormatError(f"{where}: {len(layers)} layers, but earlier lines have {n_layers}")
    out = []
    for i, ids in enumerate(layers):
        if not isinstance(ids, list):
            raise TraceFormatError(f"{where}: layer {i}: expected a list of expert ids, got {type(ids).__name__}")
        if not ids:
            raise TraceFormatError(f"{where}: layer {i}: no experts")
        for e in ids:
            if isinstance(e, bool) or not isinstance(e, int):
                raise TraceFormatError(f"{where}: layer {i}: expert id {e!r} is not an integer")
            if e < 0:
                raise TraceFormatError(f"{where}: layer {i}: expert id {e} is negative")
        if len(set(ids)) != len(ids):
            dup = sorted(e for e, n in Counter(ids).items() if n > 1)
            raise TraceFormatError(f"{where}: layer {i}: expert id(s) {dup} repeated")
        out.append(sorted(ids))
    return out


def _check_weights(weights, layers: list[list[int]], where: str) -> list[list[float]]:
    if not isinstance(weights, list) or len(weights) != len(layers):
        raise TraceFormatError(f"{where}: \"weights\" must be a list of {len(layers)} lists of router weights")
    out = []
    for i, (w, ids) in enumerate(zip(weights, layers)):
        if not isinstance(w, list) or len(w) != len(ids):
            raise TraceFormatError(f"{where}: weights of layer {i}: expected {len(ids)} numbers, one per expert id")
        for v in w:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise TraceFormatError(f"{where}: weights of layer {i}: {v!r} is not a finite number")
        out.append([float(v) for v in w])
    return out


def _check_pred(pred, n_layers: int, where: str) -> list[list[int]]:
    if not isinstance(pred, list) or len(pred) != n_layers:
        raise TraceFormatError(f"{where}: \"pred\" must be a list of {n_layers} lists of expert ids")
    out = []
    for i, ids in enumerate(pred):
        if not isinstance(ids, list) or any(isinstance(e, bool) or not isinstance(e, int) or e < 0 for e in ids):
            raise TraceFormatError(f"{where}: pred of layer {i}: expected a list of non-negative expert ids")
        if len(set(ids)) != len(ids):
            raise TraceFormatError(f"{where}: pred of layer {i}: an expert id is repeated")
        out.append(sorted(ids))
    return out


def _check_probs(probs, n_layers: int, where: str) -> list[list[float]]:
    if not isinstance(probs, list) or len(probs) != n_layers:
        raise TraceFormatError(f"{where}: \"probs\" must be a list of {n_layers} lists of router probabilities")
    out = []
    for i, p in enumerate(probs):
        if not isinstance(p, list) or not p:
            raise TraceFormatError(f"{where}: probs of layer {i}: expected a list of numbers, one per expert")
        for v in p:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise TraceFormatError(f"{where}: probs of layer {i}: {v!r} is not a finite number")
        out.append([float(v) for v in p])
    return out


def _check_index(obj: dict, field: str, where: str) -> int:
    v = obj[field]
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise TraceFormatError(f"{where}: \"{field}\" must be a non-negative integer, got {v!r}")
    return v


_OPTIONAL = ("weights", "pred", "probs", "seq", "step")


def _in_id_order(weights: list[list[float]], layers: list[list[int]]) -> list[list[float]]:
    """``weights[i]`` (in the order of ``layers[i]``) reordered to ascending expert ids, the
    order of a trace's ``layers``."""
    return [[w[j] for j in sorted(range(len(ids)), key=ids.__getitem__)] for w, ids in zip(weights, layers)]


def parse_trace(lines: Iterable[str], source: str = "<trace>") -> Trace:
    """Parse trace lines; blank lines are skipped. Raises ``TraceFormatError`` on the first bad line."""
    steps: list[list[list[int]]] = []
    toks: list[int] = []
    weights: list = []
    preds: list = []
    probs: list = []
    seqs: list = []
    stepno: list = []
    extras: tuple[bool, ...] | None = None
    n_layers = None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = _where(source, number)
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceFormatError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        except RecursionError:
            raise TraceFormatError(f"{where}: nests JSON too deep (a record is 3 levels deep)") from None
        if not isinstance(obj, dict):
            raise TraceFormatError(f"{where}: expected a JSON object {{\"tok\": n, \"layers\": [...]}}, "
                                   f"got {type(obj).__name__}")
        for field in ("tok", "layers"):
            if field not in obj:
                raise TraceFormatError(f"{where}: missing field \"{field}\"")
        tok = obj["tok"]
        if isinstance(tok, bool) or not isinstance(tok, int):
            raise TraceFormatError(f"{where}: \"tok\" must be an integer, got {tok!r}")
        raw = obj["layers"]
        layers = _check_layers(raw, where, n_layers)
        n_layers = len(layers)
        has = tuple(f in obj for f in _OPTIONAL)
        if extras is not None and has != extras:
            odd = [f for f, a, b in zip(_OPTIONAL, has, extras) if a != b]
            raise TraceFormatError(f"{where}: {', '.join(odd)} on some lines but not on others")
        extras = has
        if has[0]:
            weights.append(_in_id_order(_check_weights(obj["weights"], raw, where), raw))
        if has[1]:
            preds.append(_check_pred(obj["pred"], n_layers, where))
        if has[2]:
            probs.append(_check_probs(obj["probs"], n_layers, where))
            n_e = len(probs[-1][0])
            for i, (p, ids) in enumerate(zip(probs[-1], layers)):
                if len(p) != n_e or ids[-1] >= n_e:
                    raise TraceFormatError(f"{where}: probs of layer {i}: {len(p)} numbers, but the layers have "
                                           f"{n_e} experts and expert {ids[-1]} is routed")
        if has[3]:
            seqs.append(_check_index(obj, "seq", where))
        if has[4]:
            stepno.append(_check_index(obj, "step", where))
        steps.append(layers)
        toks.append(tok)
    if not steps:
        raise TraceFormatError(f"{source}: the trace has no tokens")
    def keep(got, i):
        return got if extras[i] else None
    return Trace(steps, toks, source, keep(weights, 0), keep(preds, 1), keep(probs, 2), keep(seqs, 3),
                 keep(stepno, 4))


def read_trace(path: str | os.PathLike) -> Trace:
    with open(path, encoding="utf-8") as f:
        return parse_trace(f, os.fspath(path))


class TraceWriter:
    """Append one routing record per token to a JSONL trace (what ``--trace-routing FILE`` writes).

    ``write(token_index, layers)`` takes one list of expert ids per MoE layer, in any order;
    they are written sorted. Use as a context manager, or call ``close()``.
    """

    def __init__(self, path: str | os.PathLike, inputs: Iterable = (), what: str = "--trace-routing"):
        """``inputs``: files the trace must not overwrite (the model's; ``outputs.OutputClashError``)."""
        self.path = os.fspath(path)
        self._f = open_output(self.path, inputs, what)
        self._layers: int | None = None
        self._extras: tuple[bool, ...] | None = None
        self.records = 0

    def write(self, token_index: int, layers: list[list[int]], weights: list[list[float]] | None = None,
              pred: list[list[int]] | None = None, probs: list[list[float]] | None = None,
              seq: int | None = None, step: int | None = None) -> None:
        """``weights[i]`` (optional) in the order of ``layers[i]``; ``pred[i]`` the lookahead's
        prediction for layer ``i`` (``[]``: none); ``probs[i]`` layer ``i``'s router probability of
        every expert; ``seq`` the row's sequence (state slot), ``step`` the engine step that
        computed it. Each optional field on every record or on none."""
        where = f"{self.path}: token {token_index}"
        raw = [[int(e) for e in ids] for ids in layers]
        clean = _check_layers(raw, where, self._layers)
        self._layers = len(clean)
        obj: dict = {"tok": int(token_index)}
        if seq is not None:
            obj["seq"] = _check_index({"seq": seq}, "seq", where)
        if step is not None:
            obj["step"] = _check_index({"step": step}, "step", where)
        obj["layers"] = clean
        if weights is not None:
            w = _check_weights([[float(v) for v in wl] for wl in weights], raw, where)
            obj["weights"] = [[round(v, 6) for v in wl] for wl in _in_id_order(w, raw)]
        if pred is not None:
            obj["pred"] = _check_pred([[int(e) for e in p] for p in pred], len(clean), where)
        if probs is not None:
            p = _check_probs([[float(v) for v in pl] for pl in probs], len(clean), where)
            obj["probs"] = [[round(v, 6) for v in pl] for pl in p]
        has = (weights is not None, pred is not None, probs is not None, seq is not None, step is not None)
        if self._extras is not None and has != self._extras:
            odd = [f for f, a, b in zip(_OPTIONAL, has, self._extras) if a != b]
            raise TraceFormatError(f"{where}: {', '.join(odd)} given for some records but not for others")
        self._extras = has
        self._f.write(json.dumps(obj, separators=(", ", ": ")) + "\n")
        self.records += 1

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def write_trace(path: str | os.PathLike, trace: Trace) -> None:
    with TraceWriter(path) as w:
        for t, (tok, step) in enumerate(zip(trace.tok, trace.steps)):
            def at(x, t=t):
                return None if x is None else x[t]
            w.write(tok, step, at(trace.weights), at(trace.pred), at(trace.probs), at(trace.seq), at(trace.step))


# -- pin lists ------------------------------------------------------------------------------


def hottest(trace: Trace, n: int) -> list[tuple[int, int]]:
    """The ``n`` most used ``(layer, expert)`` keys of a trace (ties: lower layer, then expert)."""
    counts = trace.counts()
    return sorted(counts, key=lambda k: (-counts[k], k))[:n]


def write_pins(path: str | os.PathLike, pins: Iterable[tuple[int, int]], inputs: Iterable = (), **info) -> None:
    """Write a pin list; ``info`` (e.g. source, counts) is stored beside it for people, never read back.
    ``inputs``: files it must not overwrite (the trace read, a pin list read)."""
    obj = {"format": PINS_FORMAT, "pins": [[int(layer), int(e)] for layer, e in pins]}
    obj.update((k, v) for k, v in info.items() if k not in obj)
    with open_output(path, inputs, "--write-pins") as f:
        json.dump(obj, f)
        f.write("\n")


def read_pins(path: str | os.PathLike) -> list[tuple[int, int]]:
    path = os.fspath(path)
    try:
        obj = read_json_path(path, "pin list")  # size-capped, depth-checked (storage/jsonfile.py)
    except JSONFileError as e:
        raise TraceFormatError(str(e)) from None
    if not isinstance(obj, dict) or obj.get("format") != PINS_FORMAT:
        got = obj.get("format") if isinstance(obj, dict) else type(obj).__name__
        raise TraceFormatError(f"{path}: not a pin list (expected \"format\": \"{PINS_FORMAT}\", got {got!r})")
    pins = obj.get("pins")
    if not isinstance(pins, list):
        raise TraceFormatError(f"{path}: \"pins\" must be a list of [layer, expert] pairs")
    out = []
    for i, p in enumerate(pins):
        if (not isinstance(p, list) or len(p) != 2
                or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in p)):
            raise TraceFormatError(f"{path}: pins[{i}] = {p!r} is not a [layer, expert] pair of non-negative integers")
        out.append((p[0], p[1]))
    if len(set(out)) != len(out):
        raise TraceFormatError(f"{path}: a key appears twice in \"pins\"")
    return out
