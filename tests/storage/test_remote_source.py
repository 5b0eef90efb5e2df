"""RemoteSource (storage/remote.py): the byte-source seam over S3 and HTTP(S), against the real
servers of tests/remote_servers.py and the fault proxy."""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("obstore")
from remote_servers import Fault  # noqa: E402

from sluice.errors import CheckpointError  # noqa: E402
from sluice.storage.remote import RemoteObjectChangedError, RemoteSource, RemoteStore  # noqa: E402

FAST = dict(backoff=0.01, timeout=10.0)


@pytest.fixture(scope="module")
def blob(remote_servers, tmp_path_factory):
    data = os.urandom(3 << 20)
    path = tmp_path_factory.mktemp("blob") / "blob.bin"
    path.write_bytes(data)
    return data, remote_servers.publish("src/blob.bin", path)


def test_reads_are_exact_from_s3_http_and_https(remote_servers, blob):
    data, urls = blob
    sources = [RemoteSource(urls["http"], **FAST),
               RemoteSource(urls["https"], ca_bundle=str(remote_servers.http.ca_path), **FAST),
               RemoteSource(urls["s3"], endpoint=remote_servers.s3.endpoint, **FAST)]
    for src in sources:
        assert src.size == len(data) and src.etag and src.version == src.etag
        buf = bytearray(1 << 20)
        src.read_into(memoryview(buf), 12345)
        assert buf == data[12345:12345 + (1 << 20)], src.name
        assert src.read_aligned(memoryview(bytearray(4096)), len(data) - 100) == 100
        assert src.pread(16, 7) == data[7:23]
        assert src.stats.reads == 3 and src.stats.bytes_read == (1 << 20) + 100 + 16
        with pytest.raises(OSError, match="outside the object"):
            src.read_into(memoryview(bytearray(10)), len(data) - 5)


def test_https_without_the_ca_is_refused(blob):
    _, urls = blob
    with pytest.raises(OSError, match=r"cannot open https://localhost:\d+/src/blob.bin") as err:
        RemoteSource(urls["https"], retries=0, **FAST)
    assert "TLS certificate is not trusted: UnknownIssuer" in str(err.value)


@pytest.mark.parametrize("server", ["http", "s3"])
def test_retries_5xx_resets_and_truncated_bodies(remote_servers, blob, fault_proxy, server):
    data, urls = blob
    upstream = remote_servers.http.port if server == "http" else remote_servers.s3.port
    proxy = fault_proxy(upstream)
    if server == "http":
        src = RemoteSource(f"{proxy.url}/src/blob.bin", **FAST)
    else:
        src = RemoteSource(urls["s3"], endpoint=proxy.url, **FAST)
    proxy.inject(Fault("status", status=503), Fault("status", status=500), Fault("reset"),
                 Fault("truncate", after=4096), Fault("reset", after=70000))
    buf = bytearray(2 << 20)
    src.read_into(memoryview(buf), 1000)
    assert buf == data[1000:1000 + (2 << 20)]
    gets = [r for r in proxy.records if r.method == "GET"]
    assert [r.fault for r in gets] == ["status", "status", "reset", "truncate", "reset", None]
    # a body cut short is resumed from the byte where it stopped, not read again
    end = 1000 + (2 << 20) - 1
    assert [r.range for r in gets[3:]] == [f"bytes=1000-{end}", f"bytes=5096-{end}", f"bytes=75096-{end}"]


def test_gives_up_naming_the_url(remote_servers, blob, fault_proxy):
    proxy = fault_proxy(remote_servers.http.port)
    src = RemoteSource(f"{proxy.url}/src/blob.bin", retries=2, **FAST)
    proxy.inject(*[Fault("status", status=503)] * 3)
    with pytest.raises(OSError, match=rf"failed: {proxy.url}/src/blob.bin: .*503"):
        src.read_into(memoryview(bytearray(100)), 0)
    assert [r.status for r in proxy.records if r.method == "GET"] == [503] * 3
    src.read_into(memoryview(bytearray(100)), 0)  # the server keeps serving


@pytest.mark.parametrize("server", ["http", "s3"])
def test_a_changed_object_is_an_error_naming_the_url(remote_servers, tmp_path, server):
    path = tmp_path / "v.bin"
    path.write_bytes(b"a" * 10000)
    urls = remote_servers.publish(f"changing-{server}/v.bin", path)
    opts = {"endpoint": remote_servers.s3.endpoint} if server == "s3" else {}
    src = RemoteSource(urls[server], **opts, **FAST)
    assert src.pread(10, 0) == b"a" * 10
    path.write_bytes(b"b" * 10001)
    remote_servers.publish(f"changing-{server}/v.bin", path)
    # a data read of the version the source was opened at (pread, metadata, may come from the local
    # metadata cache under that ETag: the bytes of the version opened, never a mix)
    with pytest.raises(RemoteObjectChangedError, match=rf"the object changed while reading: {urls[server]} "):
        src.read_into(memoryview(bytearray(10)), 0)


def test_wrong_credentials_fail_at_open(s3_auth_server, tmp_path, monkeypatch):
    path = tmp_path / "secret.bin"
    path.write_bytes(b"x" * 100)
    s3_auth_server.put_dir("locked", tmp_path)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_auth_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_auth_server.secret_key)
    assert RemoteSource("s3://locked/secret.bin", endpoint=s3_auth_server.endpoint, **FAST).pread(3, 0) == b"xxx"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    with pytest.raises(OSError, match="cannot open s3://locked/secret.bin") as err:
        RemoteSource("s3://locked/secret.bin", endpoint=s3_auth_server.endpoint, retries=0, **FAST)
    assert "wrong-secret" not in str(err.value)


def test_without_the_remote_extra_a_url_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "obstore", None)
    with pytest.raises(CheckpointError, match=r"pip install \"sluice\[remote\]\""):
        RemoteSource("s3://bucket/model/model.safetensors")


@pytest.mark.parametrize("kind", ["http", "https", "s3"])
def test_store_reads_a_model_directory(remote_servers, model_dir, tmp_path, kind):
    local = model_dir("qwen3_moe")
    urls = remote_servers.publish("models/qwen3-store", local)
    opts = {"http": {}, "https": {"ca_bundle": str(remote_servers.http.ca_path)},
            "s3": {"endpoint": remote_servers.s3.endpoint}}[kind]
    store = RemoteStore(urls[kind], **opts, **FAST)
    assert store.is_directory() and store.exists("config.json") and not store.exists("nope.json")
    assert store.read_bytes("config.json") == (local / "config.json").read_bytes()
    with pytest.raises(FileNotFoundError, match=f"{urls[kind]}/nope.json"):
        store.read_bytes("nope.json")
    with pytest.raises(FileNotFoundError, match=f"{urls[kind]}/nope.bin"):
        store.open("nope.bin")
    data = (local / "model.safetensors").read_bytes()
    src = store.open("model.safetensors")
    assert src.name == f"{urls[kind]}/model.safetensors" and src.size == len(data)
    assert src.pread(4096, len(data) - 4096) == data[-4096:]
    assert store.local_path("config.json") is None  # no local file: members are read (and kept) by read_bytes
    if kind == "s3":
        assert store.names() == sorted(p.name for p in local.iterdir() if p.is_file())
    else:
        with pytest.raises(OSError, match="cannot list"):
            store.names()
