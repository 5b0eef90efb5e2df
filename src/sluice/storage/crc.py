"""CRC-32 of container bytes: zlib's function, computed faster where the CPU allows.

``crc32(data, crc)`` returns exactly ``zlib.crc32(data, crc)``. With the C kernels built and
a CPU with carry-less multiplication (PCLMULQDQ: every x86-64 since ~2010), the bulk of the
buffer goes through ``sk_crc32_fold`` (kernels/crc32.c) and only the last < 16 bytes through
zlib. Throughput on one core, and what verification costs a decode: docs/reliability.md.
"""

from __future__ import annotations

import ctypes
import os
import zlib

import numpy as np

_FAST_MIN = 256  # below this zlib is as fast (and the call overhead dominates)


# Below this size the CRC runs with the GIL held (about 1 ms at most). Releasing it costs
# more: the reader thread must win the GIL back afterwards, which can wait up to the
# interpreter's switch interval (5 ms) while the main thread runs Python, and the read it
# finishes is late by as much. Measured (benchmarks/crc_cost.py, docs/reliability.md): with
# the GIL released, cold decode was ~20% slower with verification than without, and no
# slower than a CRC of 256 bytes through the same path.
HOLD_GIL_MAX = 8 << 20


def _load():
    if os.environ.get("SLUICE_ZLIB_CRC") == "1":  # force zlib (benchmarks compare the two)
        return None, None
    try:
        from ..kernels.backend import cpu

        path = cpu.library_path()
        if path is None:
            return None, None
        fns = []
        for dll in (ctypes.CDLL, ctypes.PyDLL):  # releases the GIL / keeps it
            lib = dll(path)
            if not hasattr(lib, "sk_crc32_fold") or not lib.sk_has_clmul():
                return None, None
            fn = lib.sk_crc32_fold
            fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
            fn.restype = ctypes.c_uint32
            fns.append(fn)
        return fns[0], fns[1]
    except (OSError, ImportError, AttributeError):
        return None, None


_fold, _fold_gil = _load()
FAST = _fold is not None


def _load_pread():
    if _fold is None:
        return None
    from ..kernels.backend import cpu

    fn = getattr(ctypes.CDLL(cpu.library_path()), "sk_pread_crc32", None)  # CDLL: called without the GIL
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64, ctypes.POINTER(ctypes.c_uint32)]
    fn.restype = ctypes.c_int64
    return fn


_pread_crc = _load_pread()


def pread_crc32(fd: int, dest: memoryview, offset: int) -> tuple[int, int] | None:
    """Read ``len(dest)`` bytes at ``offset`` of ``fd`` into ``dest`` and CRC-32 them, in one C call that
    holds no GIL (a disk tier hit: the reading thread takes the GIL back once, after the read and the
    check). ``(bytes read, crc32 of them)``; None where the C kernels are not there (then read and check
    in Python). Raises ``OSError`` for a failed read."""
    if _pread_crc is None:
        return None
    arr = np.frombuffer(dest, dtype=np.uint8)  # no copy; keeps the buffer alive during the call
    out = ctypes.c_uint32()
    n = _pread_crc(fd, arr.ctypes.data, arr.nbytes, offset, ctypes.byref(out))
    if n < 0:
        raise OSError(-n, os.strerror(-n))
    return n, out.value


def crc32(data, crc: int = 0) -> int:
    """``zlib.crc32(data, crc)`` for any contiguous buffer (bytes, bytearray, memoryview)."""
    mv = memoryview(data)
    n = mv.nbytes
    if _fold is None or n < _FAST_MIN:
        return zlib.crc32(mv, crc)
    mv = mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
    bulk = n & ~15
    arr = np.frombuffer(mv, dtype=np.uint8)  # no copy; keeps the buffer alive during the call
    crc = (_fold_gil if n <= HOLD_GIL_MAX else _fold)(crc & 0xFFFFFFFF, arr.ctypes.data, bulk)
    return zlib.crc32(mv[bulk:], crc) if bulk < n else crc
