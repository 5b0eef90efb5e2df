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

``survey`` and ``clear`` are ``sluice cache list|clear``'s view of the directory: a file is a copy
only when its name is one a copy gets (``<2 hex>/<40 hex>.meta``, or a writer's temporary
``.<40 hex>.meta.<pid>.<8 hex>.tmp``) and it starts with the magic line; anything else is a
foreign file, counted and left alone. A copy whose header cannot be read (corrupt) is still a
copy: cleared with everything, but never matched to a model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import secrets
import stat
import threading
import warnings
from pathlib import Path

from .crc import crc32
from .regular import read_regular
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
            raw = read_regular(p)  # a FIFO or directory under a copy's name: no copy, never a hang
        except OSError:
            return None
        try:
            if not raw.startswith(MAGIC):
                raise ValueError("bad magic")
            end = raw.index(b"\n", len(MAGIC))
            try:
                h = json.loads(raw[len(MAGIC):end].decode("utf-8"))
            except RecursionError:
                raise ValueError("header nests too deep") from None
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


_SUBDIR = re.compile(r"^[0-9a-f]{2}$")
_COPY = re.compile(r"^([0-9a-f]{40})\.meta$")
_TEMP = re.compile(r"^\.([0-9a-f]{40})\.meta\.(\d+)\.[0-9a-f]{8}\.tmp$")
_HEAD_MAX = 1 << 20  # a header line longer than this is not one ``put`` wrote


@dataclasses.dataclass
class Copy:
    """A file of the metadata cache: ``url`` from its header (None: unreadable, a corrupt copy);
    ``writer``: the pid of the process writing it, for a temporary file."""

    path: Path
    size: int
    url: str | None
    writer: int | None = None


@dataclasses.dataclass
class Survey:
    """What ``directory`` holds: the cache's files, foreign files (left alone) and what could not be
    read (``problems``: one line each)."""

    dir: Path
    exists: bool = False
    copies: list[Copy] = dataclasses.field(default_factory=list)
    foreign: list[Path] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)

    def totals(self) -> dict:
        done = [c for c in self.copies if c.writer is None]
        return {"files": len(done), "bytes": sum(c.size for c in done),
                "corrupt": sum(1 for c in done if c.url is None),
                "partial": len(self.copies) - len(done), "foreign": len(self.foreign)}


def _read_copy(path: Path, writer: int | None) -> Copy | None:
    """The copy at ``path``, or None when it is not one (not a plain file, no magic line)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:  # a link, or gone
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        head = os.pread(fd, len(MAGIC) + _HEAD_MAX, 0)
    finally:
        os.close(fd)
    if not head.startswith(MAGIC):
        return None
    url = None
    end = head.find(b"\n", len(MAGIC))
    if end > 0:
        with contextlib.suppress(ValueError, UnicodeDecodeError, RecursionError):
            h = json.loads(head[len(MAGIC):end].decode("utf-8"))
            if isinstance(h, dict) and isinstance(h.get("url"), str):
                url = h["url"]
    return Copy(path, st.st_size, url, writer)


def survey(directory: str | os.PathLike | None = None) -> Survey:
    """The metadata cache's files in ``directory`` (default ``default_dir()``); never raises for what
    is on disk: what cannot be read is a line in ``problems``."""
    s = Survey(Path(directory) if directory is not None else default_dir())
    try:
        top = sorted(os.scandir(s.dir), key=lambda e: e.name)
    except FileNotFoundError:
        return s
    except OSError as e:
        s.exists = os.path.lexists(s.dir)
        s.problems.append(f"cannot read {s.dir}: {e.strerror or e}")
        return s
    s.exists = True
    for sub in top:
        if not (_SUBDIR.match(sub.name) and sub.is_dir(follow_symlinks=False)):
            s.foreign.append(Path(sub.path))
            continue
        try:
            files = sorted(os.scandir(sub.path), key=lambda e: e.name)
        except OSError as e:
            s.problems.append(f"cannot read {sub.path}: {e.strerror or e}")
            continue
        for f in files:
            m, t = _COPY.match(f.name), _TEMP.match(f.name)
            name = m.group(1) if m else t.group(1) if t else None
            copy = None
            if name is not None and name.startswith(sub.name):
                try:
                    copy = _read_copy(Path(f.path), int(t.group(2)) if t else None)
                except OSError as e:
                    s.problems.append(f"cannot read {f.path}: {e.strerror or e}")
                    continue
            if copy is None:
                s.foreign.append(Path(f.path))
            else:
                s.copies.append(copy)
    return s


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


def covers(model: str, url: str) -> bool:
    """Whether ``url`` (a copy's) is ``model`` or a file inside it."""
    model = model.rstrip("/")
    return url == model or url.startswith(model + "/")


def clear(directory: str | os.PathLike | None = None, model: str | None = None) -> tuple[Survey, dict]:
    """Remove the metadata cache's copies (``model``: only those of its URLs; None: all, corrupt
    ones and dead writers' temporary files included). Returns the survey made before and
    ``{"files", "bytes"}`` removed; what could not be removed is added to the survey's problems,
    and the removed copies are taken out of it."""
    s = survey(directory)
    removed = {"files": 0, "bytes": 0}
    kept = []
    for c in s.copies:
        if c.writer is not None:
            go = model is None and not _alive(c.writer)  # a live writer's file is renamed into place soon
        else:
            go = model is None or (c.url is not None and covers(model, c.url))
        if not go:
            kept.append(c)
            continue
        try:
            c.path.unlink()
        except FileNotFoundError:
            continue  # removed meanwhile (a reader found it corrupt)
        except OSError as e:
            s.problems.append(f"cannot remove {c.path}: {e.strerror or e}")
            kept.append(c)
            continue
        if c.writer is None:
            removed["files"] += 1
            removed["bytes"] += c.size
        with contextlib.suppress(OSError):
            c.path.parent.rmdir()  # only when empty
    s.copies = kept
    return s, removed


__all__ = ["MAGIC", "Copy", "MetaCache", "Survey", "clear", "covers", "default_dir", "survey"]
