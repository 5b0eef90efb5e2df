"""The row store: tables read by row index (token-keyed tables such as Qwen3.8-Flash-Next's n-gram
embeddings), beside the expert store. ``table.RowTable`` says where each row's bytes are in the
checkpoint; ``store.RowStore`` serves rows, resident or read by row through the storage seam
with a bounded cache. See docs/rows.md."""

from .store import RowStats, RowStore
from .table import RowTable, row_table

__all__ = ["RowStats", "RowStore", "RowTable", "row_table"]
