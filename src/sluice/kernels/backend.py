"""The backend seam: every call from the engine into compute kernels goes through one object.

``Backend`` names the operations the rest of ``sluice`` uses (products per weight format,
attention, norms, rotary, the one-call SwiGLU expert, FP8, the linear-attention recurrence,
threads and the build's description). ``CpuBackend`` is today's C kernels
(``sluice.kernels``, ctypes), and ``cpu`` is its one instance; ``current()`` returns the
backend the process computes with (the CPU one: no device backend exists yet).

Zero overhead: a ``CpuBackend`` holds the kernels' functions themselves as instance
attributes, bound once at import (``cpu.dense is sluice.kernels.dense``), so a call site's
``cpu.dense(...)`` costs what ``kernels.dense(...)`` did (one global, one attribute lookup):
no wrapper, no dispatch per call. Call sites import ``cpu`` (or ``current()``) at module level.

A device backend (none yet) would provide the same operations on tensors of its device, and
one more: ``place_experts(views)``, which ``quant.assemble`` calls once when an expert's read
completes, with the record's tensor views over the host cache slot. The CPU backend returns
them unchanged (the weights are used where they were read: no copy); a device backend copies
them into its memory pool (``plan.Plan.device_bytes``: the planner's second pool) and returns
its own tensors, which the backend's products then multiply. docs/architecture.md, "Backends".

The converter's quantizers (``quant.cquant``) and the CRC-32 of container reads
(``storage.crc``) are host work with bindings of their own to the same library:
``library_path()`` is where they find it.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from .. import kernels as _k

# The operations of a backend: what the call sites of ``src/sluice`` use, and nothing else
# (tests/test_backend.py checks both directions).
OPS = (
    # capabilities (cheap predicates the call sites branch on)
    "available", "batch_invariant", "chain_available", "fp8_available", "norm_available",
    # dense products: output-major, input-major, output-major in input-major's order, transpose
    "dense", "dense_t", "dense_chain", "transpose_f32",
    # block-scaled FP8
    "fp8_dense", "fp8_dequant", "fp8_heads", "fp8_heads_t",
    # quantized formats (quant/formats.py): fused dequantize-and-multiply, row dequantization
    "qmatmul", "qdequant",
    # the one-call SwiGLU expert: one token, T tokens, several experts for one token
    "swiglu", "swiglu_rows", "swiglu_args", "swiglu_many",
    # attention, the gated delta rule, RMSNorm, rotary
    "attend", "delta_rule", "rmsnorm", "rope",
    # the process: compute threads, what the build is, where the library is
    "set_threads", "info", "library_path",
    # device placement of expert weights (identity on the CPU)
    "place_experts",
)


@runtime_checkable
class Backend(Protocol):
    """What a backend provides (the signatures are those of ``sluice.kernels``' functions)."""

    name: str

    def available(self) -> bool: ...
    def batch_invariant(self) -> bool: ...
    def chain_available(self) -> bool: ...
    def fp8_available(self) -> bool: ...
    def norm_available(self) -> bool: ...

    def dense(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor: ...
    def dense_t(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor: ...
    def dense_chain(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor: ...
    def transpose_f32(self, w: torch.Tensor) -> torch.Tensor: ...

    def fp8_dense(self, x, w, scale, bias, block, r0=0, r1=None) -> torch.Tensor: ...
    def fp8_dequant(self, w, scale, block, r0, r1) -> torch.Tensor: ...
    def fp8_heads(self, x, w, scale, block, row0, stride, n) -> torch.Tensor: ...
    def fp8_heads_t(self, x, w, scale, block, row0, stride) -> torch.Tensor: ...

    def qmatmul(self, fmt: int, act: int, x, w, s, n: int, bias=None) -> torch.Tensor: ...
    def qdequant(self, fmt: int, w, s, n0: int, n1: int, k: int, out=None) -> torch.Tensor: ...

    def swiglu(self, x, gate, up, down, scale: float) -> torch.Tensor: ...
    def swiglu_rows(self, x, gate, up, down, scale: float) -> torch.Tensor: ...
    def swiglu_args(self, gate, up, down) -> tuple: ...
    def swiglu_many(self, x, experts: list[tuple], scales: list[float]) -> list[torch.Tensor]: ...

    def attend(self, q, k, v, q_start: int, scale: float, window=None, sinks=None) -> torch.Tensor: ...
    def delta_rule(self, q, k, v, a, beta, S) -> tuple[torch.Tensor, torch.Tensor]: ...
    def rmsnorm(self, x, w, eps: float, res=None): ...
    def rope(self, x, cos, sin) -> torch.Tensor: ...

    def set_threads(self, n: int) -> None: ...
    def info(self) -> dict: ...
    def library_path(self) -> str | None: ...

    def place_experts(self, views: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...


def _same_views(views: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The CPU's placement of an expert's weights: where they were read (the host cache slot)."""
    return views


class CpuBackend:
    """Today's C kernels (``sluice.kernels``), with their torch fallbacks where they are not built.

    Every operation is the kernels' own function, stored on the instance once (no wrapper)."""

    name = "cpu"

    def __init__(self):
        for op in OPS:
            if op not in ("library_path", "place_experts"):
                setattr(self, op, getattr(_k, op))
        self.library_path = _k._find_library
        self.place_experts = _same_views

    def __repr__(self) -> str:
        return "CpuBackend()"


cpu = CpuBackend()


def current() -> CpuBackend:
    """The backend this process computes with: the CPU one (the only backend there is)."""
    return cpu
