"""Weight formats: how one [N, K] matrix is stored, and how it multiplies activations.

A ``Format`` describes the stored *parts* of one matrix (``parts(n, k)``: name -> (dtype,
shape)), turns fp32 weights into them (``quantize``), turns them back into fp32 in plain
torch (``dequantize``, the reference), and multiplies fp32 activations by them without a
full-precision copy of the matrix (``matmul``: fused C kernels for a few tokens, bounded
row blocks dequantized to fp32 + sgemm for prefill; torch fallbacks without the C kernels).

``FORMATS`` maps a name to its format (f32/bf16/f16, int8, q4, mxfp4, rvq3, and fp8 from
``fp8.py``). ``QuantMatrix`` binds a format to one matrix's parts; ``Format.record_parts`` and
``Format.bind`` say how an expert record names a matrix's parts and what it multiplies with
(``assembly.py`` builds an expert's weights with them), and ``record_layout`` says where those
parts go in a record. ``quant.linear`` accepts a ``QuantMatrix`` wherever it accepts a dense weight.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..kernels.backend import cpu
from .dense import linear

PartSpec = dict[str, tuple[torch.dtype, tuple[int, ...]]]

# Activation handling of the fused kernels, per format. "q8": each block of 32 activations is
# rounded to int8 with one fp32 scale and the block dot products are integer (measured ~2x
# faster for q4/mxfp4 on AVX2, see docs/quantization.md); "f32": activations are used as given.
# The reference path (``dequantize`` + matmul) is always fp32.
ACTIVATIONS = ("f32", "q8")
_DEFAULT_ACT = {"int8": "f32", "q4": "q8", "mxfp4": "q8"}
_act_override: str | None = None  # set_activations(): one mode for every format, for measurements


_act_code: dict[tuple[str, bool], int] = {}  # (format, exact) -> C activation mode, refreshed by set_activations


def set_activations(mode: str | None) -> None:
    """Force the fused kernels' activation handling: "f32", "q8", or None for each format's default."""
    global _act_override
    if mode not in (None, "auto") + ACTIVATIONS:
        raise ValueError(f"activation mode must be one of {ACTIVATIONS} or None, not {mode!r}")
    _act_override = None if mode in (None, "auto") else mode
    _act_code.clear()


def activations(fmt: str, exact: bool = False) -> str:
    """The activation handling the fused kernel of format ``fmt`` uses now.

    ``exact``: the stored weights are the model itself (a natively quantized checkpoint such as
    GPT-OSS MXFP4, whose reference multiplies fp32 activations): "f32" unless forced globally.
    """
    if _act_override in ACTIVATIONS and fmt in _DEFAULT_ACT:
        return _act_override
    return "f32" if exact else _DEFAULT_ACT.get(fmt, "f32")


def _activation_code(fmt: str, exact: bool = False) -> int:
    code = _act_code.get((fmt, exact))
    if code is None:
        code = _act_code[(fmt, exact)] = ACTIVATIONS.index(activations(fmt, exact))
    return code


_CHUNK_ELEMS = 4 << 20  # fp32 elements of one dequantized row block in the batched path (16 MiB)


class Format:
    """One stored format of an [N, K] matrix. Subclasses set the class attributes and
    implement ``parts``, ``quantize`` and ``dequantize_rows``."""

    name: str = ""
    lossy: bool = True  # quantize() approximates its input (a checkpoint already in this format is read as is)
    bits_per_weight: float = 0.0  # nominal, for large matrices; ``nbytes`` is exact
    block: int = 1  # K is padded with zero weights up to a multiple of this
    code: int | None = None  # C kernel format code
    # Up to this many tokens the fused kernel (which reads each row once for all tokens) runs;
    # more: dequantized row blocks + sgemm. Per activation mode ("f32", "q8"), by measurement.
    small_batch: tuple[int, int] = (8, 8)

    def batch_limit(self) -> int:
        return self.small_batch[_activation_code(self.name)]

    # ----------------------------------------------------------------- layout -----
    def padded_k(self, k: int) -> int:
        return -(-k // self.block) * self.block

    def parts(self, n: int, k: int) -> PartSpec:
        raise NotImplementedError

    def nbytes(self, n: int, k: int) -> int:
        return sum(math.prod(shape) * dtype.itemsize for dtype, shape in self.parts(n, k).values())

    # ----------------------------------------------------------- expert records ---
    def record_parts(self, role: str) -> dict[str, str]:
        """Part -> the name of its view in an expert record holding matrix ``role``: "<role>.<part>"."""
        return {part: f"{role}.{part}" for part in self.parts(1, self.block)}

    def bind(self, parts: dict[str, torch.Tensor], n: int, k: int, exact: bool = False,
             block: tuple[int, int] | None = None, name: str = ""):
        """One [n, k] matrix over its stored ``parts`` (views, not copies): what ``quant.linear``
        multiplies. ``exact``: see ``QuantMatrix``; ``block``: a block-scaled format's weight block."""
        return QuantMatrix(self, parts, n, k, exact)

    # ------------------------------------------------------------- conversion -----
    def quantize(self, w: torch.Tensor, seed: int = 0) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def dequantize_rows(self, parts: dict[str, torch.Tensor], n: int, k: int, r0: int, r1: int) -> torch.Tensor:
        """Reference: rows [r0, r1) as fp32 [r1 - r0, padded_k(k)], plain torch."""
        raise NotImplementedError

    def gather_rows(self, parts: dict[str, torch.Tensor], n: int, k: int, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (any order, repeats allowed) as fp32 [len(ids), k] (an embedding lookup)."""
        return torch.cat([self.dequantize_rows(parts, n, k, i, i + 1)[:, :k] for i in ids.tolist()])

    def dequantize(self, parts: dict[str, torch.Tensor], n: int, k: int) -> torch.Tensor:
        """Reference: the whole matrix as fp32 [n, k], plain torch."""
        return self.dequantize_rows(parts, n, k, 0, n)[:, :k]

    def reference_matmul(self, x: torch.Tensor, parts: dict[str, torch.Tensor], n: int, k: int) -> torch.Tensor:
        """Reference: ``x @ dequantize(parts).T`` in fp32."""
        return x.float() @ self.dequantize(parts, n, k).T

    # ----------------------------------------------------------------- kernels ----
    def _kernel_parts(self, parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _fused_fallback(self, x: torch.Tensor, parts, n: int, k: int) -> torch.Tensor | None:
        """Torch fallback for few tokens when the C kernels are absent (None: use row blocks)."""
        return None

    def matmul(self, x: torch.Tensor, parts: dict[str, torch.Tensor], n: int, k: int,
               bias: torch.Tensor | None = None, exact: bool = False) -> torch.Tensor:
        """x [T, k] fp32 -> [T, n] fp32 (+ bias), never holding a full fp32 copy of the matrix."""
        x = x.float()
        kp = self.padded_k(k)
        if kp != k:
            x = F.pad(x, (0, kp - k))
        x = x.contiguous()
        t = x.shape[0]
        b = None if bias is None else bias.float().contiguous()
        if t <= self.batch_limit() or (cpu.batch_invariant() and self.code is not None):
            if cpu.available() and self.code is not None:
                w, s = self._kernel_parts(parts)
                return cpu.qmatmul(self.code, _activation_code(self.name, exact), x, w, s, n, b)
            y = self._fused_fallback(x, parts, n, k)
            if y is not None:
                return y if b is None else y + b
        return self._blocked(x, parts, n, k, b)

    def _blocked(self, x: torch.Tensor, parts, n: int, k: int, bias: torch.Tensor | None) -> torch.Tensor:
        """Batched path: dequantize bounded row blocks to fp32, multiply each with sgemm."""
        kp = x.shape[1]
        rows = max(1, _CHUNK_ELEMS // kp)
        out = torch.empty(x.shape[0], n, dtype=torch.float32)
        fast = cpu.available() and self.code is not None
        if fast:
            w, s = self._kernel_parts(parts)
            buf = torch.empty(min(rows, n), kp, dtype=torch.float32)
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            if fast:
                blk = cpu.qdequant(self.code, w, s, r0, r1, kp, out=buf[: r1 - r0])
            else:
                blk = self.dequantize_rows(parts, n, k, r0, r1)
            torch.matmul(x, blk.t(), out=out[:, r0:r1])
        if bias is not None:
            out += bias
        return out


class DenseFormat(Format):
    """f32 / bf16 / f16 passthrough: one part ``weight`` [N, K]; matmul is ``quant.linear``'s dense path."""

    lossy = False
    block = 1

    def __init__(self, name: str, dtype: torch.dtype):
        self.name = name
        self.dtype = dtype
        self.bits_per_weight = float(dtype.itemsize * 8)

    def parts(self, n: int, k: int) -> PartSpec:
        return {"weight": (self.dtype, (n, k))}

    def quantize(self, w: torch.Tensor, seed: int = 0) -> dict[str, torch.Tensor]:
        return {"weight": w.to(self.dtype).contiguous()}

    def dequantize_rows(self, parts, n, k, r0, r1):
        return parts["weight"][r0:r1].float()

    def matmul(self, x, parts, n, k, bias=None, exact=False):
        return linear(x.float(), parts["weight"], bias)

    def record_parts(self, role: str) -> dict[str, str]:
        return {"weight": role}  # the record's view is the matrix itself

    def bind(self, parts, n, k, exact=False, block=None, name=""):
        return parts["weight"]


class QuantMatrix:
    """One [n, k] matrix stored in ``format``: ``parts`` as ``format.parts(n, k)`` describes."""

    __slots__ = ("format", "parts", "n", "k", "exact", "_fast")

    def __init__(self, format: Format | str, parts: dict[str, torch.Tensor], n: int, k: int, exact: bool = False):
        self.format = FORMATS[format] if isinstance(format, str) else format
        self.parts = parts
        self.n, self.k = n, k
        self.exact = exact  # see ``activations``: fp32 activations unless forced globally
        fmt = self.format
        # decode fast path: C kernel arguments resolved once (None: go through Format.matmul)
        self._fast = None
        if fmt.code is not None and fmt.padded_k(k) == k and cpu.available():
            self._fast = (fmt.code, fmt.name, *fmt._kernel_parts(parts), fmt.small_batch)

    @classmethod
    def quantize(cls, format: Format | str, w: torch.Tensor, seed: int = 0) -> QuantMatrix:
        fmt = FORMATS[format] if isinstance(format, str) else format
        n, k = w.shape
        return cls(fmt, fmt.quantize(w.float(), seed=seed), n, k)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts.values())

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T (+ bias)`` in fp32; x: [..., k]."""
        fast = self._fast
        if fast is not None and x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous() and (
                bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())):
            code, name, w, s, limits = fast
            act = _activation_code(name, self.exact)
            if x.shape[0] <= limits[act] or cpu.batch_invariant():
                return cpu.qmatmul(code, act, x, w, s, self.n, bias)
        lead = x.shape[:-1]
        y = self.format.matmul(x.reshape(-1, self.k), self.parts, self.n, self.k, bias, self.exact)
        return y.reshape(*lead, self.n)

    linear = matmul  # what ``quant.linear`` calls on a weight that is not a tensor

    def dequantize(self) -> torch.Tensor:
        return self.format.dequantize(self.parts, self.n, self.k)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` dequantized to fp32 [len(ids), k] (an embedding lookup)."""
        return self.format.gather_rows(self.parts, self.n, self.k, ids)

    def __repr__(self) -> str:
        return f"QuantMatrix({self.format.name}, n={self.n}, k={self.k}, {self.nbytes} bytes)"


def _check_part(name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if t.dtype != dtype:
        raise ValueError(f"part {name!r} has dtype {t.dtype}, the format stores {dtype}")
    if tuple(t.shape) != tuple(shape):
        if t.numel() != math.prod(shape) or not t.is_contiguous():
            raise ValueError(f"part {name!r} has shape {list(t.shape)}, the format stores {list(shape)}")
        t = t.view(shape)
    return t


def record_layout(format_name: str, shapes: dict[str, tuple[int, int]],
                  align: int = 64) -> tuple[list[tuple[str, int, torch.dtype, tuple[int, ...]]], int]:
    """Where each part of one expert record goes: for each role in ``shapes`` order, the parts
    of ``parts(n, k)`` in order, each at an offset aligned to ``align`` bytes.

    Returns ([(view name, byte offset, dtype, shape), ...], record bytes); view names as
    ``Format.record_parts`` gives them ("<role>.<part>"; the matrix's role for f32/bf16/f16).
    """
    fmt = FORMATS[format_name]
    entries = []
    off = 0
    for role, (n, k) in shapes.items():
        names = fmt.record_parts(role)
        for part, (dtype, shape) in fmt.parts(n, k).items():
            off = -(-off // align) * align
            entries.append((names[part], off, dtype, tuple(shape)))
            off += math.prod(shape) * dtype.itemsize
    return entries, off


def fake_quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """What the "q8" kernels multiply instead of x: each block of 32 along the last dim rounded to
    int8 with scale amax / 127 (round half to even), back in fp32. Plain torch, for tests."""
    t, k = x.shape
    xb = x.float().reshape(t, k // 32, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    c127 = torch.full_like(amax, 127.0)  # tensor / tensor: a true fp32 division, as in C
    inv = torch.where(amax > 0, c127 / amax, torch.zeros_like(amax))
    q = (xb * inv).round().clamp(-127, 127)
    return (q * (amax / c127)).reshape(t, k)


FORMATS: dict[str, Format] = {
    "f32": DenseFormat("f32", torch.float32),
    "bf16": DenseFormat("bf16", torch.bfloat16),
    "f16": DenseFormat("f16", torch.float16),
}


def register(fmt: Format) -> Format:
    FORMATS[fmt.name] = fmt
    return fmt
