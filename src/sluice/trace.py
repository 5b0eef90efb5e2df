"""Expert-routing traces and pin lists: the small file formats around the expert cache.

Trace (JSON Lines), one object per decode token::

    {"tok": 1, "layers": [[6, 8, 15, 23, 31, 37, 53, 63], [7, 16, ...], ...]}

``tok`` is the token's index, ``layers[i]`` the distinct expert ids that MoE layer ``i``
(MoE layers in model order) routed the token to, sorted ascending (set order, not rank
order; no router scores). Every line has the same number of layers.

Pin list (JSON), the experts a previous run used most, for ``experts.policy.Pinned``::

    {"format": "sluice-pins-v1", "pins": [[layer, expert], ...]}

Layer indices in both files are positions in a trace's ``layers`` list.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from .errors import SluiceError

PINS_FORMAT = "sluice-pins-v1"


class TraceFormatError(SluiceError, ValueError):
    """A trace or pin file is malformed; the message names the file, the line and the problem."""


@dataclass
class Trace:
    """A routing trace: ``steps[t][layer]`` is the sorted list of experts token ``t`` used."""

    steps: list[list[list[int]]]
    tok: list[int]
    source: str = ""

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
    def experts(self) -> int:
        """Experts per layer as far as the trace shows: largest id + 1."""
        return 1 + max((e for step in self.steps for ids in step for e in ids), default=-1)

    @property
    def lookups(self) -> int:
        return sum(len(ids) for step in self.steps for ids in step)

    def slice(self, start: int | None, stop: int | None) -> Trace:
        return Trace(self.steps[start:stop], self.tok[start:stop], self.source)

    def counts(self) -> Counter:
        """How often each ``(layer, expert)`` was used."""
        c: Counter = Counter()
        for step in self.steps:
            for layer, ids in enumerate(step):
                c.update((layer, e) for e in ids)
        return c

    def reuse(self) -> float:
        """Next-token same-layer reuse: the share of a token's experts (tokens 2..n) that the
        previous token used in the same layer."""
        inter = total = 0
        for prev, cur in zip(self.steps, self.steps[1:]):
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


def parse_trace(lines: Iterable[str], source: str = "<trace>") -> Trace:
    """Parse trace lines; blank lines are skipped. Raises ``TraceFormatError`` on the first bad line."""
    steps: list[list[list[int]]] = []
    toks: list[int] = []
    n_layers = None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = _where(source, number)
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceFormatError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise TraceFormatError(f"{where}: expected a JSON object {{\"tok\": n, \"layers\": [...]}}, "
                                   f"got {type(obj).__name__}")
        for field in ("tok", "layers"):
            if field not in obj:
                raise TraceFormatError(f"{where}: missing field \"{field}\"")
        tok = obj["tok"]
        if isinstance(tok, bool) or not isinstance(tok, int):
            raise TraceFormatError(f"{where}: \"tok\" must be an integer, got {tok!r}")
        layers = _check_layers(obj["layers"], where, n_layers)
        n_layers = len(layers)
        steps.append(layers)
        toks.append(tok)
    if not steps:
        raise TraceFormatError(f"{source}: the trace has no tokens")
    return Trace(steps, toks, source)


def read_trace(path: str | os.PathLike) -> Trace:
    with open(path, encoding="utf-8") as f:
        return parse_trace(f, os.fspath(path))


class TraceWriter:
    """Append one routing record per token to a JSONL trace (what ``--trace-routing FILE`` writes).

    ``write(token_index, layers)`` takes one list of expert ids per MoE layer, in any order;
    they are written sorted. Use as a context manager, or call ``close()``.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._f = open(self.path, "w", encoding="utf-8")
        self._layers: int | None = None
        self.records = 0

    def write(self, token_index: int, layers: list[list[int]]) -> None:
        where = f"{self.path}: token {token_index}"
        clean = _check_layers([[int(e) for e in ids] for ids in layers], where, self._layers)
        self._layers = len(clean)
        self._f.write(json.dumps({"tok": int(token_index), "layers": clean}, separators=(", ", ": ")) + "\n")
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
        for tok, step in zip(trace.tok, trace.steps):
            w.write(tok, step)


# -- pin lists ------------------------------------------------------------------------------


def hottest(trace: Trace, n: int) -> list[tuple[int, int]]:
    """The ``n`` most used ``(layer, expert)`` keys of a trace (ties: lower layer, then expert)."""
    counts = trace.counts()
    return sorted(counts, key=lambda k: (-counts[k], k))[:n]


def write_pins(path: str | os.PathLike, pins: Iterable[tuple[int, int]], **info) -> None:
    """Write a pin list; ``info`` (e.g. source, counts) is stored beside it for people, never read back."""
    obj = {"format": PINS_FORMAT, "pins": [[int(layer), int(e)] for layer, e in pins]}
    obj.update((k, v) for k, v in info.items() if k not in obj)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f)
        f.write("\n")


def read_pins(path: str | os.PathLike) -> list[tuple[int, int]]:
    path = os.fspath(path)
    with open(path, encoding="utf-8") as f:
        try:
            obj = json.load(f)
        except json.JSONDecodeError as e:
            raise TraceFormatError(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
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
