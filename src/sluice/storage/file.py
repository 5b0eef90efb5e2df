"""Local files: O_DIRECT reads with a probe at open, buffered fallback without page cache.

``LocalFile`` is the local implementation of the ``ByteSource`` seam (``source.py``), and
the one place the O_DIRECT alignment rule lives: its ``alignment`` (4096, the largest
logical block size O_DIRECT meets in practice) is what readers above ask for.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import CancelledError

from .buffers import ALIGN, AlignedBuffer
from .priority import PriorityPool, ReadCancelled, current
from .regular import open_regular
from .source import ByteSource, ReadStats

# O_DIRECT offsets, lengths and buffer addresses are multiples of this. The same on the
# buffered path, so reads (and what they count) are the same whichever path a file takes.
DIRECT_ALIGN = ALIGN
# long sequential reads (container spine groups) and unaligned reads go in pieces of this size
READ_BYTES = 8 << 20

# One large read is split into pieces of this size read in parallel: a streamed spine layer
# (tens of MB, sequential) would otherwise be one read in flight at a time. Spine-streaming
# decode, 3 runs each: 0.41 tok/s unsplit, 0.47 with 4 threads, 0.50 with 8 (docs/optimizations.md).
PIECE_BYTES = 4 << 20
PIECE_THREADS = 8
PIECE_LOW_CAP = 4  # at most this many piece threads on speculative (prefetch) pieces at once
_piece_pool = None
_piece_pool_lock = threading.Lock()


def _pieces() -> PriorityPool:
    """The process's piece pool: pieces run in their read's priority order (``priority.py``)."""
    global _piece_pool
    if _piece_pool is None:
        with _piece_pool_lock:
            if _piece_pool is None:
                _piece_pool = PriorityPool(PIECE_THREADS, "sluice-piece", low_cap=PIECE_LOW_CAP)
    return _piece_pool


class LocalFile(ByteSource):
    """A read-only local file.

    ``direct=None`` probes O_DIRECT with one aligned read and falls back to buffered reads
    if the filesystem refuses it; ``direct=False`` forces the buffered path. Buffered reads
    call ``posix_fadvise(DONTNEED)`` on what they read, so the page cache does not grow.
    ``direct_io`` tells which path is in use; ``direct_error`` why O_DIRECT is not.
    """

    alignment = DIRECT_ALIGN
    read_size = READ_BYTES

    def __init__(self, path: str, *, direct: bool | None = None, stats: ReadStats | None = None):
        self.path = str(path)
        self.stats = stats if stats is not None else ReadStats()
        self.fd = open_regular(self.path)  # a FIFO, directory or device: NotRegularFileError, never a hang
        st = os.fstat(self.fd)
        self.size = st.st_size
        self.version = f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"
        self.dfd: int | None = None
        self.direct_error: str | None = None
        if direct is not False and hasattr(os, "O_DIRECT"):
            self.dfd = self._probe_direct()

    @property
    def name(self) -> str:
        return self.path

    @property
    def direct_io(self) -> bool:
        return self.dfd is not None

    def _probe_direct(self) -> int | None:
        try:
            dfd = open_regular(self.path, os.O_RDONLY | os.O_DIRECT)
        except OSError as e:
            self.direct_error = f"open with O_DIRECT failed: {e.strerror}"
            return None
        probe = AlignedBuffer(DIRECT_ALIGN)
        try:
            os.preadv(dfd, [probe.view(0, DIRECT_ALIGN)], 0)
        except OSError as e:
            os.close(dfd)
            self.direct_error = f"O_DIRECT probe read failed: {e.strerror}"
            return None
        return dfd

    def close(self) -> None:
        # -1 afterwards: a second close (or __del__) must not close a descriptor number the OS
        # has since given to another file; a read after close fails with EBADF
        for fd in (self.fd, self.dfd):
            if fd is not None and fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.fd, self.dfd = -1, None

    def __del__(self):  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass

    def read_aligned(self, buf: memoryview, offset: int) -> int:
        """Fill ``buf`` from ``offset``; both must be DIRECT_ALIGN-aligned (buffer address too).

        Returns the number of bytes read, which is less than ``len(buf)`` only at end of
        file. Raises ``OSError`` (with the file name) on I/O errors, and ``ReadCancelled``
        when the read's ticket (``priority.current()``) is cancelled before all of it is read.
        """
        want = len(buf)
        fd = self.dfd if self.dfd is not None else self.fd
        ticket = current()
        cancelled = False
        try:
            if (want >= 2 * PIECE_BYTES and PIECE_THREADS > 1
                    and not threading.current_thread().name.startswith("sluice-piece")):
                done, cancelled = self._read_pieces(fd, buf, offset, ticket)
            elif ticket is not None and ticket.cancelled:
                done, cancelled = 0, True
            else:
                done = self._read_span(fd, buf, offset)
        except OSError as e:
            raise OSError(e.errno, f"{e.strerror} reading {want} bytes at offset {offset}", self.path) from e
        if self.dfd is None and done:
            os.posix_fadvise(self.fd, offset, done, os.POSIX_FADV_DONTNEED)
        self.stats.add(done)
        if cancelled:
            raise ReadCancelled(f"{self.path}: read of {want} bytes at offset {offset} cancelled")
        return done

    def _read_span(self, fd: int, buf: memoryview, offset: int) -> int:
        want, done = len(buf), 0
        while done < want:
            n = os.preadv(fd, [buf[done:]], offset + done)
            if n <= 0:
                break
            done += n
            if self.dfd is not None and n % DIRECT_ALIGN:
                break  # a partial block only happens at EOF in direct mode
        return done

    def _read_piece(self, fd: int, buf: memoryview, offset: int, ticket) -> int:
        if ticket is not None and ticket.cancelled:
            return -1
        return self._read_span(fd, buf, offset)

    def _read_pieces(self, fd: int, buf: memoryview, offset: int, ticket) -> tuple[int, bool]:
        """The span in PIECE_BYTES pieces (DIRECT_ALIGN multiples), all but the first on the piece
        pool with the read's ticket; (bytes read up to the first short piece (end of file),
        whether a cancelled ticket skipped a piece). Returns only when no piece is running."""
        want = len(buf)
        bounds = [(a, min(a + PIECE_BYTES, want)) for a in range(0, want, PIECE_BYTES)]
        futures = [_pieces().submit(self._read_piece, fd, buf[a:b], offset + a, ticket, ticket=ticket)
                   for a, b in bounds[1:]]
        error = None
        try:
            got = [self._read_piece(fd, buf[bounds[0][0]:bounds[0][1]], offset, ticket)]
        except OSError as e:
            error, got = e, [0]
        for f in futures:
            try:
                got.append(f.result())
            except CancelledError:
                got.append(-1)
            except OSError as e:
                error = error or e
                got.append(0)
        if error is not None:
            raise error
        cancelled = -1 in got
        if cancelled:
            return sum(n for n in got if n > 0), True
        done = 0
        for (a, b), n in zip(bounds, got):
            done += n
            if n < b - a:
                break
        return done, False

    def pread(self, nbytes: int, offset: int) -> bytes:
        """A small buffered read (headers, manifests)."""
        data = os.pread(self.fd, nbytes, offset)
        self.stats.add(len(data))
        return data
