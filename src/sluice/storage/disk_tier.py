"""The local disk tier: byte ranges of remote objects kept on local disk, bounded by size.

Memory (the expert cache) -> this tier -> the remote store. ``tiered.TieredSource`` wraps a remote
byte source (``location.open_source``/``open_store`` put it around every ``RemoteSource`` when
a tier is given, so no caller knows): a read first looks for the same range in the tier, and
a range fetched from the remote store is kept there. Expert records, spine tensors and
safetensors headers all go through it, each range an entry.

Entries. An entry is keyed by the object's URL, its version (the ETag pinned at open) and the
byte range (offset, length): a changed object has new keys and never meets an old entry. An
entry is one file, ``entries/<2 hex>/<40 hex>.entry`` (the SHA-1 of the key): a 4096-byte
header (a magic line and a JSON object: the key, the model, the payload's CRC-32) and the
payload, zero-padded to a multiple of 4096 so the tier reads it back with O_DIRECT
(``file.LocalFile``: probed once, buffered reads without page cache where the filesystem
refuses O_DIRECT). The CRC-32 (``crc.py``) is computed on insert and checked on every read:
a corrupt entry (a flipped bit on disk, a bad header) is dropped and the range refetched;
its bytes are never returned.

Publishing. A new entry is written to ``tmp/<name>.<pid>.<random>.tmp``, fsynced and then
renamed into place (and the directory fsynced), so an entry is complete or absent; a killed
writer leaves only a temporary file, which lookups never see and the next tier to open
removes (its writer is gone, or it is over an hour old). Entries are immutable once published.

Sharing. Processes share a tier directory: inserts, evictions, drops and the index updates
run under an exclusive ``fcntl.flock`` on ``lock`` (and a thread lock within a process);
lookups open the entry file by name without any lock (a file evicted while another process
reads it stays readable through the open descriptor). A tier keeps up to ``OPEN_ENTRIES`` entry
files open between hits (least recently used closed first); one it evicts, drops or clears is
closed with it. The index (``index.sqlite``: each
entry's model, key, size and score) is only bookkeeping: at open, a tier reconciles it with
the files (rows without a file are dropped, entry files without a row are re-indexed from
their headers), and a damaged index is rebuilt from the entries.

Bound and eviction. The entry files' bytes (headers and padding included) stay within the
tier's bound, one for the directory as a whole: the smallest ``--disk-cache SIZE`` of the
processes that have it open now (``tier_openers.py``: each opener's size in a record it holds
an exclusive ``flock`` on while it is open; an insert, under the tier lock, takes the smallest
size of the records whose lock is held, and removes the records of openers that are gone: a
killed process never holds the bound). A process that opens the tier with a smaller size than
the others evicts down to it at open, and the others keep to it until it closes. The policy is
the memory cache's kind, decayed frequency (lfru, the one rule of ``sluice.decay``): each use of an entry adds 1 to its
score, and scores halve every ``HALF_LIFE_S`` (six hours) of wall-clock time; the entry with
the lowest score goes first. Scores are kept as ``log2(sum of 2^(t_use / half-life))``, so
ordering them needs no decay pass; uses are batched in memory and written to the index every
``FLUSH_HITS`` hits or ``FLUSH_S`` seconds. An entry larger than the whole tier is not kept.

Safety. A tier directory holds a marker file (``SLUICE-DISK-TIER``). A tier is opened only in
a new or empty directory (and then marked) or a marked one: a directory of other files is
refused, so a mistyped ``--disk-cache-dir`` never gets written into or cleaned. Clearing
removes only files the tier names itself (entry and temporary file names in ``entries/``
and ``tmp/``); anything else in the directory is left alone.

A full disk or any other failure to write an entry never fails a read: the bytes were
already fetched; a warning says once per tier that entries are not being kept.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import re
import secrets
import sqlite3
import threading
import time
import warnings
from collections import OrderedDict
from pathlib import Path

from ..decay import log2_add
from ..errors import InvalidArgumentError, SluiceError
from ..units import parse_size
from .buffers import AlignedBuffer
from . import tier_openers
from .crc import crc32
from .regular import open_regular
from .store import user_cache_dir
from .tier_entry import (ENTRY_RE, HEADER_BYTES, STAGING_BYTES, EntryFile, Key, entry_size, fsync_dir, make_header,
                         parse_header, read_entry, write_all)

MARKER = "SLUICE-DISK-TIER"
MARKER_TEXT = ("Sluice disk tier (format 1). Entries live in entries/, files being written in tmp/; "
               "`sluice cache list` shows them and `sluice cache clear` removes them.\n")
INDEX = "index.sqlite"
LOCK = "lock"
ENTRIES = "entries"
TMP = "tmp"
SHARD_RE = re.compile(r"^[0-9a-f]{2}$")
TMP_RE = re.compile(r"^[0-9a-f]{40}\.(\d+)\.[0-9a-f]{8}\.tmp$")
HALF_LIFE_S = 6 * 3600.0  # scores halve every six hours of wall-clock time
STALE_TMP_S = 3600.0  # a temporary file this old is a dead writer's, whatever its pid says
FLUSH_HITS = 32
FLUSH_S = 5.0
# Entry files kept open between hits (least recently used closed first): a hit is then one preadv, not
# open + fstat + preadv + close (each a GIL release and re-take in a reader thread; measured in
# docs/remote.md). Entries are immutable, so an open one always reads its own bytes; one this process
# evicts or drops is closed at once, one another process evicts holds its disk space until closed here.
OPEN_ENTRIES = 256


class DiskTierError(SluiceError):
    """The disk tier directory cannot be used (not creatable or writable, or not a tier)."""


def default_dir() -> Path:
    """The tier's directory when ``--disk-cache-dir`` is not given: ``$XDG_CACHE_HOME/sluice/disk-tier``
    (``~/.cache/sluice/disk-tier``)."""
    return user_cache_dir() / "disk-tier"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class DiskTier:
    """A tier directory opened by this process (see the module docstring).

    ``capacity``: the most bytes its entries may take (None: only for listing and clearing).
    ``create``: make the directory (and mark it) when it does not exist; otherwise a missing
    directory is a ``DiskTierError``.
    """

    def __init__(self, directory: str | os.PathLike, capacity: int | None = None, *, create: bool = True):
        self.dir = Path(os.path.abspath(os.path.expanduser(os.fspath(directory))))
        if capacity is not None and (not isinstance(capacity, int) or capacity <= 0):
            raise InvalidArgumentError(f"disk_cache (--disk-cache) must be a size above 0 bytes, got {capacity!r}")
        self.capacity = capacity
        self.entries_dir, self.tmp_dir = self.dir / ENTRIES, self.dir / TMP
        self._tlock = threading.RLock()
        self._local = threading.local()
        self._pending: dict[str, list] = {}  # name -> [uses, last use time] not yet in the index
        self._pending_n = 0
        self._last_flush = time.monotonic()
        self._direct: bool | None = None  # None: probe O_DIRECT on the next entry opened
        self._open: OrderedDict[str, EntryFile] = OrderedDict()  # entry files kept open (OPEN_ENTRIES)
        self._open_lock = threading.Lock()
        self._warned = False
        self.counts = {"hits": 0, "misses": 0, "corrupt": 0, "inserted": 0, "evicted": 0, "write_errors": 0}
        self._lock_fd = -1
        self._opener_fd = -1
        self._opener: Path | None = None  # this opener's record of its size (``bound``)
        self._db: sqlite3.Connection | None = None
        self._claim(create)
        try:
            self._lock_fd = os.open(self.dir / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            for d in (self.entries_dir, self.tmp_dir, self.dir / tier_openers.OPENERS):
                d.mkdir(exist_ok=True)
        except OSError as e:
            self.close()
            raise DiskTierError(f"disk tier directory {self.dir}: cannot write in it ({e.strerror or e})") from None
        try:
            with self._locked():
                self._open_index()
                if capacity is not None:
                    self._register()
                self._sweep()
        except BaseException as e:
            self.close()
            if isinstance(e, (OSError, sqlite3.Error)):
                reason = getattr(e, "strerror", None) or e
                raise DiskTierError(f"disk tier directory {self.dir}: cannot use it ({reason})") from None
            raise

    # -- opening ---------------------------------------------------------------------------

    def _claim(self, create: bool) -> None:
        """Use ``self.dir`` only if it is a tier, or new or empty (then mark it)."""
        d = self.dir
        where = f"disk tier directory {d}"
        if not d.exists():
            if not create:
                raise DiskTierError(f"{where}: does not exist (no disk tier there)")
            try:
                d.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise DiskTierError(f"{where}: cannot create it ({e.strerror or e})") from None
        if not d.is_dir():
            raise DiskTierError(f"{where}: not a directory")
        if (d / MARKER).is_file():
            return
        try:
            present = [p.name for p in d.iterdir()]
        except OSError as e:
            raise DiskTierError(f"{where}: cannot read it ({e.strerror or e})") from None
        if present:
            raise DiskTierError(
                f"{where}: not a Sluice disk tier (no {MARKER} file) and not empty ({len(present)} entries, e.g. "
                f"{sorted(present)[0]!r}); Sluice keeps its tier only in a new or empty directory, so it never "
                "writes into or deletes from a directory of other files: give another --disk-cache-dir")
        if not create:
            raise DiskTierError(f"{where}: empty, no disk tier there")
        try:
            tmp = d / f".{MARKER}.{os.getpid()}.tmp"
            tmp.write_text(MARKER_TEXT)
            os.replace(tmp, d / MARKER)
        except OSError as e:
            raise DiskTierError(f"{where}: cannot write in it ({e.strerror or e})") from None

    def _open_index(self) -> None:
        path = self.dir / INDEX
        for attempt in (0, 1):
            db = None
            try:
                db = sqlite3.connect(path, timeout=60, isolation_level=None, check_same_thread=False)
                db.execute("PRAGMA journal_mode=WAL")
                db.execute("PRAGMA synchronous=NORMAL")
                db.execute("CREATE TABLE IF NOT EXISTS entries (name TEXT PRIMARY KEY, model TEXT NOT NULL, "
                           "url TEXT NOT NULL, version TEXT NOT NULL, offset INTEGER NOT NULL, length INTEGER NOT "
                           "NULL, size INTEGER NOT NULL, crc INTEGER NOT NULL, score REAL NOT NULL, hits INTEGER "
                           "NOT NULL, created REAL NOT NULL)")
                db.execute("CREATE INDEX IF NOT EXISTS entries_score ON entries (score)")
                db.execute("CREATE INDEX IF NOT EXISTS entries_url ON entries (url)")
                db.execute("SELECT COUNT(*) FROM entries").fetchone()
                db.create_function("lse2", 2, log2_add, deterministic=True)  # the one rule: sluice.decay
                self._db = db
                return
            except sqlite3.DatabaseError as e:
                if db is not None:
                    db.close()
                if attempt or isinstance(e, sqlite3.OperationalError):  # locked, read-only, no permission: not damage
                    raise DiskTierError(f"disk tier directory {self.dir}: cannot open its index {path} ({e})") from None
                # a damaged index: it is only bookkeeping, rebuilt from the entries' headers by _sweep
                warnings.warn(f"disk tier {self.dir}: its index was damaged ({e}); rebuilding it from the entries",
                              stacklevel=4)
                for suffix in ("", "-wal", "-shm", "-journal"):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(f"{path}{suffix}")

    @contextlib.contextmanager
    def _locked(self):
        """This process's threads, then all processes: the index and the entry files change only here."""
        with self._tlock:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _register(self) -> None:
        """Record this opener's size where the others see it, locked while it is open (locked)."""
        self._opener_fd, self._opener = tier_openers.register(self.dir, self.capacity)

    def bound(self) -> int | None:
        """The most bytes the tier's entries may take now: the smallest size of the processes that have
        it open (this one's included; None when none is); the records of openers that are gone are
        removed (locked)."""
        return tier_openers.scan(self.dir, self._opener, self.capacity)[0]

    def openers(self) -> tuple[int | None, int]:
        """(the bound now, how many openers with a size hold the tier open, this one included)."""
        with self._locked():
            return tier_openers.scan(self.dir, self._opener, self.capacity)

    def _entry_files(self) -> dict[str, Path]:
        out: dict[str, Path] = {}
        for sub in self.entries_dir.iterdir():
            if SHARD_RE.match(sub.name) and sub.is_dir() and not sub.is_symlink():  # never follow a link out
                for f in sub.iterdir():
                    if ENTRY_RE.match(f.name):
                        out[f.name[:40]] = f
        return out

    def _sweep(self) -> None:
        """Reconcile the index with the entry files and remove dead writers' temporary files (locked)."""
        db = self._db
        rows = {name for (name,) in db.execute("SELECT name FROM entries")}
        files = self._entry_files()
        db.execute("BEGIN")
        for name in rows - set(files):
            db.execute("DELETE FROM entries WHERE name = ?", (name,))
        for name in set(files) - rows:
            self._reindex(name, files[name])
        db.execute("COMMIT")
        now = time.time()
        for f in self.tmp_dir.iterdir():
            m = TMP_RE.match(f.name)
            if not m:
                continue  # not a name the tier gives: not ours to remove
            try:
                old = now - f.stat().st_mtime > STALE_TMP_S
            except FileNotFoundError:
                continue
            if old or not _pid_alive(int(m.group(1))):
                with contextlib.suppress(FileNotFoundError):
                    f.unlink()
        if self.capacity is not None:
            self._make_room(0)

    def _reindex(self, name: str, path: Path) -> None:
        """An entry file the index does not know (its writer died between publishing and indexing, or
        the index was rebuilt): index it from its header, or remove it if the header is bad."""
        try:
            fd = open_regular(path)  # a FIFO or directory under an entry's name: not an entry, removed below
            with open(fd, "rb") as f:
                head = f.read(HEADER_BYTES)
                size = os.fstat(f.fileno()).st_size
            h = parse_header(head)
            key = Key(h["url"], h["version"], int(h["offset"]), int(h["length"]))
            if key.name != name or size != entry_size(key.length):
                raise ValueError("header does not match the file")
            self._db.execute("INSERT OR REPLACE INTO entries VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                             (name, str(h["model"]), key.url, key.version, key.offset, key.length, size,
                              int(h["crc"]), os.stat(path).st_mtime / HALF_LIFE_S, 0, time.time()))
        except (OSError, ValueError, KeyError, TypeError):
            with contextlib.suppress(OSError):  # a directory stays (unlink refuses it); it is never read
                path.unlink()

    # -- lookups and inserts ---------------------------------------------------------------

    def path(self, name: str) -> Path:
        return self.entries_dir / name[:2] / f"{name}.entry"

    def _staging(self) -> AlignedBuffer:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = AlignedBuffer(STAGING_BYTES)
        return buf

    def get(self, key: Key, dest: memoryview, room: memoryview | None = None) -> bool:
        """Fill ``dest`` (``key.length`` bytes) from the tier; False when the entry is not there or
        was corrupt (then dropped, and ``dest`` holds nothing useful). ``room``: ``read_entry``'s (the
        caller's buffer going on past ``dest``, which the read may fill with the entry's padding)."""
        name = key.name
        with self._open_lock:
            f = self._open.pop(name, None)  # this thread's alone while it reads; put back after
        if f is None:
            try:
                f = EntryFile(str(self.path(name)), self._direct)
            except OSError:
                return False  # not there (or unreadable: the caller fetches it)
        try:
            if self._direct is None:
                self._direct = f.direct_io  # the first entry's probe decides for the tier's filesystem
            ok = read_entry(f, key, dest, self._staging(), room)
        except OSError:
            ok = False
        if not ok:
            try:
                ino = os.fstat(f.dfd if f.dfd is not None else f.fd).st_ino
            except OSError:
                ino = None
            f.close()
            with self._tlock:
                self.counts["corrupt"] += 1
            warnings.warn(f"disk tier {self.dir}: entry {name} for {key.url} (bytes {key.offset}..."
                          f"{key.offset + key.length}) is corrupt; dropped it and reading the range again",
                          stacklevel=3)
            self._drop(name, ino)
            return False
        self._keep_open(name, f)
        self._use(name)
        return True

    def _keep_open(self, name: str, f: EntryFile) -> None:
        with self._open_lock:
            if self._db is None or name in self._open:  # closed, or another thread kept its own
                old = f
            else:
                self._open[name] = f
                old = self._open.popitem(last=False)[1] if len(self._open) > OPEN_ENTRIES else None
        if old is not None:
            old.close()

    def _close_open(self, names=None) -> None:
        """Close the kept-open entry files of ``names`` (None: all): entries being removed."""
        with self._open_lock:
            if names is None:
                files, self._open = list(self._open.values()), OrderedDict()
            else:
                files = [f for f in (self._open.pop(n, None) for n in names) if f is not None]
        for f in files:
            f.close()

    def _use(self, name: str) -> None:
        now = time.time()
        with self._tlock:
            self.counts["hits"] += 1
            p = self._pending.setdefault(name, [0, now])
            p[0] += 1
            p[1] = now
            self._pending_n += 1
            due = self._pending_n >= FLUSH_HITS or time.monotonic() - self._last_flush >= FLUSH_S
        if due:
            try:
                self.flush()
            except sqlite3.Error as e:  # bookkeeping only: the read itself succeeded
                warnings.warn(f"disk tier {self.dir}: cannot update its index ({e})", stacklevel=4)

    def _flush_locked(self) -> None:
        if not self._pending:
            return
        self._db.execute("BEGIN")
        for name, (uses, t) in self._pending.items():
            self._db.execute("UPDATE entries SET score = lse2(score, ?), hits = hits + ? WHERE name = ?",
                             (t / HALF_LIFE_S + math.log2(uses), uses, name))
        self._db.execute("COMMIT")
        self._pending.clear()
        self._pending_n = 0
        self._last_flush = time.monotonic()

    def flush(self) -> None:
        """Write the uses counted in memory to the index."""
        if self._db is None:
            return
        with self._locked():
            self._flush_locked()

    def put(self, key: Key, data: memoryview, model: str) -> bool:
        """Keep ``data`` (the bytes of ``key``) as an entry of ``model``; False when it was not kept
        (another process has it, it is larger than the tier, or writing failed: warned once)."""
        if self.capacity is None:
            return False
        with self._tlock:
            self.counts["misses"] += 1
        size = entry_size(key.length)
        name = key.name
        final = self.path(name)
        # a FIFO or directory there is no entry: replaced (or the write fails)
        if size > self.capacity or final.is_file():
            return False
        crc = crc32(data)
        header = make_header(key, crc, model)
        if header is None:
            return False  # a URL too long for the header block: not kept
        tmp = self.tmp_dir / f"{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                write_all(fd, memoryview(header))
                write_all(fd, data)
                pad = size - HEADER_BYTES - key.length
                if pad:
                    write_all(fd, memoryview(bytes(pad)))
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # written once, read back with O_DIRECT
            finally:
                os.close(fd)
            with self._locked():
                self._flush_locked()
                if final.is_file() or not self._make_room(size):
                    tmp.unlink()
                    return False
                final.parent.mkdir(exist_ok=True)
                os.replace(tmp, final)
                fsync_dir(final.parent)
                now = time.time()
                self._db.execute("INSERT OR REPLACE INTO entries VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                                 (name, model, key.url, key.version, key.offset, key.length, size, crc,
                                  now / HALF_LIFE_S, 0, now))
                self.counts["inserted"] += 1
            return True
        except (OSError, sqlite3.Error) as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            with self._tlock:
                self.counts["write_errors"] += 1
                warn, self._warned = not self._warned, True
            if warn:
                reason = getattr(e, "strerror", None) or e
                warnings.warn(f"disk tier {self.dir}: cannot keep an entry ({reason}); reads go on without keeping "
                              "what they fetch", stacklevel=3)
            return False

    def _make_room(self, size: int) -> bool:
        """Evict the lowest-scored entries until ``size`` more bytes fit in the shared bound (locked);
        False if they cannot."""
        db = self._db
        bound = self.bound()
        if size > bound:
            return False
        used = db.execute("SELECT COALESCE(SUM(size), 0) FROM entries").fetchone()[0]
        while used + size > bound:
            victims = db.execute("SELECT name, size FROM entries ORDER BY score ASC LIMIT 32").fetchall()
            if not victims:
                return False
            db.execute("BEGIN")
            self._close_open([name for name, _ in victims])
            for name, nbytes in victims:
                with contextlib.suppress(FileNotFoundError):
                    self.path(name).unlink()
                db.execute("DELETE FROM entries WHERE name = ?", (name,))
                self._pending.pop(name, None)
                self.counts["evicted"] += 1
                used -= nbytes
                if used + size <= bound:
                    break
            db.execute("COMMIT")
        return True

    def _drop(self, name: str, ino: int | None) -> None:
        """Remove a corrupt entry, unless another process has replaced it since it was read."""
        self._close_open([name])
        with self._locked():
            p = self.path(name)
            try:
                if ino is None or os.stat(p).st_ino == ino:
                    p.unlink()
            except FileNotFoundError:
                pass
            if not p.exists():
                self._db.execute("DELETE FROM entries WHERE name = ?", (name,))
            self._pending.pop(name, None)

    def forget_other_versions(self, url: str, version: str) -> int:
        """Drop the entries of ``url`` kept for another version of it (the object changed since):
        they can never be read again. Returns how many were dropped."""
        if self._db is None:
            return 0
        with self._tlock:
            stale = self._db.execute("SELECT name FROM entries WHERE url = ? AND version != ?",
                                     (url, version)).fetchall()
        if not stale:
            return 0
        self._close_open([name for (name,) in stale])
        with self._locked():
            self._db.execute("BEGIN")
            for (name,) in stale:
                with contextlib.suppress(FileNotFoundError):
                    self.path(name).unlink()
                self._db.execute("DELETE FROM entries WHERE name = ?", (name,))
                self._pending.pop(name, None)
            self._db.execute("COMMIT")
        return len(stale)

    # -- listing and clearing --------------------------------------------------------------

    def usage(self, model: str | None = None) -> dict:
        """``{"entries", "bytes", "hits"}`` of the whole tier or of one model's entries."""
        with self._tlock:
            where, args = ("WHERE model = ?", (model,)) if model is not None else ("", ())
            n, b, h = self._db.execute(f"SELECT COUNT(*), COALESCE(SUM(size), 0), COALESCE(SUM(hits), 0) "
                                       f"FROM entries {where}", args).fetchone()
        return {"entries": n, "bytes": b, "hits": h}

    def models(self) -> list[dict]:
        """Per model (its URL): entries, bytes, recorded hits, objects; largest first."""
        self.flush()
        with self._tlock:
            rows = self._db.execute("SELECT model, COUNT(*), SUM(size), SUM(hits), COUNT(DISTINCT url) FROM entries "
                                    "GROUP BY model ORDER BY SUM(size) DESC, model").fetchall()
        return [{"model": m, "entries": n, "bytes": b, "hits": h, "objects": o} for m, n, b, h, o in rows]

    def clear(self, model: str | None = None) -> dict:
        """Remove every entry (``model`` None, with dead writers' temporary files) or one model's;
        only files the tier names itself. Returns ``{"entries", "bytes"}`` removed."""
        removed = {"entries": 0, "bytes": 0}
        with self._locked():
            self._flush_locked()
            self._sweep()
            where, args = ("WHERE model = ?", (model,)) if model is not None else ("", ())
            rows = self._db.execute(f"SELECT name, size FROM entries {where}", args).fetchall()
            self._close_open([name for name, _ in rows])
            self._db.execute("BEGIN")
            for name, size in rows:
                with contextlib.suppress(FileNotFoundError):
                    self.path(name).unlink()
                self._db.execute("DELETE FROM entries WHERE name = ?", (name,))
                removed["entries"] += 1
                removed["bytes"] += size
            self._db.execute("COMMIT")
            if model is None:
                for sub in self.entries_dir.iterdir():
                    if SHARD_RE.match(sub.name) and sub.is_dir() and not sub.is_symlink():
                        with contextlib.suppress(OSError):
                            sub.rmdir()  # only if empty: a file the tier did not make stays, with its directory
        return removed

    def close(self) -> None:
        """Write pending uses to the index and release the index, the open entry files and the lock file;
        idempotent."""
        self._close_open()
        if self._db is not None:
            with contextlib.suppress(Exception):
                self.flush()
            with contextlib.suppress(Exception):
                self._db.close()
            self._db = None
        if self._opener is not None:
            tier_openers.unregister(self._opener_fd, self._opener)
            self._opener, self._opener_fd = None, -1
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def __del__(self):  # pragma: no cover - best effort: an engine that failed to load never closed it
        with contextlib.suppress(Exception):
            self.close()

    def __repr__(self) -> str:
        return f"<DiskTier {self.dir} capacity={self.capacity}>"


def open_tier(size, directory=None) -> DiskTier:
    """The tier ``load()``'s ``disk_cache``/``disk_cache_dir`` options ask for (``--disk-cache``,
    ``--disk-cache-dir``)."""
    capacity = parse_size(size, "disk_cache (--disk-cache)")
    if capacity <= 0:
        raise InvalidArgumentError(f"disk_cache (--disk-cache) must be more than 0 bytes, got {size!r}")
    return DiskTier(directory if directory is not None else default_dir(), capacity)


__all__ = ["ENTRY_RE", "HEADER_BYTES", "STAGING_BYTES", "DiskTier", "DiskTierError", "Key", "default_dir", "entry_size",
           "open_tier"]
