"""CRC-32 of container bytes: zlib's function, computed faster where the CPU allows.

``crc32(data, crc)`` returns exactly ``zlib.crc32(data, crc)``. With the C kernels built and
a CPU with carry-less multiplication (PCLMULQDQ: every x86-64 since ~2010), the bulk of the
buffer goes through ``sk_crc32_fold`` (kernels/crc32.c) and only the last < 16 bytes through
zlib. Both release the GIL, so reader threads check records in parallel. Throughput on one
core: docs/reliability.md.
"""

from __future__ import annotations

import ctypes
import os
import zlib

import numpy as np

_FAST_MIN = 256  # below this zlib is as fast (and the call overhead dominates)


def _load():
    if os.environ.get("SLUICE_ZLIB_CRC") == "1":  # force zlib (benchmarks compare the two)
        return None
    try:
        from ..kernels import _find_library

        path = _find_library()
        if path is None:
            return None
        lib = ctypes.CDLL(path)
        if not hasattr(lib, "sk_crc32_fold") or not lib.sk_has_clmul():
            return None
        fn = lib.sk_crc32_fold
        fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
        fn.restype = ctypes.c_uint32
        return fn
    except (OSError, ImportError, AttributeError):
        return None


_fold = _load()
FAST = _fold is not None


def crc32(data, crc: int = 0) -> int:
    """``zlib.crc32(data, crc)`` for any contiguous buffer (bytes, bytearray, memoryview)."""
    mv = memoryview(data)
    n = mv.nbytes
    if _fold is None or n < _FAST_MIN:
        return zlib.crc32(mv, crc)
    mv = mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
    bulk = n & ~15
    arr = np.frombuffer(mv, dtype=np.uint8)  # no copy; keeps the buffer alive during the call
    crc = _fold(crc & 0xFFFFFFFF, arr.ctypes.data, bulk)
    return zlib.crc32(mv[bulk:], crc) if bulk < n else crc
