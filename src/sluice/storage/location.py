"""Locations: what a path or URL names, and the one place sources and stores are opened.

``open_source(location)`` opens one byte source, ``open_store(location)`` a model's
directory of files; both decide the kind of storage here and nowhere else. The rule, one
for every caller: **an existing local path wins** (whatever its name looks like); otherwise
``http://``, ``https://`` and ``s3://`` name remote stores, read by ``remote.RemoteSource``
and ``remote.RemoteStore`` when the optional ``remote`` extra (obstore) is installed (without
it a ``RemoteUnavailableError`` says what to install), and any other ``scheme://`` is refused;
everything else is a local path (a missing one fails where it is opened, naming it).

Remote options (``ca_bundle``: a PEM file of extra CA certificates; ``endpoint``: an
S3-compatible endpoint, else ``AWS_ENDPOINT_URL``) are passed through to the remote client.
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
    """A model or file was named by a URL, and the remote extra (obstore) is not installed."""


def url_scheme(location: str | os.PathLike) -> str | None:
    """The lower-case scheme of a URL (``"s3"``, ``"https"``), or None for a plain path."""
    if not isinstance(location, str):
        return None
    m = _SCHEME.match(location)
    return m.group(1).lower() if m else None


def is_url(location: str | os.PathLike) -> bool:
    """True for a location that names a remote store (an ``http(s)://`` or ``s3://`` URL) and is not
    an existing local path."""
    return url_scheme(location) in REMOTE_SCHEMES and not Path(location).exists()


def check_location(location: str | os.PathLike) -> None:
    """Raise ``CheckpointError`` for a ``scheme://`` Sluice does not read (and is no local path)."""
    scheme = url_scheme(location)
    if scheme is not None and scheme not in REMOTE_SCHEMES and not Path(location).exists():
        raise CheckpointError(f"{location}: unknown URL scheme {scheme!r}; Sluice reads local paths and "
                              f"{', '.join(s + '://' for s in REMOTE_SCHEMES)} URLs")


def _remote(location: str):
    """The ``remote`` module, or ``RemoteUnavailableError`` naming ``location`` without the extra."""
    from . import remote  # imports obstore only when used

    try:
        import obstore  # noqa: F401  (the optional extra)
    except ImportError:
        raise RemoteUnavailableError(f"{location}: {remote.INSTALL_HINT}") from None
    return remote


def open_source(location: str | os.PathLike, *, direct: bool | None = None,
                stats: ReadStats | None = None, disk_tier=None, **remote_options) -> ByteSource:
    """The ``ByteSource`` for ``location``: a ``LocalFile`` (``direct``: None probes O_DIRECT, False
    forces buffered reads) or a ``RemoteSource`` for a URL (never direct I/O), read through
    ``disk_tier`` (a ``disk_tier.DiskTier``) when one is given. Raises ``OSError`` naming a file
    that cannot be opened."""
    check_location(location)
    if is_url(location):
        source = _remote(location).RemoteSource(location, stats=stats, **remote_options)
        if disk_tier is not None:
            from .tiered import TieredSource

            source = TieredSource(source, disk_tier, str(location).rpartition("/")[0])
        return source
    return LocalFile(str(location), direct=direct, stats=stats)


def open_store(location: str | os.PathLike, *, disk_tier=None, progress=None, **remote_options) -> Store:
    """The ``Store`` (a model's files by name) at ``location``: a ``LocalDir`` for a local path, a
    ``RemoteStore`` for a URL, its data files read through ``disk_tier`` when one is given (a local
    model needs no disk tier: it is ignored there). ``progress``: a ``progress.Activity`` told of a
    remote store's metadata requests (a local directory makes none)."""
    check_location(location)
    if is_url(location):
        store = _remote(location).RemoteStore(str(location), progress=progress, **remote_options)
        if disk_tier is not None:
            from .tiered import TieredStore

            store = TieredStore(store, disk_tier)
        return store
    return LocalDir(location)
