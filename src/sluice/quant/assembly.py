"""The one assembly point of expert weights: a record's bytes -> the object compute multiplies.

Every expert source (a Hugging Face directory's byte ranges, a container record, a remote or
tiered copy of either, a Ray worker's own reads) ends in ``assemble(buf, base, record)``, called
once when a read completes (``ExpertCache.ready``), never per forward. ``record`` describes the
bytes (``experts.layout.ExpertLayout`` is one; any object with these attributes will do):

- ``views``: (name, slot_offset, dtype, shape) of each tensor in the record;
- ``format``: a ``FORMATS`` name whose parts the views hold as ``"<role>.<part>"``, with
  ``shapes`` ((role, n, k), ...) and ``exact`` (the stored weights are the model itself:
  fp32 activations); None: the views named by role are the matrices themselves, in a plain
  dtype (f32/bf16/f16) or block-scaled FP8 (``<role>`` + ``<role>_scale_inv``, weight
  ``block``), each bound through the format registry by its dtype;
- ``input_major``: the checkpoint stores these experts input-major (``x @ W``, GPT-OSS):
  dense matrices are then summed in that order whichever way a record lays them out.

Roles: canonical ``gate`` [I, H], ``up`` [I, H], ``down`` [H, I] (output-major), or a family's
fused on-disk layouts (``experts/fused.py``): ``gate_up_t`` [H, 2I] / ``down_t`` [I, H]
(input-major, gate and up interleaved along columns) or ``gate_up`` [2I, H] (rows interleaved);
biases ``gate_bias``, ``up_bias``, ``down_bias``, ``gate_up_bias``.

The result, ``ExpertWeights``, holds the matrices as views over the slot memory (no copies) and
the products compute needs, chosen here once from the names and formats: ``gate_up(x)`` ->
(gate, up) pre-activations, ``down(h)``, and ``swiglu`` (gate, up, down for the one-call C
expert kernel, or None where the format has no such kernel). ``experts/compute.py`` calls
through them without asking which layout or format it has.

``assemble``'s ``backend`` (default the CPU one) is where a device tier places an expert's
weights: ``backend.place_experts(views)`` runs first, once per read, and the ``ExpertWeights``
records the backend it was assembled for (docs/architecture.md, "Backends").
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..kernels.backend import Backend, cpu
from ..errors import CheckpointError
from .dense import chain_rows, linear, linear_chain
from .formats import FORMATS, QuantMatrix, _check_part
from .fp8 import FP8, SCALE_SUFFIX

# plain-dtype records: the format each matrix view's dtype names
_FORMAT_OF_DTYPE = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16", FP8: "fp8"}
_DENSE = (torch.float32, torch.bfloat16, torch.float16)
BIASES = ("gate_bias", "up_bias", "down_bias", "gate_up_bias")


def record_views(buf, base: int, record) -> dict[str, torch.Tensor]:
    """Tensor views of a record read into ``buf`` (an ``AlignedBuffer``) at ``base``."""
    return {v.name: buf.tensor(base + v.slot_offset, v.dtype, v.shape) for v in record.views}


def assemble(buf, base: int, record, backend: Backend = cpu) -> ExpertWeights:
    """The weights of the expert record read into ``buf`` at ``base`` (see the module docstring).

    ``backend`` (``kernels.backend``) is where the weights live and are multiplied: the point
    where a device tier places an expert. Its ``place_experts`` gets the record's views over
    the host slot, once per read, and returns the tensors to bind (the CPU backend: the same
    views, no copy; a device backend: copies in its memory pool)."""
    return assemble_views(record_views(buf, base, record), record.format,
                          {role: (n, k) for role, n, k in record.shapes}, exact=record.exact,
                          block=record.block, input_major=record.input_major, backend=backend)


def assemble_views(views: dict[str, torch.Tensor], format: str | None = None,
                   shapes: dict[str, tuple[int, int]] | None = None, *, exact: bool = False,
                   block: tuple[int, int] | None = None, input_major: bool = False,
                   backend: Backend = cpu) -> ExpertWeights:
    """``assemble`` on tensors already in hand (``views`` named as in a record)."""
    views = backend.place_experts(views)
    named: dict[str, object] = {}
    used: set[str] = set()
    if format is not None:  # "<role>.<part>" views of a registered format, each role's [n, k] given
        fmt = FORMATS[format]
        for role, (n, k) in (shapes or {}).items():
            parts = {}
            for part, (dtype, shape) in fmt.parts(n, k).items():
                name = fmt.record_parts(role)[part]
                if name not in views:
                    raise ValueError(f"{format} matrix {role!r} [{n}, {k}] is missing part {name!r}")
                parts[part] = _check_part(name, views[name], dtype, shape)
                used.add(name)
            named[role] = fmt.bind(parts, n, k, exact=exact, block=block, name=role)
    else:  # matrices by role in a plain dtype or FP8 (+ scales): bound by their dtype's format
        for role, t in views.items():
            if role in BIASES or role.endswith(SCALE_SUFFIX) or "." in role or t.dim() != 2:
                continue
            fmt = FORMATS.get(_FORMAT_OF_DTYPE.get(t.dtype, ""))
            if fmt is None:
                raise CheckpointError(f"expert matrix {role!r} has dtype {t.dtype}, which no weight format stores")
            parts = {}
            for part, name in fmt.record_parts(role).items():
                if name not in views:
                    raise CheckpointError(f"expert matrix {role!r} ({fmt.name}) is missing its part {name!r}")
                parts[part] = views[name]
                used.add(name)
            n, k = t.shape
            named[role] = fmt.bind(parts, n, k, exact=exact, block=block, name=role)
    for name, t in views.items():
        if name not in used:
            named[name] = t
    return ExpertWeights(named, input_major, backend)


def _missing(what: str) -> Callable:
    def fail(x):
        raise CheckpointError(f"expert record has no {what} weights")
    return fail


def _gate_up(m: dict, input_major: bool) -> Callable:
    """x [T, H] fp32 -> (gate [T, I], up [T, I]) pre-activations, biases added."""
    if "gate_up_t" in m:  # [H, 2I] input-major, gate/up interleaved columns
        gu, b = m["gate_up_t"], m.get("gate_up_bias")
        g_cols, u_cols = gu[:, 0::2], gu[:, 1::2]
        g_b, u_b = (None, None) if b is None else (b[0::2], b[1::2])

        def gate_up(x):
            if chain_rows(x.shape[0]):  # one call: each output's sum as apart
                y = linear_chain(x, gu, b, input_major=True)
                return y[:, 0::2], y[:, 1::2]
            return linear_chain(x, g_cols, g_b, input_major=True), linear_chain(x, u_cols, u_b, input_major=True)
        return gate_up
    if "gate_up" in m:  # [2I, H] output-major (quantized), gate/up interleaved rows
        gu, b = m["gate_up"], m.get("gate_up_bias")

        def gate_up(x):
            y = linear(x, gu, b)
            return y[:, 0::2], y[:, 1::2]
        return gate_up
    if "gate" not in m or "up" not in m:
        return _missing("gate/up")
    g, u, g_b, u_b = m["gate"], m["up"], m.get("gate_bias"), m.get("up_bias")
    if input_major and isinstance(g, torch.Tensor):  # canonical records of input-major experts

        def gate_up(x):
            return linear_chain(x, g, g_b), linear_chain(x, u, u_b)
        return gate_up

    def gate_up(x):
        return linear(x, g, g_b), linear(x, u, u_b)
    return gate_up


def _down(m: dict, input_major: bool) -> Callable:
    """h [T, I] fp32 -> [T, H], bias added."""
    if "down_t" in m:
        d, b = m["down_t"], m.get("down_bias")

        def down(h):
            return linear_chain(h.contiguous(), d, b, input_major=True)
        return down
    if "down" not in m:
        return _missing("down")
    d, b = m["down"], m.get("down_bias")
    if input_major and isinstance(d, torch.Tensor):

        def down(h):
            return linear_chain(h.contiguous(), d, b)
        return down

    def down(h):
        return linear(h.contiguous(), d, b)
    return down


def _swiglu(m: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """gate, up, down for the one-call C expert kernel: dense, one dtype, contiguous, no biases."""
    if set(m) != {"gate", "up", "down"}:
        return None
    g, u, d = m["gate"], m["up"], m["down"]
    if not (isinstance(g, torch.Tensor) and isinstance(u, torch.Tensor) and isinstance(d, torch.Tensor)):
        return None
    if g.dtype not in _DENSE or not g.dtype == u.dtype == d.dtype:
        return None
    if not (g.is_contiguous() and u.is_contiguous() and d.is_contiguous()):
        return None
    return g, u, d


class ExpertWeights:
    """One expert's assembled weights (see the module docstring).

    ``gate_up(x)``, ``down(h)``: the products; ``swiglu``: (gate, up, down) for the fused C
    kernel or None, and ``swiglu_args`` their ``cpu.swiglu_args`` (addresses taken once).
    Read-only mapping of the record's names to matrices (tensor,
    ``QuantMatrix``, ``BlockFP8``) and biases, for inspection and conversion."""

    __slots__ = ("named", "input_major", "gate_up", "down", "swiglu", "swiglu_args", "backend")

    def __init__(self, named: dict, input_major: bool = False, backend: Backend = cpu):
        self.named = named
        self.input_major = input_major
        self.backend = backend  # where the weights live (kernels.backend): assemble's placement
        self.gate_up = _gate_up(named, input_major)
        self.down = _down(named, input_major)
        self.swiglu = _swiglu(named)
        # the one-call kernel's arguments (addresses, sizes), taken once: cpu.swiglu_many
        self.swiglu_args = backend.swiglu_args(*self.swiglu) if self.swiglu is not None else None

    def __getitem__(self, name: str):
        return self.named[name]

    def __contains__(self, name: str) -> bool:
        return name in self.named

    def __iter__(self):
        return iter(self.named)

    def __len__(self) -> int:
        return len(self.named)

    def keys(self):
        return self.named.keys()

    def get(self, name: str, default=None):
        return self.named.get(name, default)

    def canonical(self) -> dict:
        """Canonical ``gate``/``up``/``down`` (output-major) and biases: what ``sluice convert``
        writes. A fused layout is de-interleaved (and transposed) into copies; quantized rows are
        split bit for bit (a row split never touches a quantization block)."""
        m = self.named
        out: dict = {}
        if "gate_up_t" in m:
            gu = m["gate_up_t"]
            out["gate"] = gu[:, 0::2].t().contiguous()
            out["up"] = gu[:, 1::2].t().contiguous()
        elif "gate_up" in m:
            gu = m["gate_up"]
            if not isinstance(gu, QuantMatrix):
                raise CheckpointError(f"a fused gate_up matrix of type {type(gu).__name__} cannot be split")
            for role, sl in (("gate", slice(0, None, 2)), ("up", slice(1, None, 2))):
                out[role] = QuantMatrix(gu.format, {p: t[sl].contiguous() for p, t in gu.parts.items()},
                                        gu.n // 2, gu.k, gu.exact)
        if "down_t" in m:
            out["down"] = m["down_t"].t().contiguous()
        if "gate_up_bias" in m:
            out["gate_bias"] = m["gate_up_bias"][0::2].contiguous()
            out["up_bias"] = m["gate_up_bias"][1::2].contiguous()
        for name, t in m.items():
            if name not in ("gate_up_t", "gate_up", "down_t", "gate_up_bias"):
                out[name] = t
        return out

    def __repr__(self) -> str:
        return f"ExpertWeights({', '.join(self.named)})"


def canonical_views(views: list[tuple[str, torch.dtype, tuple[int, ...]]],
                    shapes: dict[str, tuple[int, int]] | None = None) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """The (name, dtype, shape) of what ``ExpertWeights.canonical`` returns for a record of these
    ``views`` (for planning a converted record). Quantized matrices appear as one float32 entry per
    role of its [n, k] from ``shapes``, not as their parts."""
    by_name = {name: (name, dtype, tuple(shape)) for name, dtype, shape in views}
    quantized = any("." in n for n in by_name)
    fused = "gate_up_t" in by_name or "gate_up" in by_name or any(n.startswith("gate_up.") for n in by_name)
    if not fused and not quantized:
        return list(views)
    out = []
    if "gate_up_t" in by_name:
        _, dtype, (h, i2) = by_name["gate_up_t"]
        _, ddtype, dshape = by_name["down_t"]
        out += [("gate", dtype, (i2 // 2, h)), ("up", dtype, (i2 // 2, h)), ("down", ddtype, tuple(reversed(dshape)))]
    elif quantized:
        if shapes is None:
            raise ValueError("the canonical views of quantized experts need the roles' [n, k] shapes")
        out += [(role, torch.float32, tuple(shapes[role])) for role in ("gate", "up", "down")]
    if "gate_up_bias" in by_name:
        _, dtype, (i2,) = by_name["gate_up_bias"]
        out += [("gate_bias", dtype, (i2 // 2,)), ("up_bias", dtype, (i2 // 2,))]
    out += [v for n, v in by_name.items() if n not in ("gate_up_t", "down_t", "gate_up_bias") and "." not in n]
    return out


__all__ = ["BIASES", "ExpertWeights", "assemble", "assemble_views", "canonical_views", "record_views"]
