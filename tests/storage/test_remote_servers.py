"""The remote-storage test servers themselves (tests/remote_servers.py), read with obstore.

Exact bytes through nginx (HTTP, HTTPS), moto S3 and the fault proxy; every fault mode is
observable; TLS verification and S3 authentication really refuse what they should.
"""

from __future__ import annotations

import http.client
import json
import struct
import time
from datetime import timedelta
from pathlib import Path

import pytest

obstore = pytest.importorskip("obstore")
from obstore.store import HTTPStore, S3Store  # noqa: E402
from remote_servers import REGION, Fault  # noqa: E402

# what obstore raises when a server resets the connection or cuts a body short (no retry)
OBSTORE_FAILURE = (obstore.exceptions.BaseError, OSError)

FAST_RETRY = {"max_retries": 3, "retry_timeout": timedelta(seconds=20),
              "backoff": {"init_backoff": timedelta(milliseconds=10), "max_backoff": timedelta(milliseconds=50),
                          "base": 2}}
NO_RETRY = {**FAST_RETRY, "max_retries": 0}


def http_store(url: str, ca: Path | None = None, retry=FAST_RETRY) -> HTTPStore:
    opts = {"allow_http": True, "timeout": "10s"}
    if ca is not None:
        opts["root_certificate"] = ca.read_text()
    return HTTPStore(url, client_options=opts, retry_config=retry)


def s3_store(endpoint: str, bucket: str, key: str, secret: str, prefix: str = "", retry=FAST_RETRY) -> S3Store:
    return S3Store(bucket, prefix=prefix or None, endpoint=endpoint, access_key_id=key, secret_access_key=secret,
                   region=REGION, client_options={"allow_http": True, "timeout": "10s"}, retry_config=retry)


@pytest.fixture(scope="module")
def published(remote_servers, model_dir):
    """A tiny Hugging Face checkpoint on both servers, and an expert tensor's byte range in it."""
    path = model_dir("qwen3_moe")
    urls = remote_servers.publish("qwen3-tiny", path)
    data = (path / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    name = next(k for k in header if ".experts." in k)
    a, b = header[name]["data_offsets"]
    return dict(urls=urls, data=data, expert=(8 + n + a, 8 + n + b), local=path)


def s3_for(remote_servers, endpoint=None, **kw) -> S3Store:
    s3 = remote_servers.s3
    return s3_store(endpoint or s3.endpoint, remote_servers.bucket, s3.access_key, s3.secret_key,
                    prefix="qwen3-tiny", **kw)


def test_range_reads_are_exact_on_every_server(remote_servers, published, fault_proxy):
    data, (a, b) = published["data"], published["expert"]
    http, s3 = remote_servers.http, remote_servers.s3
    stores = {
        "http": http_store(f"{http.url}/qwen3-tiny"),
        "https": http_store(f"{http.tls_url}/qwen3-tiny", ca=http.ca_path),
        "s3": s3_for(remote_servers),
        "proxy->http": http_store(f"{fault_proxy(http.port).url}/qwen3-tiny"),
        "proxy->s3": s3_for(remote_servers, endpoint=fault_proxy(s3.port).url),
    }
    for where, store in stores.items():
        assert obstore.head(store, "model.safetensors")["size"] == len(data), where
        assert bytes(obstore.get_range(store, "model.safetensors", start=0, end=8)) == data[:8], where
        assert bytes(obstore.get_range(store, "model.safetensors", start=a, end=b)) == data[a:b], where
        assert bytes(obstore.get(store, "config.json").bytes()) == (published["local"] / "config.json").read_bytes()


def test_proxy_can_speak_https(remote_servers, published, fault_proxy):
    http = remote_servers.http
    proxy = fault_proxy(http.port, ssl_context=http.ssl_context())
    assert proxy.url.startswith("https://localhost:")
    data, (a, b) = published["data"], published["expert"]
    proxy.inject(Fault("status", status=503))
    store = http_store(f"{proxy.url}/qwen3-tiny", ca=http.ca_path)
    assert bytes(obstore.get_range(store, "model.safetensors", start=a, end=b)) == data[a:b]
    assert [r.status for r in proxy.records] == [503, 206]


def test_https_verifies_certificates_by_default(remote_servers, published):
    store = http_store(f"{remote_servers.http.tls_url}/qwen3-tiny", retry=NO_RETRY)  # no CA given
    with pytest.raises(Exception, match="(?i)certificate|tls|ssl"):
        obstore.get_range(store, "model.safetensors", start=0, end=8)


def raw_get(port: int, path: str, start: int, end: int, timeout: float = 10):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("GET", path, headers={"Range": f"bytes={start}-{end - 1}"})
    return conn, conn.getresponse()


def test_proxy_injects_status_codes_and_clients_retry(remote_servers, published, fault_proxy):
    proxy = fault_proxy(remote_servers.http.port)
    data, (a, b) = published["data"], published["expert"]
    proxy.inject(Fault("status", status=503))
    _, resp = raw_get(proxy.port, "/qwen3-tiny/model.safetensors", a, b)
    assert resp.status == 503 and resp.read() == b"injected 503\n"
    store = http_store(f"{proxy.url}/qwen3-tiny", retry=NO_RETRY)
    proxy.inject(Fault("status", status=500))
    with pytest.raises(Exception, match="500"):
        obstore.get_range(store, "model.safetensors", start=a, end=b)
    proxy.inject(Fault("status", status=503), Fault("status", status=502))
    retrying = http_store(f"{proxy.url}/qwen3-tiny")
    assert bytes(obstore.get_range(retrying, "model.safetensors", start=a, end=b)) == data[a:b]
    assert [r.status for r in proxy.records[-3:]] == [503, 502, 206]


def test_proxy_resets_connections(remote_servers, published, fault_proxy):
    proxy = fault_proxy(remote_servers.http.port)
    a, b = published["expert"]
    proxy.inject(Fault("reset"))
    with pytest.raises((ConnectionResetError, http.client.RemoteDisconnected)):
        raw_get(proxy.port, "/qwen3-tiny/model.safetensors", a, b)
    proxy.inject(Fault("reset", after=100))
    _, resp = raw_get(proxy.port, "/qwen3-tiny/model.safetensors", a, b)
    with pytest.raises(ConnectionResetError):
        resp.read()
    proxy.inject(Fault("reset"))
    with pytest.raises(OBSTORE_FAILURE):
        obstore.get_range(http_store(f"{proxy.url}/qwen3-tiny", retry=NO_RETRY), "model.safetensors", start=a, end=b)
    assert [r.fault for r in proxy.records] == ["reset"] * 3


def test_proxy_truncates_bodies(remote_servers, published, fault_proxy):
    proxy = fault_proxy(remote_servers.s3.port)
    data, (a, b) = published["data"], published["expert"]
    proxy.inject(Fault("truncate", after=100))
    store = s3_for(remote_servers, endpoint=proxy.url, retry=NO_RETRY)
    with pytest.raises(OBSTORE_FAILURE):
        obstore.get_range(store, "model.safetensors", start=a, end=b)
    assert proxy.records[-1].fault == "truncate" and proxy.records[-1].body_bytes == 100
    # a retrying client resumes after the short body and gets the exact bytes
    proxy.inject(Fault("truncate", after=100))
    assert bytes(obstore.get_range(s3_for(remote_servers, endpoint=proxy.url), "model.safetensors",
                                   start=a, end=b)) == data[a:b]
    http_proxy = fault_proxy(remote_servers.http.port)
    http_proxy.inject(Fault("truncate", after=1000))
    _, resp = raw_get(http_proxy.port, "/qwen3-tiny/model.safetensors", a, b)
    with pytest.raises(http.client.IncompleteRead) as err:
        resp.read()
    assert len(err.value.partial) == 1000 and err.value.partial == data[a:a + 1000]


def test_proxy_stalls_adds_latency_and_throttles(remote_servers, fault_proxy, tmp_path):
    blob = tmp_path / "blob.bin"
    payload = bytes(range(256)) * (4 << 12)  # 4 MiB
    blob.write_bytes(payload)
    remote_servers.publish("blob.bin", blob)
    proxy = fault_proxy(remote_servers.http.port)
    store = http_store(proxy.url)

    proxy.inject(Fault("stall", after=1000, seconds=0.5))
    t = time.perf_counter()
    assert bytes(obstore.get_range(store, "blob.bin", start=0, end=1 << 20)) == payload[:1 << 20]
    assert time.perf_counter() - t >= 0.45

    proxy.set(latency=0.2)
    t = time.perf_counter()
    assert bytes(obstore.get_range(store, "blob.bin", start=10, end=20)) == payload[10:20]
    assert 0.19 <= time.perf_counter() - t < 2.0

    rate = 20e6
    proxy.set(latency=0.0, rate=rate)
    t = time.perf_counter()
    assert bytes(obstore.get_range(store, "blob.bin", start=0, end=len(payload))) == payload
    measured = len(payload) / (time.perf_counter() - t)
    assert 0.1 * rate < measured < 1.3 * rate, f"throttled to {rate / 1e6:.0f} MB/s, measured {measured / 1e6:.1f}"


def test_s3_wrong_credentials_fail(s3_auth_server, published):
    server = s3_auth_server
    server.put_dir("secure", published["local"])
    data, (a, b) = published["data"], published["expert"]
    good = s3_store(server.endpoint, "secure", server.access_key, server.secret_key, retry=NO_RETRY)
    assert bytes(obstore.get_range(good, "model.safetensors", start=a, end=b)) == data[a:b]
    wrong_secret = s3_store(server.endpoint, "secure", server.access_key, "not-the-secret", retry=NO_RETRY)
    with pytest.raises(Exception, match="SignatureDoesNotMatch|403"):
        obstore.get_range(wrong_secret, "model.safetensors", start=a, end=b)
    unknown_key = s3_store(server.endpoint, "secure", "AKIAUNKNOWNUNKNOWN00", server.secret_key, retry=NO_RETRY)
    with pytest.raises(Exception, match="InvalidAccessKeyId|403"):
        obstore.get_range(unknown_key, "model.safetensors", start=a, end=b)
    # the server keeps serving the right key
    assert bytes(obstore.get_range(good, "model.safetensors", start=0, end=8)) == data[:8]



def test_proxy_in_a_child_process(remote_servers, published):
    """``ProxyProcess`` (benchmarks): the same proxy with fixed latency, in its own process."""
    from remote_servers import ProxyProcess

    data, (a, b) = published["data"], published["expert"]
    proxy = ProxyProcess(remote_servers.http.port, latency=0.2)
    try:
        store = http_store(f"{proxy.url}/qwen3-tiny")
        t0 = time.perf_counter()
        assert bytes(obstore.get_range(store, "model.safetensors", start=a, end=b)) == data[a:b]
        assert time.perf_counter() - t0 >= 0.2  # the latency is applied (HEAD-free: one GET)
    finally:
        proxy.close()
    assert proxy.proc.returncode == 0
