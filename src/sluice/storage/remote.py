"""Remote byte sources: one object on S3 or HTTP(S), read by ranged GETs (obstore).

``RemoteSource`` implements the ``ByteSource`` seam (``source.py``) for a URL: its ``size``
and ``version`` (the ETag) come from one HEAD at open; ``read_aligned``/``read_into`` issue
one ranged GET straight into the caller's buffer (one copy out of the client's response
buffer). Every GET carries ``If-Match: <ETag>``, so an object replaced while a model runs is
an error naming the URL, never a mix of old and new bytes. The client retries with
exponential backoff what is safe to retry (5xx, connection resets, timeouts) and resumes a
body cut short from where it stopped; what is left after ``retries`` is an ``OSError``
naming the URL, which the readers above turn into ``ExpertReadError``/``CheckpointError``.

Credentials: S3 reads the standard ``AWS_*`` environment variables (keys, session token,
region, ``AWS_ENDPOINT_URL``), and for what they do not set the profile in the AWS config
files (``aws_config.py``: ``AWS_PROFILE``, ``~/.aws/credentials``, ``~/.aws/config``); they are
never logged. The client (obstore) was chosen by
measurement against fsspec/s3fs (docs/remote.md). This module is imported only for a URL,
and obstore is the optional ``remote`` extra: without it a URL gets an error saying what to
install.
"""

from __future__ import annotations

import errno
import re
from datetime import datetime, timedelta, timezone
from urllib.parse import urlsplit

from ..progress import Activity
from . import interrupt
from .aws_config import AwsConfigError, missing_credentials, profile_settings
from .meta_cache import MetaCache
from .regular import FileTooLargeError
from .source import ByteSource, ReadStats
from .store import Store
from .urls import SECRETS, basic_auth_header, check_endpoint, environment_endpoints, mask, mask_url, split_userinfo

READ_BYTES = 16 << 20  # a ranged GET per piece of long sequential reads
RETRIES = 5
INSTALL_HINT = 'reading models from S3 or HTTP(S) needs the remote extra: pip install "sluice[remote]" (obstore)'


class RemoteObjectChangedError(OSError):
    """The object behind a URL changed (another ETag, Last-Modified or size) after Sluice opened it."""


class UnversionedObjectError(OSError):
    """A server that gives neither ETag nor Last-Modified: a change of the object could go unnoticed."""


_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)  # the client's Last-Modified when the server sent none
UNVERSIONED_HINT = ("pass --allow-unversioned-remote (Python: allow_unversioned_remote=True) to read it anyway, "
                    "accepting that a file replaced while or between runs goes unnoticed")


def validators(meta: dict) -> tuple[str | None, datetime | None]:
    """``(ETag, Last-Modified)`` of a HEAD or GET answer, None for what the server did not send."""
    modified = meta.get("last_modified")
    return meta.get("e_tag") or None, (modified if modified is not None and modified != _EPOCH else None)


def check_versioned(url: str, meta: dict, allow_unversioned: bool) -> None:
    """``UnversionedObjectError`` for an answer with neither ETag nor Last-Modified, unless allowed."""
    if not allow_unversioned and validators(meta) == (None, None):
        raise UnversionedObjectError(
            f"{url}: the server sends neither ETag nor Last-Modified, so Sluice cannot tell if the file changes "
            f"while or between runs (it could mix two versions, silently); {UNVERSIONED_HINT}")


def check_same(url: str, meta: dict, etag: str | None, modified: datetime | None, size: int | None) -> None:
    """``RemoteObjectChangedError`` when an answer's ETag, Last-Modified or object size is not the pinned one."""
    got_etag, got_modified = validators(meta)
    diffs = []
    if etag is not None and got_etag != etag:
        diffs.append(f"ETag {got_etag or 'none'}, opened as {etag}")
    if modified is not None and got_modified != modified:
        diffs.append(f"Last-Modified {got_modified.isoformat() if got_modified else 'none'}, "
                     f"opened as {modified.isoformat()}")
    got_size = meta.get("size")
    if size is not None and got_size is not None and int(got_size) != size:
        diffs.append(f"{got_size} bytes, opened as {size}")
    if diffs:
        raise RemoteObjectChangedError(f"the object changed while reading: {url} ({'; '.join(diffs)}); "
                                       "restart to read the new version")


def _obstore():
    try:
        import obstore
        import obstore.store
    except ImportError as e:  # the optional extra is not installed
        from ..errors import CheckpointError

        raise CheckpointError(INSTALL_HINT) from e
    return obstore


def retry_config(retries: int = RETRIES, init_backoff: float = 0.1, max_backoff: float = 5.0,
                 timeout: float = 120.0) -> dict:
    return {"max_retries": retries, "retry_timeout": timedelta(seconds=timeout),
            "backoff": {"init_backoff": timedelta(seconds=init_backoff),
                        "max_backoff": timedelta(seconds=max_backoff), "base": 2}}


def open_object_store(url: str, *, ca_bundle: str | None = None, endpoint: str | None = None,
                      retries: int = RETRIES, backoff: float = 0.1, timeout: float = 60.0):
    """``(store, path)`` for an ``s3://bucket/key`` or ``http(s)://host/dir/file`` URL.

    ``ca_bundle``: a PEM file of extra CA certificates to trust (TLS verification is always on).
    ``endpoint``: an S3-compatible endpoint instead of AWS (else ``AWS_ENDPOINT_URL_S3`` or
    ``AWS_ENDPOINT_URL`` from the environment).
    """
    obstore = _obstore()
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    opts: dict = {"timeout": f"{timeout:g}s", "connect_timeout": "10s"}
    if ca_bundle:
        try:
            with open(ca_bundle, encoding="ascii") as f:
                pem = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise OSError(f"CA bundle {ca_bundle}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
        if "-----BEGIN CERTIFICATE-----" not in pem:
            raise OSError(f"CA bundle {ca_bundle}: not a PEM file of CA certificates (no BEGIN CERTIFICATE)")
        opts["root_certificate"] = pem
    retry = retry_config(retries, init_backoff=backoff, max_backoff=max(backoff, 5.0), timeout=timeout * 2)
    if scheme == "s3":
        bucket, key = parts.netloc, parts.path.lstrip("/")
        if not bucket or not key:
            raise OSError(f"{url}: an S3 URL names a bucket and a key (s3://bucket/path/file)")
        try:  # keys, region and endpoint from the AWS profile files, for what the environment lacks
            config = profile_settings()
        except AwsConfigError as e:
            raise OSError(f"s3://{bucket}: {e}") from None
        SECRETS.update(v for k, v in config.items() if k in ("secret_access_key", "session_token"))
        missing = missing_credentials(config)
        if missing:
            raise OSError(f"s3://{bucket}: {missing}")
        # the client reads these variables itself and panics on a malformed one: each is checked first
        env = environment_endpoints()
        if endpoint is not None:
            endpoint = check_endpoint(endpoint, "the endpoint option")
        elif config.get("endpoint") is not None and not env:
            endpoint = check_endpoint(config["endpoint"], "endpoint_url in the AWS profile")
        config.pop("endpoint", None)
        endpoint = endpoint or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or env.get("AWS_ENDPOINT")
        if endpoint:
            config["endpoint"] = endpoint
            if endpoint.startswith("http://"):
                opts["allow_http"] = True
        try:
            return obstore.store.S3Store(bucket, config=config or None, client_options=opts, retry_config=retry), key
        except ValueError as e:  # a malformed endpoint or configuration
            raise OSError(f"{mask_url(url)}: {_reason(e)}") from None
    if scheme in ("http", "https"):
        base, _, name = parts.path.rpartition("/")
        if not name:
            raise OSError(f"{mask_url(url)}: the URL names a directory, not a file")
        if scheme == "http":
            opts["allow_http"] = True
        netloc, auth = split_userinfo(f"{scheme}://{parts.netloc}")
        if auth is not None:  # user:password@ in the URL: HTTP Basic auth (the password is masked in messages)
            opts["default_headers"] = {"Authorization": basic_auth_header(*auth)}
        root = f"{netloc}{base}"
        try:
            return obstore.store.HTTPStore(root, client_options=opts, retry_config=retry), name
        except ValueError as e:  # a malformed URL or certificate
            raise OSError(f"{mask_url(url)}: {_reason(e)}") from None
    raise OSError(f"{mask_url(url)}: unknown URL scheme {scheme!r} (Sluice reads s3://, http:// and https://)")


class RemoteSource(ByteSource):
    """One object at ``url`` (``s3://`` or ``http(s)://``), its ETag pinned at open.

    ``store``/``path`` may be given (an obstore store and the object's path in it) instead of
    being made from the URL; ``url`` is then only the name errors use. ``head``: the object's HEAD
    answer when the caller has it already (no second HEAD). ``meta``: a ``MetaCache`` where small
    metadata reads (``pread``: safetensors headers) are kept under this URL and ETag (None: the
    default cache in the user cache directory; False: none). ``progress``: an ``Activity`` told of
    each request (the metadata display while a model opens).
    """

    direct_io = False
    alignment = 1
    read_size = READ_BYTES
    transfer_bytes = READ_BYTES

    def __init__(self, url: str, *, store=None, path: str | None = None, stats: ReadStats | None = None,
                 head: dict | None = None, meta: MetaCache | None | bool = None, progress: Activity | None = None,
                 allow_unversioned: bool = False, **options):
        self.name = url = mask_url(url) if store is not None else url
        self.stats = stats if stats is not None else ReadStats()
        self._obstore = _obstore()
        self.meta = MetaCache() if meta is None else (meta or None)
        self.progress = progress
        if store is None:
            store, path = open_object_store(url, **options)
            self.name = url = mask_url(url)
        self._store, self._path = store, path
        if head is None:
            if progress is not None:
                progress.step(f"HEAD {_short(url)}")
            try:
                head = self._obstore.head(store, path)
            except (FileNotFoundError, self._obstore.exceptions.NotFoundError):
                raise FileNotFoundError(f"{url}: no such file") from None
            except Exception as e:
                raise OSError(f"cannot open {url}: {_reason(e)}") from None
            if progress is not None:
                progress.done()
        check_versioned(url, head, allow_unversioned)
        # the object's size and validators from the first answer: every later answer must match them
        self.size = int(head["size"])
        self.etag, self._modified = validators(head)
        # the cache key of these bytes (disk tier, local file copies); "" for an unversioned object, which
        # nothing keeps across runs (its size alone tells nothing)
        self.version = self.etag or (f"{self.size}:{self._modified.isoformat()}" if self._modified else "")

    def read_aligned(self, buf: memoryview, offset: int) -> int:
        n = max(0, min(len(buf), self.size - offset))
        if n:
            self._get_pieces(buf[:n], offset)
        return n

    def read_into(self, dest: memoryview, offset: int) -> None:
        n = len(dest)
        if offset < 0 or offset + n > self.size:
            raise OSError(f"read of {n} bytes at offset {offset} is outside the object "
                          f"({self.size} bytes): {self.name}")
        if n:
            self._get_pieces(dest, offset)

    def pread(self, nbytes: int, offset: int) -> bytes:
        """A small metadata read (a safetensors header): from the local metadata cache when it holds this
        range of this version (ETag) of the object, else fetched and kept there."""
        n = max(0, min(nbytes, self.size - offset))
        if not n:
            return b""
        if self.meta is not None and self.etag:
            got = self.meta.get(self.name, offset, n)
            if got is not None and got[0] == self.etag:
                if self.progress is not None:
                    self.progress.done(n, cached=True)
                return got[1]
        out = bytearray(n)
        self._get_pieces(memoryview(out), offset)
        if self.meta is not None and self.etag:
            self.meta.put(self.name, self.etag, bytes(out), offset, n)
        return bytes(out)

    def _get_pieces(self, dest: memoryview, offset: int) -> None:
        """One ranged GET per ``read_size`` bytes: a GET's body is held whole by the client before
        it is copied into ``dest``, so a read in flight holds at most ``transfer_bytes`` besides
        the caller's buffer (what the planner counts per reader thread)."""
        step = self.read_size
        for pos in range(0, len(dest), step):
            self._get(dest[pos : pos + step], offset + pos)

    def _get(self, dest: memoryview, offset: int) -> None:
        n = len(dest)
        progress = self.progress
        if progress is not None:
            progress.step(f"GET {_short(self.name)} bytes {offset}-{offset + n}")
        options: dict = {"range": (offset, offset + n)}
        if self.etag:
            options["if_match"] = self.etag
        elif self._modified is not None:
            options["if_unmodified_since"] = self._modified
        def fetch():
            result = self._obstore.get(self._store, self._path, options=options)
            return result.meta, result.bytes()

        try:  # waited for in slices: a shutdown (``interrupt.interrupt_reads``) stops it at once
            answer, data = interrupt.call(fetch, f"read of {n} bytes at offset {offset} of {self.name}")
        except interrupt.ReadInterruptedError:
            raise
        except self._obstore.exceptions.PreconditionError:
            pinned = f"ETag {self.etag}" if self.etag else f"Last-Modified {self._modified.isoformat()}"
            raise RemoteObjectChangedError(
                f"the object changed while reading: {self.name} (the server no longer has it at {pinned}); "
                "restart to read the new version") from None
        except Exception as e:
            raise OSError(f"read of {n} bytes at offset {offset} failed: {self.name}: {_reason(e)}") from None
        check_same(self.name, answer, self.etag, self._modified, self.size)
        if len(data) != n:
            raise OSError(f"short read: {len(data)} of {n} bytes at offset {offset}: {self.name}")
        dest[:] = memoryview(data)
        self.stats.add(n, remote=True)
        if progress is not None:
            progress.done(n)

    def close(self) -> None:
        self._store = None


class RemoteStore(Store):
    """A model's files under a URL prefix (``s3://bucket/models/olmoe``, ``https://host/models/olmoe``):
    member ``name`` is ``<url>/<name>``. One client (connection pool) for all members; metadata
    members are read whole, data members opened as ``RemoteSource``s; ``read_bytes`` keeps its
    copies in the metadata cache (``meta_cache``), revalidated by ETag.

    Metadata requests: a member's HEAD is made once per store (``exists`` and ``open`` share it);
    a member read whole is kept in the local metadata cache (``meta_cache.MetaCache``: ``meta``,
    None for the default one, False for none) and revalidated, not refetched: no request when this
    store's HEAD of it gave the copy's ETag, else one conditional GET (``If-None-Match``). A copy is
    used only for the ETag it was fetched at. ``progress``: an ``Activity`` shown while a model opens."""

    def __init__(self, url: str, *, meta: MetaCache | None | bool = None, progress: Activity | None = None,
                 allow_unversioned: bool = False, **options):
        url = url.rstrip("/")
        self.location = mask_url(url)  # what messages name: a password in the URL is never shown
        self.allow_unversioned = allow_unversioned
        self._obstore = _obstore()
        self.meta = MetaCache() if meta is None else (meta or None)
        self.progress = progress
        self._heads: dict[str, dict | None] = {}  # member -> its HEAD answer (None: not there), once per store
        # the store is rooted at the prefix: members are plain names inside it
        self._store, self._prefix = open_object_store(url + "/_", **options)
        self._prefix = self._prefix[:-1]  # "" for HTTP (rooted at the directory), "models/olmoe/" for S3

    def locate(self, name: str) -> str:
        return f"{self.location}/{name}"

    def _head(self, name: str):
        if name in self._heads:
            return self._heads[name]
        if self.progress is not None:
            self.progress.step(f"HEAD {name}")
        try:
            head = self._obstore.head(self._store, self._prefix + name)
        except (FileNotFoundError, self._obstore.exceptions.NotFoundError):
            head = None
        except Exception as e:
            raise OSError(f"cannot read {self.locate(name)}: {_reason(e)}") from None
        if self.progress is not None:
            self.progress.done()
        if head is not None:
            check_versioned(self.locate(name), head, self.allow_unversioned)
        self._heads[name] = head
        return head

    def exists(self, name: str) -> bool:
        return self._head(name) is not None

    def is_directory(self) -> bool:
        """S3: any object under the prefix. HTTP cannot list: the model's ``config.json`` or a
        container's ``manifest.json`` must be there."""
        if isinstance(self._store, self._obstore.store.S3Store):
            try:
                for batch in self._obstore.list(self._store, self._prefix, chunk_size=1):
                    return bool(batch)
            except Exception as e:
                raise OSError(f"cannot list {self.location}: {_reason(e)}") from None
            return False
        return self.exists("config.json") or self.exists("manifest.json")

    def names(self) -> list[str]:
        if not isinstance(self._store, self._obstore.store.S3Store):
            raise OSError(f"{self.location}: an HTTP server cannot list a directory; name the files")
        try:
            out = [m["path"][len(self._prefix):] for batch in self._obstore.list(self._store, self._prefix)
                   for m in batch]
        except Exception as e:
            raise OSError(f"cannot list {self.location}: {_reason(e)}") from None
        return sorted(n for n in out if n and "/" not in n)

    def read_bytes(self, name: str, limit: int | None = None) -> bytes:
        """As ``Store.read_bytes``; ``limit`` is checked against the HEAD's size before the GET, and
        against what came (a server that gave no size, or a wrong one)."""
        if limit is None:
            return self._read_bytes(name)
        url = self.locate(name)
        head = self._head(name)
        if head is not None and int(head.get("size") or 0) > limit:
            raise FileTooLargeError(errno.EFBIG, f"is {head['size']} bytes, more than the {limit} bytes allowed", url)
        data = self._read_bytes(name)
        if len(data) > limit:
            raise FileTooLargeError(errno.EFBIG, f"is {len(data)} bytes, more than the {limit} bytes allowed", url)
        return data

    def _read_bytes(self, name: str) -> bytes:
        url = self.locate(name)
        if name in self._heads and self._heads[name] is None:
            raise FileNotFoundError(f"{url}: no such file")
        copy = self.meta.get(url) if self.meta is not None else None
        if copy is not None and not copy[0]:
            copy = None  # kept without an ETag (by an older version): it cannot be revalidated
        head = self._heads.get(name)
        progress = self.progress
        if copy is not None and head is not None and head.get("e_tag") == copy[0]:
            if progress is not None:
                progress.done(len(copy[1]), cached=True)
            return copy[1]  # this store's HEAD of it gave the copy's version
        if progress is not None:
            progress.step(f"GET {name}")
        options = {"if_none_match": copy[0]} if copy is not None else {}
        try:
            result = self._obstore.get(self._store, self._prefix + name, options=options)
            answer = result.meta
            data = bytes(result.bytes())
        except self._obstore.exceptions.NotModifiedError:  # 304: the copy is the current version
            if progress is not None:
                progress.done(len(copy[1]), cached=True)
            return copy[1]
        except (FileNotFoundError, self._obstore.exceptions.NotFoundError):
            raise FileNotFoundError(f"{url}: no such file") from None
        except Exception as e:
            raise OSError(f"cannot read {url}: {_reason(e)}") from None
        check_versioned(url, answer, self.allow_unversioned)
        if head is not None:  # read after its HEAD: the same version
            check_same(url, answer, *validators(head), int(head["size"]))
        if progress is not None:
            progress.done(len(data))
        etag = answer.get("e_tag")
        if self.meta is not None and etag:  # only a copy with an ETag can be revalidated next time
            self.meta.put(url, etag, data)
        return data

    def open(self, name: str, *, direct: bool | None = None, stats: ReadStats | None = None) -> ByteSource:
        head = self._heads.get(name)
        return RemoteSource(self.locate(name), store=self._store, path=self._prefix + name, stats=stats,
                            head=head, meta=self.meta or False, progress=self.progress,
                            allow_unversioned=self.allow_unversioned)

    def __repr__(self) -> str:
        return f"<RemoteStore {self.location}>"


def _short(url: str) -> str:
    """The object's file name, for the progress line."""
    return url.rpartition("/")[2] or url


def _reason(e: Exception) -> str:
    """The first line of a client error (obstore appends a debug dump; headers are not in it),
    and the cause a user can act on when the dump names one deeper down. Any secret Sluice knows
    of (from the environment or a profile file) is masked, should a client ever echo one."""
    text = str(e).strip()
    first = text.splitlines()[0] if text else ""
    m = re.search(r"InvalidCertificate\(\s*(\w+)", text)
    if m:
        first += (f" (the server's TLS certificate is not trusted: {m.group(1)}; "
                  "give the CA certificate that signed it as a CA bundle)")
    elif "Connection refused" in text:
        first += " (connection refused)"
    return mask(f"{type(e).__name__}: {first}")
