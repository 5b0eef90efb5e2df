"""Page-aligned memory for O_DIRECT reads."""

from __future__ import annotations

import mmap

import numpy as np
import torch

# The page: AlignedBuffer memory comes in whole pages at page-aligned addresses, so any byte
# source's alignment (``ByteSource.alignment``, 4096 for O_DIRECT files) divides it.
ALIGN = 4096


def align_down(n: int, a: int = ALIGN) -> int:
    return n - (n % a)


def align_up(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


class AlignedBuffer:
    """Anonymous, page-aligned memory; pages become resident only when written.

    ``huge=True`` asks the kernel for transparent huge pages (MADV_HUGEPAGE), which
    lets one O_DIRECT request cover more bytes per device segment.
    """

    def __init__(self, nbytes: int, huge: bool = False):
        self.nbytes = align_up(max(nbytes, 1))
        self._mm = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if huge and hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._mm.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass
        self._np = np.frombuffer(self._mm, dtype=np.uint8)
        self.address = self._np.ctypes.data
        self._u8 = torch.from_numpy(self._np)  # one shared view; slices are cheap

    @staticmethod
    def size_for(nbytes: int) -> int:
        """The bytes an ``AlignedBuffer(nbytes)`` takes (whole pages; 0 for 0)."""
        return align_up(nbytes)

    def view(self, offset: int = 0, nbytes: int | None = None) -> memoryview:
        end = self.nbytes if nbytes is None else offset + nbytes
        return memoryview(self._mm)[offset:end]

    def tensor(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A tensor view of ``shape`` and ``dtype`` over this buffer at byte ``offset``."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        count = 1
        for s in shape:
            count *= s
        raw = self._u8[offset : offset + count * itemsize]
        if offset % itemsize:
            raw = raw.clone()  # unaligned element start: copy (rare; never for our own layouts)
        return raw.view(dtype).view(shape)

    def release(self, offset: int = 0, nbytes: int | None = None) -> None:
        """Give pages back to the OS (MADV_DONTNEED); the contents become zero."""
        n = self.nbytes - offset if nbytes is None else nbytes
        if hasattr(mmap, "MADV_DONTNEED") and n > 0:
            self._mm.madvise(mmap.MADV_DONTNEED, offset, align_up(n))
