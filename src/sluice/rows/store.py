"""The row store: rows of token-keyed tables, resident or read by row with a bounded cache.

A ``RowStore`` serves ``gather(table, ids) -> [..., dim]`` fp32 rows for any integer ids.

- **Resident** tables (the planner keeps them when they fit in a tenth of the budget after the
  floor) are read whole at load; a lookup is an index.
- **Streamed** tables are read by row, each row one byte range of the checkpoint's shard
  (``table.RowTable.locate``), through the byte sources of the storage seam (local files with
  O_DIRECT or buffered, remote objects, the disk tier in front of them): the store never opens
  a file. Each table has its own LRU cache of rows, its share of ``cache_bytes`` (at least one
  row). Rows a step needs beyond the cache are held only while the step gathers them.
- ``issue(table, ids)``: the step's row ids are known as soon as its token ids are, so the
  model issues every table's reads at the start of the step, at demand priority on the reader
  pool (before the layers that use them run, overlapping their compute); ``gather`` then waits
  only for what is still in flight. This is the one entry point an "ids known early" read
  mechanism plugs into. ``issue(..., ahead=True)``: the rows of the step's next forward (the next
  prefill chunk), at ``AHEAD`` priority behind every expert read; raised to demand when their
  own forward issues them or a gather waits for them.

A Hugging Face directory has no checksums, so rows read from it are not CRC-checked (as experts
read from one are not). A container's tables are paged (``table.paged_table``): each row is read
with its page, whose CRC32 is checked (``verify``, the ``verify_reads`` option) before the row is
used; a mismatch is a ``RowReadError`` naming the table, the row and the file.

Counters (``stats``): rows looked up (one per distinct row per gather), rows read, bytes read
(what the byte sources read for them: the aligned span around a row with O_DIRECT, its page
in a container).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from ..checkpoint import DTYPES
from ..errors import ExpertReadError
from ..storage import ByteSource
from ..storage.priority import AHEAD, DEMAND, PriorityPool, Ticket
from .table import RowTable, page_ok


class RowReadError(ExpertReadError):
    """A row could not be read (I/O error, short read): names the table, row and file."""


@dataclass
class RowStats:
    looked_up: int = 0  # distinct rows per gather, summed
    read: int = 0  # rows read from storage (the rest came from the cache or a resident table)
    ahead: int = 0  # reads issued for the step's next forward (``issue(..., ahead=True)``)
    bytes_read: int = 0

    @property
    def hit_rate(self) -> float | None:
        return None if not self.looked_up else 1.0 - self.read / self.looked_up


class RowStore:
    """``tables`` by name; ``source(file)`` the byte source of a shard; ``resident`` the tables
    held whole; ``cache_bytes`` the streamed tables' row caches together; ``pool`` the reader
    pool row reads run on (None: read on the calling thread)."""

    def __init__(self, tables: dict[str, RowTable], source: Callable[[str], ByteSource], *, resident: bool,
                 cache_bytes: int = 0, pool: PriorityPool | None = None, verify: bool = True):
        self.tables, self.source, self.resident, self.pool = dict(tables), source, resident, pool
        self.verify = verify
        self.stats = RowStats()
        self._lock = threading.Lock()
        self._whole: dict[str, torch.Tensor] = {}
        self._cache: dict[str, OrderedDict] = {name: OrderedDict() for name in tables}
        self._pending: dict[tuple[str, int], tuple[Future, Ticket]] = {}
        # reads issued ahead by the last forward (for this one), and by the one before (for the last:
        # still pending now, nobody will gather them)
        self._ahead_keys: dict[tuple[str, int], None] = {}  # in issue order (so the cache's LRU order is)
        self._stale: dict[tuple[str, int], None] = {}
        total = sum(t.nbytes for t in tables.values()) or 1
        self.capacity = {name: max(1, int(cache_bytes * t.nbytes / total) // t.row_bytes) for name, t in
                         tables.items()}
        if resident:
            for name, t in tables.items():
                self._whole[name] = self._read_all(t)

    @property
    def cache_bytes(self) -> int:
        """Bytes the row caches hold at most (0 when the tables are resident)."""
        if self.resident:
            return 0
        return sum(self.capacity[n] * t.row_bytes for n, t in self.tables.items())

    @property
    def resident_bytes(self) -> int:
        return sum(t.nbytes for t in self.tables.values()) if self.resident else 0

    def _page(self, t: RowTable, offset: int, what: str) -> memoryview:
        """One page of a paged table, CRC-checked (``verify``)."""
        page = memoryview(bytearray(t.page_bytes))
        self._read_range(t, t.pieces[0].file, page, offset, what)
        if self.verify and not page_ok(page):
            raise RowReadError(f"{t.pieces[0].file}: CRC mismatch in the page of {what} of row table {t.name!r} at "
                               f"offset {offset} (the container is damaged; convert the model again)")
        return page

    def _read_all(self, t: RowTable) -> torch.Tensor:
        out = torch.empty(t.rows, t.dim, dtype=DTYPES[t.dtype][0])
        flat = out.view(-1).view(torch.uint8).numpy()
        if t.page_bytes:
            per, rb = t.rows_per_page, t.row_bytes
            for i in range(t.pages):
                r0 = i * per
                n = min(per, t.rows - r0)
                page = self._page(t, t.pieces[0].offset + i * t.page_bytes, f"rows {r0}..{r0 + n - 1}")
                flat[r0 * rb : (r0 + n) * rb] = page[: n * rb]
            return out
        pos = 0
        for p in t.pieces:
            n = p.rows * t.row_bytes
            self._read_range(t, p.file, memoryview(flat[pos : pos + n]), p.offset, f"rows {p.first}..")
            pos += n
        return out

    def _read_range(self, t: RowTable, file: str, dest: memoryview, offset: int, what: str) -> None:
        src = self.source(file)
        try:
            src.read_into(dest, offset)
        except OSError as e:
            raise RowReadError(f"{file}: reading {what} of row table {t.name!r} failed: {e}") from None
        a = max(1, src.alignment)  # what the source read: the aligned span around the range (O_DIRECT)
        with self._lock:
            self.stats.bytes_read += -(-(offset + len(dest)) // a) * a - offset // a * a

    def _read_row(self, name: str, row: int) -> torch.Tensor:
        t = self.tables[name]
        out = torch.empty(t.dim, dtype=DTYPES[t.dtype][0])
        if t.page_bytes:
            if not 0 <= row < t.rows:
                raise IndexError(f"row {row} outside table {t.name!r} of {t.rows} rows")
            page_at, within = t.page_of(row)
            page = self._page(t, page_at, f"row {row}")
            out.view(torch.uint8).numpy()[:] = page[within : within + t.row_bytes]
        else:
            piece, offset = t.locate(row)
            self._read_range(t, piece.file, memoryview(out.view(torch.uint8).numpy()), offset, f"row {row}")
        with self._lock:
            self.stats.read += 1
        return out

    def begin(self) -> None:
        """A forward begins: reads issued ahead for a forward that has passed without gathering them
        (its step ran fewer tokens than foreseen, or was cut short) go into the row cache if they
        are done (LRU: the cache stays bounded), else are cancelled: nothing issued ahead is held
        outside the cache for good."""
        for key in self._stale:
            held = self._pending.pop(key, None)
            if held is None:
                continue
            fut, ticket = held
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                name, row = key
                cache = self._cache[name]
                cache[row] = fut.result()
                while len(cache) > self.capacity[name]:
                    cache.popitem(last=False)
            else:
                ticket.cancel()
                fut.cancel()
        self._stale, self._ahead_keys = self._ahead_keys, {}

    def issue(self, name: str, ids: torch.Tensor, ahead: bool = False) -> None:
        """Start reading the rows of ``ids`` that are neither cached nor in flight: at demand
        priority (this forward's: a read issued ahead for them is raised to demand), or
        ``ahead`` (the step's next forward's) at ``AHEAD`` priority, after every read of this one."""
        if self.resident or self.pool is None:
            return
        cache = self._cache[name]
        # one ticket for the call's reads (raising it wakes the reader pools once, not per row)
        ticket, raised = Ticket(AHEAD if ahead else DEMAND), set()
        for row in torch.unique(ids).tolist():
            key = (name, row)
            if row in cache:
                continue
            held = self._pending.get(key)
            if held is not None:
                if not ahead and held[1].priority > DEMAND and id(held[1]) not in raised:
                    raised.add(id(held[1]))
                    held[1].raise_to(DEMAND)
                continue
            self._pending[key] = (self.pool.submit(self._read_row, name, row, ticket=ticket), ticket)
            if ahead:
                self.stats.ahead += 1
                self._ahead_keys[key] = None

    def gather(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        """The rows of ``ids`` (any shape) as fp32 [*ids.shape, dim]."""
        t = self.tables[name]
        if self.resident:
            uniq = torch.unique(ids)
            self.stats.looked_up += int(uniq.numel())
            return self._whole[name][ids.reshape(-1)].float().view(*ids.shape, t.dim)
        uniq, inverse = torch.unique(ids.reshape(-1), return_inverse=True)
        cache, cap = self._cache[name], self.capacity[name]
        got = []
        for row in uniq.tolist():
            r = cache.get(row)
            if r is not None:
                cache.move_to_end(row)
            else:
                held = self._pending.pop((name, row), None)
                if held is not None and held[1].priority > DEMAND:
                    held[1].raise_to(DEMAND)
                r = held[0].result() if held is not None else self._read_row(name, row)
                cache[row] = r
                while len(cache) > cap:
                    cache.popitem(last=False)
            got.append(r)
        self.stats.looked_up += len(got)
        return torch.stack(got).float()[inverse].view(*ids.shape, t.dim)

    def describe(self) -> str:
        """One line: the tables, resident or streamed, and the cache."""
        from ..units import format_size

        total = sum(t.nbytes for t in self.tables.values())
        if self.resident:
            return f"{len(self.tables)} row table(s), {format_size(total)}, resident"
        return (f"{len(self.tables)} row table(s), {format_size(total)}, streamed by row, row cache "
                f"{format_size(self.cache_bytes)}")

    def close(self) -> None:
        for fut, ticket in self._pending.values():
            ticket.cancel()
            fut.cancel()
        self._pending.clear()
        self._whole.clear()


__all__ = ["RowReadError", "RowStats", "RowStore"]
