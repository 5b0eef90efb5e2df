"""Byte sources. Storage knows bytes, not caching or models.

``LocalFile`` reads a local file with O_DIRECT when the filesystem allows it (decided by a
probe read at open) and falls back to buffered reads that drop their pages from the page
cache afterwards, so expert reads never crowd out the spine or break a cgroup limit.
"""

from .buffers import ALIGN, AlignedBuffer, align_down, align_up
from .file import LocalFile, ReadStats

__all__ = ["ALIGN", "AlignedBuffer", "align_down", "align_up", "LocalFile", "ReadStats"]
