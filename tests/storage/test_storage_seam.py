"""The storage seam: the ``ByteSource`` contract (on ``LocalFile``, its local implementation), the
wrapping sources, stores and locations, and the rule that the tensor stores above it
(``checkpoint.py``, ``container.py``) and the readers (expert sources, spine streaming,
tokenizer) never reach files but through it."""

from __future__ import annotations

import ast
import errno
import os
import sys
from pathlib import Path

import pytest
import torch

import sluice
from sluice.checkpoint import Checkpoint
from sluice.errors import CheckpointError
from sluice.resolve import resolve_model
from sluice.storage import (AlignedBuffer, ByteSource, LocalDir, LocalFile, ReadStats, RemoteUnavailableError,
                            Sources, Store, WrappedSource, open_source, open_store, url_scheme)
from sluice.storage.faults import FaultPlan, FaultySource
from sluice.storage.file import PIECE_BYTES

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "sluice"
MiB = 1 << 20


@pytest.fixture(scope="module")
def blob(tmp_path_factory):
    """A file of 2*PIECE_BYTES + 5000 pseudo-random bytes (not a multiple of 4096: a partial last
    block) and its contents."""
    path = tmp_path_factory.mktemp("seam") / "blob.bin"
    data = torch.randint(0, 256, (2 * PIECE_BYTES + 5000,), generator=torch.Generator().manual_seed(7),
                         dtype=torch.uint8).numpy().tobytes()
    path.write_bytes(data)
    return path, data


def both(path) -> list[ByteSource]:
    """The file opened with O_DIRECT probed (None) and forced buffered (False)."""
    return [LocalFile(str(path), direct=None), LocalFile(str(path), direct=False)]


def test_attributes(blob):
    path, data = blob
    for src in both(path):
        assert src.name == str(path) and src.size == len(data)
        a = src.alignment
        assert a > 0 and a & (a - 1) == 0 and AlignedBuffer(1).nbytes % a == 0  # a power of two dividing a page
        assert src.read_size > 0 and src.read_size % a == 0
        assert isinstance(src.direct_io, bool) and (src.direct_io or src.direct_error or not hasattr(os, "O_DIRECT")
                                                    or src.dfd is None)
        assert src.version and src.version == LocalFile(str(path), direct=False).version
        src.close()
        src.close()  # idempotent


def test_read_aligned_ranges_and_eof(blob):
    path, data = blob
    for src in both(path):
        a = src.alignment
        buf = AlignedBuffer(3 * PIECE_BYTES)
        for off, n in [(0, a), (a, 3 * a), (5 * a, 64 * a), (0, 2 * PIECE_BYTES + a)]:  # the last: read in pieces
            got = src.read_aligned(buf.view(0, n), off)
            assert got == n and bytes(buf.view(0, n)) == data[off:off + n]
        tail = (len(data) // a) * a  # the partial last block: a short read, exactly the bytes there are
        got = src.read_aligned(buf.view(0, 2 * a), tail - a)
        assert got == a + len(data) - tail and bytes(buf.view(0, got)) == data[tail - a:]
        assert src.read_aligned(buf.view(0, a), (len(data) // a + 1) * a) == 0  # past the end
        src.close()


def test_direct_and_buffered_give_identical_bytes(blob):
    path, data = blob
    direct, buffered = both(path)
    out = []
    for src in (direct, buffered):
        buf = AlignedBuffer(len(data))
        got = src.read_aligned(buf.view(0, buf.nbytes), 0)
        assert got == len(data)
        out.append(bytes(buf.view(0, got)))
        src.close()
    assert out[0] == out[1] == data


def test_read_into_and_pread_any_alignment(blob):
    path, data = blob
    for src in both(path):
        for off, n in [(1, 10), (4095, 2), (12345, 70000), (len(data) - 7, 7), (3, src.read_size + 1000)]:
            dest = bytearray(n)
            src.read_into(memoryview(dest), off)
            assert bytes(dest) == data[off:off + n]
        assert src.pread(100, 17) == data[17:117]
        assert src.pread(100, len(data) - 30) == data[-30:]  # short at the end, never past it
        with pytest.raises(OSError, match=rf"outside the file \({len(data)} bytes\): .*blob\.bin"):
            src.read_into(memoryview(bytearray(10)), len(data) - 5)
        src.close()


def test_errors_name_the_path(blob, tmp_path):
    path, _ = blob
    missing = tmp_path / "no-such.bin"
    with pytest.raises(OSError) as e:
        open_source(missing)
    assert e.value.errno == errno.ENOENT and str(missing) in str(e.value)
    with pytest.raises(CheckpointError, match=rf"{missing}: cannot open \(No such file or directory\)"):
        Sources().get(str(missing))
    src = LocalFile(str(path), direct=False)
    src.close()
    with pytest.raises(OSError, match="blob.bin") as e:
        src.read_aligned(AlignedBuffer(4096).view(0, 4096), 0)  # read after close: EBADF, named
    assert e.value.errno == errno.EBADF and e.value.filename == str(path)


def test_stats_and_version(tmp_path):
    f = tmp_path / "v.bin"
    f.write_bytes(b"x" * 10000)
    stats = ReadStats()
    src = open_source(f, direct=False, stats=stats)
    src.read_aligned(AlignedBuffer(8192).view(0, 8192), 0)
    src.pread(8, 0)
    assert (stats.reads, stats.bytes_read) == (2, 8192 + 8)
    before = src.version
    f.write_bytes(b"y" * 10001)
    assert open_source(f).version != before  # a changed file is another version (cache keys)


def test_wrapping_sources_compose(blob):
    """Wrappers stack; aligned reads and read_into (built on them) go through every layer,
    metadata reads (pread) and attributes pass straight through."""
    path, data = blob

    class Counting(WrappedSource):
        def __init__(self, inner):
            super().__init__(inner)
            self.calls = 0

        def read_aligned(self, buf, offset):
            self.calls += 1
            return self.inner.read_aligned(buf, offset)

    plan = FaultPlan(fail_at=2, short_at=3)
    inner = LocalFile(str(path), direct=False)
    src = Counting(FaultySource(inner, plan))
    assert (src.name, src.size, src.alignment, src.version, src.stats) == \
        (inner.name, inner.size, inner.alignment, inner.version, inner.stats)
    buf = AlignedBuffer(8192)
    assert src.read_aligned(buf.view(0, 8192), 0) == 8192
    with pytest.raises(OSError, match="injected I/O error") as e:
        src.read_into(memoryview(bytearray(10)), 5)
    assert e.value.errno == errno.EIO and e.value.filename == str(path)
    assert src.read_aligned(buf.view(0, 8192), 0) == 4096  # short, as planned
    assert src.pread(4, 0) == data[:4] and plan.reads == 3 and plan.injected == 2 and src.calls == 3
    src.close()


def test_sources_wrap_open_and_later_ones(blob, tmp_path):
    path, _ = blob
    other = tmp_path / "other.bin"
    other.write_bytes(b"z" * 4096)
    sources = Sources(direct=False)
    first = sources.get(str(path))
    assert sources.get(str(path)) is first and not sources.direct_io
    sources.wrap(lambda s: FaultySource(s, FaultPlan()))
    assert isinstance(sources.get(str(path)), FaultySource) and sources.get(str(path)).inner is first
    assert isinstance(sources.get(str(other)), FaultySource)  # opened after wrap: wrapped too
    assert {s.name for s in sources} == {str(path), str(other)}
    sources.close()
    assert list(sources) == []


def test_locations_and_the_precedence_rule(tmp_path, monkeypatch):
    assert [url_scheme(x) for x in ("s3://b/m", "HTTPS://h/m", "http://h", "/a/b", "rel/x", Path("s3://x"))] == \
        ["s3", "https", "http", None, None, None]
    # a URL resolves to itself (a str, not a mangled Path); its model id is its last path component
    for url, mid in (("s3://bucket/Qwen3-30B-A3B", "Qwen3-30B-A3B"),
                     ("https://host/models/olmoe.sluice/", "olmoe.sluice"), ("http://host/m", "m")):
        assert resolve_model(url) == (url.rstrip("/"), mid)
    # without the remote extra a URL says what to install, before the demo and repo-id rules
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "obstore", None)
        for url in ("s3://bucket/Qwen3-30B-A3B", "https://host/models/olmoe.sluice", "http://host/m"):
            for opener in (open_source, open_store):
                with pytest.raises(RemoteUnavailableError, match=rf'{url}: .*pip install "sluice\[remote\]"'):
                    opener(url)
            with pytest.raises(RemoteUnavailableError):
                sluice.load(url, memory="1GiB", progress=False)
    for opener in (open_store, resolve_model):
        with pytest.raises(CheckpointError, match="unknown URL scheme 'ftp'"):
            opener("ftp://host/m")
    # an existing local path wins, whatever it looks like
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s3:" / "bucket" / "m").mkdir(parents=True)
    (tmp_path / "s3:" / "bucket" / "m" / "config.json").write_text("{}")
    store = open_store("s3://bucket/m")
    assert isinstance(store, LocalDir) and store.read_text("config.json") == "{}"
    assert resolve_model("s3://bucket/m") == (Path("s3:/bucket/m"), "m")


def test_local_dir_store(text_model):
    store = open_store(text_model)
    assert isinstance(store, LocalDir) and store.is_directory() and store.location == str(text_model)
    assert store.locate("config.json") == str(text_model / "config.json")
    assert "config.json" in store.names() and "model.safetensors" in store.names()
    assert store.exists("tokenizer.json") and not store.exists("nope.json")
    assert store.read_bytes("config.json") == (text_model / "config.json").read_bytes()
    assert store.local_path("tokenizer.json") == text_model / "tokenizer.json"  # the file itself, no copy
    with pytest.raises(FileNotFoundError):
        store.read_bytes("nope.json")
    src = store.open("model.safetensors", direct=False)
    assert src.size == (text_model / "model.safetensors").stat().st_size
    src.close()


class CopyingStore(Store):
    """A store that is not a local directory to its users: it serves ``inner``'s members but has no
    local files of its own (``local_path`` is None), as a remote store."""

    def __init__(self, inner: LocalDir):
        self.inner, self.location = inner, inner.location

    def locate(self, name):
        return self.inner.locate(name)

    def exists(self, name):
        return self.inner.exists(name)

    def is_directory(self):
        return self.inner.is_directory()

    def names(self):
        return self.inner.names()

    def read_bytes(self, name, limit=None):
        return self.inner.read_bytes(name, limit)

    def open(self, name, *, direct=None, stats=None):
        return self.inner.open(name, direct=direct, stats=stats)


def test_tokenizer_of_a_store_without_local_files_is_read_from_its_bytes(text_model, tmp_path, monkeypatch):
    from sluice.tokenizer import Tokenizer

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    store = CopyingStore(open_store(text_model))
    assert store.local_path("tokenizer.json") is None
    text = "héllo wörld, tokens"
    assert Tokenizer(store).encode(text) == Tokenizer(text_model).encode(text)
    assert not (tmp_path / "cache").exists()  # no copy of the file anywhere: one local cache, the metadata's
    # and a Checkpoint sits on any store: same tensor table and bytes as from the directory
    a, b = Checkpoint(store, direct=False), Checkpoint(text_model, direct=False)
    assert a.tensors == b.tensors and a.config == b.config
    name = next(iter(a.tensors))
    assert torch.equal(a.read(name), b.read(name))
    a.close(), b.close()


# ------------------------------------------------------------ nothing reaches files but the seam ----

# modules above the seam, and what of them must come through it
SEAM_USERS = ["checkpoint.py", "container.py", "experts/source.py", "experts/layout.py", "spine.py", "tokenizer.py"]
OS_CALLS = {"open", "pread", "preadv", "read", "fstat", "stat", "lstat", "listdir", "scandir", "exists", "isfile",
            "isdir", "getsize"}
PATH_CALLS = {"open", "exists", "is_dir", "is_file", "stat", "lstat", "read_text", "read_bytes", "iterdir", "glob",
              "rglob"}


def _file_access(path: Path) -> list[str]:
    """Calls that reach the file system directly: ``open(...)``, ``LocalFile(...)``, ``os.pread``
    and the like, and path methods (``.exists()``, ``.read_text()``, ...) on anything but a store."""
    bad = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id in ("open", "LocalFile"):
            bad.append(f"{path.name}:{node.lineno}: {f.id}(...)")
        elif isinstance(f, ast.Attribute):
            receiver = ast.unparse(f.value)
            if (receiver in ("os", "io", "os.path") and f.attr in OS_CALLS) or f.attr == "LocalFile" or \
                    (f.attr in PATH_CALLS and not receiver.endswith("store")):
                bad.append(f"{path.name}:{node.lineno}: {receiver}.{f.attr}(...)")
    return bad


def test_checker_finds_file_access(tmp_path):
    code = tmp_path / "bad.py"
    code.write_text("import os\nf = open('x')\nos.pread(3, 1, 0)\nPath('x').exists()\nself.path.read_text()\n"
                    "store.exists('ok')\nself.store.read_bytes('ok')\nsrc.pread(8, 0)\nos.path.exists('x')\n")
    assert [b.split(": ", 1)[1] for b in _file_access(code)] == [
        "open(...)", "os.pread(...)", "Path('x').exists(...)", "self.path.read_text(...)", "os.path.exists(...)"]


@pytest.mark.parametrize("module", SEAM_USERS)
def test_no_file_access_above_the_seam(module):
    assert _file_access(SRC / module) == []


@pytest.mark.parametrize("module", ["experts/layout.py", "experts/source.py", "spine.py"])
def test_alignment_comes_from_the_source(module):
    """The O_DIRECT alignment is the source's (``ByteSource.alignment``): the readers import no
    alignment constant from storage."""
    tree = ast.parse((SRC / module).read_text(encoding="utf-8"))
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and (n.module or "").endswith("storage")
             for a in n.names}
    assert not names & {"ALIGN", "DIRECT_ALIGN"}, names
