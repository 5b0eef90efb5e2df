"""Where a row table's rows are: the byte ranges of its pieces in the checkpoint's safetensors.

A table of ``rows`` x ``dim`` is stored as one tensor ``<name>.weight`` or as consecutive pieces
``<name>.shard_0.weight``, ``<name>.shard_1.weight``, ... (transformers' ``split_ngram_parts``,
concatenated along the rows in numeric order when transformers loads them). Each piece is a
contiguous run of rows, so row i is one byte range: ``piece.offset + (i - first) * row_bytes``.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from ..checkpoint import DTYPES
from ..errors import CheckpointError

ROW_DTYPES = ("F32", "BF16", "F16")


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

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][1]

    @property
    def row_bytes(self) -> int:
        return self.dim * self.itemsize

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    def locate(self, row: int) -> tuple[Piece, int]:
        """(the piece holding ``row``, the row's byte offset in its file)."""
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


__all__ = ["Piece", "RowTable", "row_table"]
