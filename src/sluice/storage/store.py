"""Stores: a model's files by member name (``config.json``, shards, the manifest, tokenizer files).

Metadata is read through a ``Store`` as data tables are through byte sources: small files
whole (``read_bytes``), data files as ``ByteSource``s (``open``). A library that can open
a file of its own (the tokenizer library) gets the member itself from ``local_path`` for a
local directory; any other store gives None and its member is read with ``read_bytes`` (a
remote store's through ``meta_cache``: no second copy on disk). ``LocalDir`` is the local
implementation; ``location.open_store`` opens a store from a path or a URL.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .file import LocalFile
from .regular import kind, read_regular
from .source import ByteSource, ReadStats


def user_cache_dir() -> Path:
    """Sluice's directory under the user cache directory (``$XDG_CACHE_HOME`` or ``~/.cache``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "sluice"


class Store:
    """A model's files by member name (a plain file name inside the model).

    ``location`` is the store as the user named it (a directory path or a URL). A
    missing member raises ``FileNotFoundError`` from ``read_bytes`` and ``open``; other
    failures raise ``OSError``. Callers turn both into errors that name ``locate(name)``.
    """

    location: str

    def locate(self, name: str) -> str:
        """The member's own location (a path or URL): what errors name and sources are keyed by."""
        raise NotImplementedError

    def exists(self, name: str) -> bool:
        """True when member ``name`` is there (a file; a directory of that name is not a member)."""
        raise NotImplementedError

    def is_directory(self) -> bool:
        """True when the store itself exists (a directory, a bucket prefix)."""
        raise NotImplementedError

    def names(self) -> list[str]:
        """The member files, sorted."""
        raise NotImplementedError

    def read_bytes(self, name: str, limit: int | None = None) -> bytes:
        """A small member (config, index, manifest, tokenizer file) whole; one of more than ``limit``
        bytes raises ``regular.FileTooLargeError`` before it is read."""
        raise NotImplementedError

    def read_text(self, name: str) -> str:
        """A small member as UTF-8 text (``UnicodeDecodeError`` if it is not)."""
        return self.read_bytes(name).decode("utf-8")

    def open(self, name: str, *, direct: bool | None = None, stats: ReadStats | None = None) -> ByteSource:
        """A data member as a byte source."""
        raise NotImplementedError

    def local_path(self, name: str) -> Path | None:
        """Member ``name`` as a local file a library may open itself (the tokenizer library), or None
        for a store with no local files (its members are read with ``read_bytes``: a remote one's
        through its metadata cache, the one local copy Sluice keeps of them)."""
        return None

    def not_regular(self, name: str) -> str | None:
        """What member ``name`` is, in words, when it is there but no regular file (a FIFO, a
        directory, ...); None for a regular file, a missing one, or a store without local files."""
        return None


class LocalDir(Store):
    """A local directory: members are its files; ``local_path`` is the file itself."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.location = str(self.path)

    def locate(self, name: str) -> str:
        return str(self.path / name)

    def exists(self, name: str) -> bool:
        return (self.path / name).is_file()

    def is_directory(self) -> bool:
        return self.path.is_dir()

    def names(self) -> list[str]:
        return sorted(p.name for p in self.path.iterdir() if p.is_file())

    def read_bytes(self, name: str, limit: int | None = None) -> bytes:
        return read_regular(self.path / name, limit)  # a FIFO member: NotRegularFileError, not a hang

    def open(self, name: str, *, direct: bool | None = None, stats: ReadStats | None = None) -> ByteSource:
        return LocalFile(self.locate(name), direct=direct, stats=stats)

    def local_path(self, name: str) -> Path:
        return self.path / name

    def not_regular(self, name: str) -> str | None:
        try:
            mode = os.stat(self.path / name).st_mode  # through a symlink, as a library would open it
        except OSError:
            return None
        return None if stat.S_ISREG(mode) else kind(mode)

    def __repr__(self) -> str:
        return f"<LocalDir {self.location}>"
