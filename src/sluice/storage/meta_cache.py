"""Remote metadata kept in the local cache directory, so a restart revalidates it instead of refetching.

Metadata is what a model's opening reads before any expert: ``config.json``, the shard index, a
container's ``manifest.json``, tokenizer files (members read whole by ``RemoteStore.read_bytes``)
and safetensors headers (small ranges read by ``RemoteSource.pread``). Each is kept here under
the object's URL and byte range, with the ETag the server gave it; the newest version only (a
changed object's copy is replaced, never kept beside it).

Using a copy: a range of an object whose ETag is known this run (the HEAD that opened it) is
served from its copy only when the copy's ETag is that ETag, with no request; a member read
whole is revalidated by one conditional GET (``If-None-Match``: the server answers 304 and no
body), or by nothing when this run's HEAD of it already gave the copy's ETag. A copy with
another ETag is never used: the object is fetched again and the copy replaced. An object
served without an ETag is not kept.

A copy is one file, ``<dir>/<2 hex>/<40 hex>.meta`` (the SHA-1 of URL and range): a magic
line, a JSON line (URL, ETag, offset, length, the body's size and CRC-32) and the body,
published by rename. A copy that fails any check (magic, header, URL, range, size, CRC) is
removed with a warning and the metadata fetched again; its bytes are never returned. Failing
to write a copy (a read-only or full disk) never fails a read: one warning, then no copies.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import threading
import warnings
from pathlib import Path

from .crc import crc32
from .store import user_cache_dir

MAGIC = b"SLUICE-META 1\n"
MAX_BYTES = 64 << 20  # metadata larger than this (a huge tokenizer?) is fetched each time, not kept


def default_dir() -> Path:
    """``$XDG_CACHE_HOME/sluice/meta`` (``~/.cache/sluice/meta``)."""
    return user_cache_dir() / "meta"


class MetaCache:
    """Copies of remote metadata in ``directory`` (default ``default_dir()``), checked on every use.

    ``counts``: ``hits`` (copies used), ``stored``, ``corrupt`` (copies that failed a check)."""

    def __init__(self, directory: str | os.PathLike | None = None):
        self.dir = Path(directory) if directory is not None else default_dir()
        self.counts = {"hits": 0, "stored": 0, "corrupt": 0}
        self._lock = threading.Lock()
        self._warned = False

    def path(self, url: str, offset: int, length: int | None) -> Path:
        name = hashlib.sha1(f"{url}\0{offset}\0{'' if length is None else length}".encode()).hexdigest()
        return self.dir / name[:2] / f"{name}.meta"

    def get(self, url: str, offset: int = 0, length: int | None = None) -> tuple[str, bytes] | None:
        """``(etag, body)`` of the copy of ``url``'s bytes ``offset`` .. ``offset + length`` (``length``
        None: the whole object), or None when there is none or it failed a check (then removed)."""
        p = self.path(url, offset, length)
        try:
            raw = p.read_bytes()
        except OSError:
            return None
        try:
            if not raw.startswith(MAGIC):
                raise ValueError("bad magic")
            end = raw.index(b"\n", len(MAGIC))
            h = json.loads(raw[len(MAGIC):end].decode("utf-8"))
            body = raw[end + 1:]
            if not isinstance(h, dict) or (h.get("url"), h.get("offset"), h.get("length")) != (url, offset, length):
                raise ValueError("header names another object or range")
            etag = h.get("etag")
            if not isinstance(etag, str) or not etag or h.get("size") != len(body) or h.get("crc") != crc32(body):
                raise ValueError("body does not match its header (size or CRC-32)")
        except (ValueError, UnicodeDecodeError) as e:
            with self._lock:
                self.counts["corrupt"] += 1
            warnings.warn(f"cached metadata {p} for {url} is corrupt ({e}); removed it and fetching it again",
                          stacklevel=3)
            with contextlib.suppress(OSError):
                p.unlink()
            return None
        with self._lock:
            self.counts["hits"] += 1
        return etag, body

    def put(self, url: str, etag: str | None, body: bytes, offset: int = 0, length: int | None = None) -> None:
        """Keep ``body`` as the copy of ``url``'s range at version ``etag`` (nothing without an ETag)."""
        if not etag or len(body) > MAX_BYTES:
            return
        p = self.path(url, offset, length)
        head = json.dumps({"url": url, "etag": etag, "offset": offset, "length": length, "size": len(body),
                           "crc": crc32(body)}, separators=(",", ":")).encode()
        tmp = p.with_name(f".{p.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(MAGIC + head + b"\n")
                f.write(body)
            os.replace(tmp, p)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            with self._lock:
                warn, self._warned = not self._warned, True
            if warn:
                warnings.warn(f"cannot keep remote metadata in {self.dir} ({e.strerror or e}); it is fetched again "
                              "at every start", stacklevel=3)
            return
        with self._lock:
            self.counts["stored"] += 1


__all__ = ["MAGIC", "MetaCache", "default_dir"]
