"""ctypes bindings to Sluice's C kernels, with torch fallbacks when they are not built.

``dense(x, w, bias)`` multiplies fp32 activations [T, K] by an f32/bf16/f16 weight [N, K]
without materialising an fp32 copy of the weight, using a persistent C thread pool;
``fp8_dense`` does the same for a block-scaled FP8 weight (``quant.fp8``), and
``dense_t(x, w, bias)`` does the same for an input-major weight [K, N] (``x @ w``).
``qmatmul`` / ``qdequant`` do the same for the quantized formats of ``sluice.quant``
(fused dequantize-and-multiply, and bounded row dequantization for batched prefill).
Callers check ``available()`` first; ``sluice.quant`` holds the torch fallbacks.
"""

from __future__ import annotations

import ctypes
import glob
import os

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
_WTYPE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _find_library() -> str | None:
    pkg = os.path.dirname(_HERE)
    for pattern in ("_kernels*.so", "_kernels*.pyd"):
        found = sorted(glob.glob(os.path.join(pkg, pattern)))
        if found:
            return found[0]
    return None


class _Lib:
    def __init__(self):
        self.lib = None
        self.qmatmul = None
        self.threads = 1
        self.error: str | None = None
        self.fp8 = False
        self.chain = False
        path = _find_library()
        if path is None:
            self.error = "C kernels not built (no compiler at install time?): using torch fallbacks"
            return
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            self.error = f"cannot load C kernels ({e}): using torch fallbacks"
            return
        p, i = ctypes.c_void_p, ctypes.c_int
        lib.sk_dense.argtypes = [p, p, p, p, i, i, i, i, i]
        lib.sk_dense.restype = None
        lib.sk_dense_t.argtypes = [p, p, p, p, i, i, i, i, i]
        lib.sk_dense_t.restype = None
        self.chain = hasattr(lib, "sk_dense_chain")
        if self.chain:
            lib.sk_dense_chain.argtypes = [p, p, p, p, i, i, i, i, i]
            lib.sk_dense_chain.restype = None
            lib.sk_transpose_f32.argtypes = [p, p, i, i, ctypes.c_longlong, ctypes.c_longlong, i, i]
            lib.sk_transpose_f32.restype = None
        lib.sk_swiglu.argtypes = [p, p, p, p, p, p, i, i, i, ctypes.c_float, i]
        lib.sk_swiglu.restype = None
        lib.sk_set_threads.argtypes = [i]
        lib.sk_set_threads.restype = i
        lib.sk_has_avx2.restype = i
        self.fp8 = hasattr(lib, "sk_fp8_dense")
        if self.fp8:
            lib.sk_fp8_dense.argtypes = [p, p, p, p, p, i, i, i, i, i, i, i]
            lib.sk_fp8_dense.restype = None
            lib.sk_fp8_dequant.argtypes = [p, p, p, i, i, i, i, i, i]
            lib.sk_fp8_dequant.restype = None
            for f in (lib.sk_fp8_heads, lib.sk_fp8_heads_t):
                f.argtypes = [p, p, p, p, i, i, i, i, i, i, i, i, i]
                f.restype = None
        lib.sk_qmatmul.argtypes = [i, i, p, p, p, p, p, i, i, i, i]
        lib.sk_qmatmul.restype = i
        lib.sk_qdequant.argtypes = [i, p, p, p, i, i, i, i]
        lib.sk_qdequant.restype = i
        lib.sk_q8_activations.argtypes = [p, i, i, i, p, p, p]
        lib.sk_q8_activations.restype = None
        lib.sk_set_schedule.argtypes = [i]
        lib.sk_set_schedule.restype = None
        lib.sk_bench_sum.argtypes = [p, ctypes.c_size_t, i]
        lib.sk_bench_sum.restype = ctypes.c_float
        self.lib = lib
        self.qmatmul = lib.sk_qmatmul
        self.set_threads(torch.get_num_threads())

    def set_threads(self, n: int) -> None:
        if self.lib is not None:
            self.threads = max(1, min(n, self.lib.sk_set_threads(n)))


_lib = _Lib()


def available() -> bool:
    return _lib.lib is not None


def set_threads(n: int) -> None:
    _lib.set_threads(n)


def info() -> dict:
    return {"available": available(), "avx2": bool(_lib.lib.sk_has_avx2()) if available() else False,
            "threads": _lib.threads, "error": _lib.error}


def dense(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] fp32 (contiguous) @ w [N, K]^T (+ bias fp32 [N]) -> [T, N] fp32."""
    t, k = x.shape
    n = w.shape[0]
    y = torch.empty(t, n, dtype=torch.float32)
    _lib.lib.sk_dense(x.data_ptr(), w.data_ptr(), bias.data_ptr() if bias is not None else None, y.data_ptr(),
                      t, n, k, _WTYPE[w.dtype], _lib.threads)
    return y


def fp8_available() -> bool:
    return _lib.lib is not None and _lib.fp8


def fp8_dense(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
              block: tuple[int, int], r0: int = 0, r1: int | None = None) -> torch.Tensor:
    """x [T, K] fp32 @ W[r0:r1]^T (+ bias fp32 [r1 - r0]) for a block-FP8 W: w float8_e4m3fn [N, K]
    (contiguous), scale fp32 [ceil(N / bn), ceil(K / bk)] (contiguous) -> [T, r1 - r0] fp32."""
    t, k = x.shape
    r1 = w.shape[0] if r1 is None else r1
    y = torch.empty(t, r1 - r0, dtype=torch.float32)
    _lib.lib.sk_fp8_dense(x.data_ptr(), w.data_ptr(), scale.data_ptr(), bias.data_ptr() if bias is not None else None,
                          y.data_ptr(), t, r1 - r0, k, r0, block[0], block[1], _lib.threads)
    return y
def fp8_dequant(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], r0: int, r1: int) -> torch.Tensor:
    """Rows r0..r1 of a block-FP8 W as fp32 [r1 - r0, K], bit-identical to ``w.float() * scale``."""
    k = w.shape[1]
    out = torch.empty(r1 - r0, k, dtype=torch.float32)
    _lib.lib.sk_fp8_dequant(w.data_ptr(), scale.data_ptr(), out.data_ptr(), r1 - r0, k, r0, block[0], block[1],
                            _lib.threads)
    return out


def fp8_heads(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], row0: int, stride: int,
              n: int) -> torch.Tensor:
    """Per-head ``x[t, h] @ W[row0 + h*stride : + n]^T`` for a block-FP8 W; x [T, H, K] contiguous -> [T, H, n]."""
    t, h, k = x.shape
    y = torch.empty(t, h, n, dtype=torch.float32)
    _lib.lib.sk_fp8_heads(x.data_ptr(), w.data_ptr(), scale.data_ptr(), y.data_ptr(), t, h, n, k, row0, stride,
                          block[0], block[1], _lib.threads)
    return y


def fp8_heads_t(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], row0: int,
                stride: int) -> torch.Tensor:
    """Per-head ``x[t, h] @ W[row0 + h*stride : + D]`` for a block-FP8 W [N, K]; x [T, H, D] contiguous -> [T, H, K]."""
    t, h, d = x.shape
    k = w.shape[1]
    y = torch.empty(t, h, k, dtype=torch.float32)
    _lib.lib.sk_fp8_heads_t(x.data_ptr(), w.data_ptr(), scale.data_ptr(), y.data_ptr(), t, h, d, k, row0, stride,
                            block[0], block[1], _lib.threads)
    return y


def dense_t(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] fp32 (contiguous) @ w [K, N] (contiguous, input-major) (+ bias fp32 [N]) -> [T, N] fp32."""
    t, k = x.shape
    n = w.shape[1]
    y = torch.empty(t, n, dtype=torch.float32)
    _lib.lib.sk_dense_t(x.data_ptr(), w.data_ptr(), bias.data_ptr() if bias is not None else None, y.data_ptr(),
                        t, n, k, _WTYPE[w.dtype], _lib.threads)
    return y


def chain_available() -> bool:
    return _lib.lib is not None and _lib.chain


def dense_chain(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] fp32 (contiguous) @ w [N, K]^T (+ bias fp32 [N]) -> [T, N] fp32, each output summed
    in ``dense_t``'s order (one fma chain over k ascending): bit-identical to ``dense_t(x, w.T)``."""
    t, k = x.shape
    n = w.shape[0]
    y = torch.empty(t, n, dtype=torch.float32)
    _lib.lib.sk_dense_chain(x.data_ptr(), w.data_ptr(), bias.data_ptr() if bias is not None else None,
                            y.data_ptr(), t, n, k, _WTYPE[w.dtype], _lib.threads)
    return y


def transpose_f32(w: torch.Tensor) -> torch.Tensor:
    """w [K, N] f32/bf16/f16 (any strides) -> its transpose [N, K] as a new contiguous fp32 tensor."""
    k, n = w.shape
    out = torch.empty(n, k, dtype=torch.float32)
    _lib.lib.sk_transpose_f32(w.data_ptr(), out.data_ptr(), k, n, w.stride(0), w.stride(1), _WTYPE[w.dtype],
                              _lib.threads)
    return out


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, scale: float) -> torch.Tensor:
    """One token through a SwiGLU expert in one call: ``scale * down(silu(gate x) * up x)``.

    x [1, H] fp32 contiguous; gate/up [I, H] and down [H, I] contiguous, one dtype -> [1, H]."""
    i, h = gate.shape
    scratch = torch.empty(2 * i, dtype=torch.float32)
    y = torch.empty(1, h, dtype=torch.float32)
    _lib.lib.sk_swiglu(x.data_ptr(), gate.data_ptr(), up.data_ptr(), down.data_ptr(), scratch.data_ptr(),
                       y.data_ptr(), h, i, _WTYPE[gate.dtype], scale, _lib.threads)
    return y


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def qmatmul(fmt: int, act: int, x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, n: int,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    """Fused quantized GEMV: x [T, K] fp32 contiguous (K already padded to the format's block),
    weight parts ``w`` (codes) and ``s`` (scales / codebooks) -> [T, n] fp32."""
    t, k = x.shape
    y = torch.empty(t, n, dtype=torch.float32)
    rc = _lib.qmatmul(fmt, act, x.data_ptr(), w.data_ptr(), s.data_ptr(), None if bias is None else bias.data_ptr(),
                      y.data_ptr(), t, n, k, _lib.threads)
    if rc != 0:
        _fail(rc, f"format {fmt} with K={k} and activation mode {act}")
    return y


def qdequant(fmt: int, w: torch.Tensor, s: torch.Tensor, n0: int, n1: int, k: int,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows [n0, n1) of a quantized matrix as fp32 [n1 - n0, k] (bit-identical to the reference)."""
    if out is None:
        out = torch.empty(n1 - n0, k, dtype=torch.float32)
    rc = _lib.lib.sk_qdequant(fmt, w.data_ptr(), s.data_ptr(), out.data_ptr(), n0, n1, k, _lib.threads)
    if rc != 0:
        _fail(rc, f"format {fmt} with K={k}")
    return out


def _fail(rc: int, what: str):
    if rc == -2:
        raise MemoryError(f"C kernels: out of memory for scratch buffers ({what})")
    raise ValueError(f"C kernels do not support {what}")


def q8_activations(x: torch.Tensor, layout: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The int8 activations the ACT_Q8 kernels use: (xq int8 [T, K], xd fp32 [T, K/32], xs fp32 [T, K/32]).
    layout 0: natural order; 1: each block of 32 as [even | odd] elements; 2: pairs of blocks
    as [evens g | evens g+1 | odds g | odds g+1] (an odd last block as in 1)."""
    t, k = x.shape
    xq = torch.empty(t, k, dtype=torch.int8)
    xd = torch.empty(t, k // 32, dtype=torch.float32)
    xs = torch.empty(t, k // 32, dtype=torch.float32)
    _lib.lib.sk_q8_activations(x.data_ptr(), t, k, layout, xq.data_ptr(), xd.data_ptr(), xs.data_ptr())
    return xq, xd, xs


def set_schedule(dynamic: bool) -> None:
    """Benchmarks only: dynamic chunk claiming (default) or one fixed part per thread (the old pool)."""
    if available():
        _lib.lib.sk_set_schedule(int(dynamic))


def bench_sum(a: torch.Tensor) -> float:
    """Benchmarks only: sum of a contiguous fp32 tensor on the kernels' thread pool (read bandwidth)."""
    return _lib.lib.sk_bench_sum(a.data_ptr(), a.numel(), _lib.threads)
