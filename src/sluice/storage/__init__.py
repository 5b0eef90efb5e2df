"""Storage: bytes and files, behind one seam. Storage knows bytes, not caching or models.

- ``ByteSource`` (``source.py``): a read-only run of bytes with its read rules (alignment,
  read size, direct I/O, version); ``LocalFile`` (``file.py``) is the local implementation:
  O_DIRECT when the filesystem allows it (decided by a probe read at open), otherwise
  buffered reads that drop their pages from the page cache afterwards, so expert reads never
  crowd out the spine or break a cgroup limit.
- ``Store`` (``store.py``): a model's files by name, small ones read whole; ``LocalDir``.
- ``RemoteSource`` / ``RemoteStore`` (``remote.py``, the optional ``remote`` extra): an object
  or a model's files at an ``s3://`` or ``http(s)://`` URL, read by ranged GETs.
- ``DiskTier`` (``disk_tier.py``; its entry files: ``tier_entry.py``; the size bound its processes
  share: ``tier_openers.py``) and ``TieredSource`` (``tiered.py``): the local disk tier of remote
  models (``--disk-cache``): ranges fetched are kept on disk, CRC-checked, shared by processes.
- ``MetaCache`` (``meta_cache.py``): a remote model's metadata (config, index, manifest,
  tokenizer files, safetensors headers) kept in the local cache by URL and ETag, revalidated at
  a restart instead of refetched.
- ``open_source`` / ``open_store`` (``location.py``): the one place a path or a URL is
  turned into a source or a store; ``Sources`` (``sources.py``): the sources a model has
  open, with a wrapping hook (``faults.py`` injects faults through it).
"""

from .buffers import ALIGN, AlignedBuffer, align_down, align_up
from .file import LocalFile
from .location import RemoteUnavailableError, check_location, is_url, open_source, open_store, url_scheme
from .source import ByteSource, ReadStats, WrappedSource
from .sources import Sources
from .store import LocalDir, Store

__all__ = ["ALIGN", "AlignedBuffer", "align_down", "align_up", "ByteSource", "LocalDir", "LocalFile", "ReadStats",
           "RemoteUnavailableError", "Sources", "Store", "WrappedSource", "check_location", "is_url", "open_source",
           "open_store", "url_scheme"]
