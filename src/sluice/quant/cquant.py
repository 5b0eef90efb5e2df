"""ctypes bindings to the converter's C quantizers (kernels/quantize.c: q4, mxfp4, int8, rvq3).

Each function returns None where the C kernels are not built: the caller then uses its torch
implementation, which gives the same bytes (q4, mxfp4, int8) or other codebooks of the same
algorithm (rvq3: torch's random streams). q4, mxfp4 and int8 split rows over a few threads.
"""

from __future__ import annotations

import ctypes
import os
from concurrent.futures import ThreadPoolExecutor

import torch

_lib = None
_pool: ThreadPoolExecutor | None = None


def _load():
    global _lib
    if _lib is None:
        from ..kernels.backend import cpu

        path = cpu.library_path()
        lib = None
        if path is not None:
            try:
                lib = ctypes.CDLL(path)
                f, g = lib.sk_q4_quantize, lib.sk_mxfp4_quantize
            except (OSError, AttributeError):
                lib = None
            else:
                p, i64 = ctypes.c_void_p, ctypes.c_int64
                f.argtypes = [p, ctypes.c_int, i64, i64, i64, i64, p, ctypes.c_int, p, p]
                g.argtypes = [p, ctypes.c_int, i64, i64, i64, i64, p, p]
                f.restype = g.restype = None
                lib.sk_rvq3_quantize.argtypes = [p, i64, i64, ctypes.c_int, ctypes.c_int, ctypes.c_uint64, p, p]
                lib.sk_rvq3_quantize.restype = ctypes.c_int
                lib.sk_quantize_isa.argtypes = [ctypes.c_int]
                lib.sk_quantize_isa.restype = ctypes.c_int
                if hasattr(lib, "sk_int8_quantize"):  # (a library built before it: int8 in torch)
                    lib.sk_int8_quantize.argtypes = [p, ctypes.c_int, i64, i64, i64, i64, p, ctypes.c_int, p, p]
                    lib.sk_int8_quantize.restype = ctypes.c_int
        _lib = lib or False
    return _lib or None


def isa(level: int = -1) -> int | None:
    """The quantizers' instruction set (0 portable C, 1 AVX2, 2 AVX-512F; None without C). A
    ``level`` >= 0 selects min(level, the CPU's best), for the tests: every level gives the same bytes."""
    lib = _load()
    return None if lib is None else int(lib.sk_quantize_isa(level))


def threads() -> int:
    return max(1, min(torch.get_num_threads(), os.cpu_count() or 1))


def _split(rows: int, fn) -> None:
    """Run ``fn(r0, r1)`` over row ranges on ``threads()`` threads (ctypes drops the GIL)."""
    global _pool
    n = min(threads(), max(1, rows // 8))
    if n == 1:
        fn(0, rows)
        return
    if _pool is None or _pool._max_workers < n:
        _pool = ThreadPoolExecutor(n, thread_name_prefix="sluice-quantize")
    step = -(-rows // n)
    futures = [_pool.submit(fn, r0, min(rows, r0 + step)) for r0 in range(0, rows, step)]
    for f in futures:
        f.result()


_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _source(w: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``w`` as the C quantizers read it: f32, bf16 or f16 as stored (widened in C, exactly), else f32."""
    if w.dtype not in _DTYPES:
        w = w.float()
    return w.contiguous(), _DTYPES[w.dtype]


def _by_rows(kernel: str, what: str, w: torch.Tensor, outs, params: tuple = ()):
    """Run the C row quantizer ``kernel`` on the rows of ``w`` [r, k] (zero-padded to kp, a
    multiple of 32), split over ``threads()`` threads: ``kernel(w, dtype, r0, r1, k, kp, *params,
    *outputs)``, a nonzero return meaning out of memory. ``outs(r, kp)``: the output tensors, which
    it returns; None without C (or a library built before ``kernel``)."""
    lib = _load()
    fn = getattr(lib, kernel, None) if lib is not None else None
    if fn is None:
        return None
    w, dtype = _source(w)
    r, k = w.shape
    kp = -(-k // 32) * 32
    out = outs(r, kp)
    ptrs = [t.data_ptr() for t in out]

    def run(r0: int, r1: int) -> None:
        if fn(w.data_ptr(), dtype, r0, r1, k, kp, *params, *ptrs):
            raise MemoryError(f"{what}: out of memory quantizing rows of {k} weights")

    _split(r, run)
    return out


def q4_quantize(w: torch.Tensor, candidates: torch.Tensor):
    """q4 blocks [r, G, 16] and scales [r, G] (f16) of the rows of ``w`` [r, k] (zero-padded to a
    multiple of 32), or None without C."""
    cands = candidates.float().contiguous()
    return _by_rows("sk_q4_quantize", "q4", w, lambda r, kp: (torch.empty(r, kp // 32, 16, dtype=torch.uint8),
                                                              torch.empty(r, kp // 32, dtype=torch.float16)),
                    (cands.data_ptr(), cands.numel()))


def mxfp4_quantize(w: torch.Tensor):
    """mxfp4 blocks [r, G, 16] and scales [r, G] (E8M0) of the rows of ``w`` [r, k] (zero-padded to
    a multiple of 32), or None without C."""
    return _by_rows("sk_mxfp4_quantize", "mxfp4", w, lambda r, kp: (torch.empty(r, kp // 32, 16, dtype=torch.uint8),
                                                                    torch.empty(r, kp // 32, dtype=torch.uint8)))


def int8_quantize(w: torch.Tensor, ratios: torch.Tensor):
    """int8 levels [r, kp] (zero-padded to a multiple of 32) and f32 scales [r] of the rows of ``w``
    [r, k] for the clipping ``ratios``, or None without C."""
    rats = ratios.float().contiguous()
    return _by_rows("sk_int8_quantize", "int8", w, lambda r, kp: (torch.empty(r, kp, dtype=torch.int8),
                                                                  torch.empty(r, dtype=torch.float32)),
                    (rats.data_ptr(), rats.numel()))


def rvq3_quantize(v: torch.Tensor, sample: int, iters: int, seed_batch: int, seed: int):
    """rvq3 codes [n, 3] (uint8) and codebooks [3, 256, 8] (f16) of the 8-dim rows ``v`` [n, 8] (one
    matrix, one thread: run several matrices on several threads), or None without C."""
    lib = _load()
    if lib is None:
        return None
    v = v.float().contiguous()
    codes = torch.empty(v.shape[0], 3, dtype=torch.uint8)
    books = torch.empty(3, 256, 8, dtype=torch.float16)
    if lib.sk_rvq3_quantize(v.data_ptr(), v.shape[0], sample, iters, seed_batch, seed & (2**64 - 1),
                            codes.data_ptr(), books.data_ptr()) != 0:
        raise MemoryError(f"rvq3: out of memory quantizing {v.shape[0]} subvectors")
    return codes, books
