"""Where a row table's rows are: the byte ranges of its pieces in the checkpoint's safetensors.

In a Hugging Face directory a table of ``rows`` x ``dim`` is stored as one tensor
``<name>.weight`` or as consecutive pieces ``<name>.shard_0.weight``, ``<name>.shard_1.weight``,
... (transformers' ``split_ngram_parts``, concatenated along the rows in numeric order when
transformers loads them). Each piece is a contiguous run of rows, so row i is one byte range:
``piece.offset + (i - first) * row_bytes``.

A container packs a table into aligned **pages** (``paged_table``): ``page_bytes`` (4096, or the
multiple of it that holds one row and a checksum) holds ``rows_per_page`` rows, zero padding, and
the CRC32 of everything before it in its last 4 bytes (little-endian). A row is read with its
page, which is checked before the row is used (as an expert record is).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from ..checkpoint import DTYPES
from ..errors import CheckpointError

ROW_DTYPES = ("F32", "BF16", "F16")
PAGE_BYTES = 4096
CRC_BYTES = 4


def page_bytes_for(row_bytes: int) -> int:
    """The page size of a paged table: 4096, or the smallest multiple of it that holds a row and a CRC."""
    return max(PAGE_BYTES, -(-(row_bytes + CRC_BYTES) // PAGE_BYTES) * PAGE_BYTES)


def pack_page(rows: bytes, page_bytes: int) -> bytes:
    """One page: ``rows``, zero padding, then the CRC32 of both."""
    from ..storage.crc import crc32

    body = bytes(rows) + b"\0" * (page_bytes - CRC_BYTES - len(rows))
    return body + crc32(body).to_bytes(CRC_BYTES, "little")


def page_ok(page: memoryview) -> bool:
    from ..storage.crc import crc32

    return crc32(page[:-CRC_BYTES]) == int.from_bytes(bytes(page[-CRC_BYTES:]), "little")


@dataclass(frozen=True)
class Piece:
    """``rows`` consecutive rows from row ``first``, in ``file`` at byte ``offset``."""

    tensor: str
    file: str
    offset: int
    first: int
    rows: int


@dataclass
class RowTable:
    name: str
    rows: int
    dim: int
    dtype: str  # safetensors dtype name
    pieces: list[Piece]
    page_bytes: int = 0  # 0: rows back to back (a Hugging Face directory); else a paged table (one piece)

    @property
    def rows_per_page(self) -> int:
        return (self.page_bytes - CRC_BYTES) // self.row_bytes if self.page_bytes else 0

    @property
    def pages(self) -> int:
        return -(-self.rows // self.rows_per_page) if self.page_bytes else 0

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][1]

    @property
    def row_bytes(self) -> int:
        return self.dim * self.itemsize

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    @property
    def stored_bytes(self) -> int:
        """Bytes the table takes in its file (pages included)."""
        return self.pages * self.page_bytes if self.page_bytes else self.nbytes

    def page_of(self, row: int) -> tuple[int, int]:
        """A paged table: (the byte offset of the page holding ``row``, the row's offset in it)."""
        p = self.pieces[0]
        return p.offset + (row // self.rows_per_page) * self.page_bytes, (row % self.rows_per_page) * self.row_bytes

    def locate(self, row: int) -> tuple[Piece, int]:
        """(the piece holding ``row``, the row's byte offset in its file); rows back to back only."""
        if not 0 <= row < self.rows:
            raise IndexError(f"row {row} outside table {self.name!r} of {self.rows} rows")
        firsts = [p.first for p in self.pieces]
        p = self.pieces[bisect.bisect_right(firsts, row) - 1]
        return p, p.offset + (row - p.first) * self.row_bytes


def row_table(tensors: dict, name: str, rows: int, dim: int) -> RowTable:
    """The table ``name`` (without ``.weight``) of ``rows`` x ``dim`` among the checkpoint's
    ``tensors`` (name -> ``TensorInfo``); refused by name when missing, mis-shaped or mixed."""
    whole = tensors.get(name + ".weight")
    if whole is not None:
        infos = [whole]
    else:
        infos, i = [], 0
        while (info := tensors.get(f"{name}.shard_{i}.weight")) is not None:
            infos.append(info)
            i += 1
        if not infos:
            raise CheckpointError(f"row table {name!r}: neither {name}.weight nor {name}.shard_0.weight is in the "
                                  "checkpoint")
        extra = sorted(k for k in tensors if k.startswith(name + ".shard_") and k not in
                       {f"{name}.shard_{j}.weight" for j in range(len(infos))})
        if extra:
            raise CheckpointError(f"row table {name!r}: pieces {extra} do not follow shard_0..shard_{len(infos) - 1}")
    pieces, first, dtypes = [], 0, set()
    for info in infos:
        if len(info.shape) != 2 or info.shape[1] != dim:
            raise CheckpointError(f"{info.file}: row table piece {info.name!r} has shape {list(info.shape)}, "
                                  f"expected [rows, {dim}] (config and weights disagree)")
        if info.dtype not in ROW_DTYPES:
            raise CheckpointError(f"{info.file}: row table piece {info.name!r} is stored as {info.dtype}; rows are "
                                  f"read as {', '.join(ROW_DTYPES)}")
        dtypes.add(info.dtype)
        pieces.append(Piece(info.name, info.file, info.offset, first, info.shape[0]))
        first += info.shape[0]
    if len(dtypes) > 1:
        raise CheckpointError(f"row table {name!r}: its pieces mix dtypes {sorted(dtypes)}")
    if first != rows:
        raise CheckpointError(f"row table {name!r}: its pieces hold {first} rows, config.json implies {rows} "
                              "(config and weights disagree)")
    return RowTable(name, rows, dim, dtypes.pop(), pieces)


def paged_table(name: str, rows: int, dim: int, dtype: str, file: str, offset: int, page_bytes: int) -> RowTable:
    """A container's paged table (``page_bytes`` as ``page_bytes_for`` gives it)."""
    t = RowTable(name, rows, dim, dtype, [Piece(name, file, offset, 0, rows)], page_bytes)
    if dtype not in ROW_DTYPES or page_bytes != page_bytes_for(t.row_bytes):
        raise CheckpointError(f"{file}: row table {name!r}: {dtype} rows of {dim} in pages of {page_bytes} bytes "
                              f"(expected {', '.join(ROW_DTYPES)} in pages of {page_bytes_for(t.row_bytes)})")
    return t


__all__ = ["PAGE_BYTES", "Piece", "RowTable", "pack_page", "page_bytes_for", "page_ok", "paged_table", "row_table"]
