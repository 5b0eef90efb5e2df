"""Locations: what a path or URL names, and the one place sources and stores are opened.

``open_source(location)`` opens one byte source, ``open_store(location)`` a model's
directory of files; both decide the kind of storage here and nowhere else. The rule, one
for every caller: **an existing local path wins** (whatever its name looks like); otherwise
``http://``, ``https://`` and ``s3://`` name remote stores, which this version cannot read
yet (a ``RemoteUnavailableError`` that says so), and any other ``scheme://`` is refused;
everything else is a local path (a missing one fails where it is opened, naming it).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..errors import CheckpointError
from .file import LocalFile
from .source import ByteSource, ReadStats
from .store import LocalDir, Store

REMOTE_SCHEMES = ("http", "https", "s3")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")


class RemoteUnavailableError(CheckpointError):
    """A model or file was named by a URL, and this Sluice cannot read remote stores."""


def url_scheme(location: str | os.PathLike) -> str | None:
    """The lower-case scheme of a URL (``"s3"``, ``"https"``), or None for a plain path."""
    if not isinstance(location, str):
        return None
    m = _SCHEME.match(location)
    return m.group(1).lower() if m else None


def is_url(location: str | os.PathLike) -> bool:
    """True for a location that names a remote store (an ``http(s)://`` or ``s3://`` URL) and is not
    an existing local path."""
    return url_scheme(location) is not None and not Path(location).exists()


def local_path(location: str | os.PathLike) -> Path:
    """The local path ``location`` names, by the precedence rule of this module; a URL raises
    ``RemoteUnavailableError`` (or ``CheckpointError`` for a scheme Sluice does not know)."""
    path = Path(location)
    scheme = url_scheme(location)
    if scheme is None or path.exists():
        return path
    if scheme in REMOTE_SCHEMES:
        raise RemoteUnavailableError(
            f"{location}: remote model stores ({', '.join(s + '://' for s in REMOTE_SCHEMES)}) are not available "
            "in this version of Sluice yet; copy the model to a local directory and pass its path")
    raise CheckpointError(f"{location}: unknown URL scheme {scheme!r}; Sluice reads local paths")


def open_source(location: str | os.PathLike, *, direct: bool | None = None,
                stats: ReadStats | None = None) -> ByteSource:
    """The ``ByteSource`` for ``location``: a ``LocalFile`` (``direct``: None probes O_DIRECT, False
    forces buffered reads). Raises ``OSError`` naming a local file that cannot be opened."""
    return LocalFile(str(local_path(location)), direct=direct, stats=stats)


def open_store(location: str | os.PathLike) -> Store:
    """The ``Store`` (a model's files by name) at ``location``: a ``LocalDir`` for a local path."""
    return LocalDir(local_path(location))
