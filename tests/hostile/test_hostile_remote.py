"""Hostile remote stores: servers that cannot tell versions apart, objects replaced under a run,
malformed S3 endpoints, passwords in URLs.

Real servers on loopback: ``plain_http.PlainHTTPServer`` (Python's http.server with Range,
validators only when asked), nginx and moto (``remote_servers.py``); real files replaced
between requests; ``sluice`` itself as a subprocess for what the user sees.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

import sluice
from sluice.errors import CheckpointError

pytest.importorskip("obstore")

from plain_http import PlainHTTPServer  # noqa: E402
from sluice.storage import open_source  # noqa: E402
from sluice.storage.disk_tier import open_tier  # noqa: E402
from sluice.storage.remote import RemoteObjectChangedError, RemoteSource, UnversionedObjectError  # noqa: E402
from sluice.storage.urls import InvalidEndpointError, mask, mask_url  # noqa: E402

FAST = {"retries": 1, "backoff": 0.01, "timeout": 5.0}


def _cli(*args, env=None, timeout=120):
    run_env = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "sluice.cli", *args], capture_output=True, text=True,
                          env=run_env, timeout=timeout)


@pytest.fixture
def plain(tmp_path):
    made = []

    def make(**kw) -> PlainHTTPServer:
        made.append(PlainHTTPServer(tmp_path / "doc", **kw))
        return made[-1]

    (tmp_path / "doc").mkdir()
    yield make
    for s in made:
        s.close()


# -- servers without ETag or Last-Modified ----------------------------------------------------------


def test_an_unversioned_model_is_refused_at_open_unless_allowed(plain, model_dir, tmp_path):
    path = model_dir("qwen3_moe")
    server = plain()
    shutil.copytree(path, server.docroot / "m")
    url = f"{server.url}/m"
    with pytest.raises(CheckpointError, match=r"neither ETag nor Last-Modified.*--allow-unversioned-remote"):
        sluice.load(url, memory="2GiB", progress=False)
    eng = sluice.load(url, memory="2GiB", progress=False, allow_unversioned_remote=True)
    try:
        local = sluice.load(path, memory="2GiB", progress=False)
        try:
            ids = list(range(3, 11))
            assert eng.generate(ids, max_new_tokens=3, ignore_eos=True).token_ids == \
                local.generate(ids, max_new_tokens=3, ignore_eos=True).token_ids
        finally:
            local.close()
    finally:
        eng.close()
    # the CLI: one error line naming the flag, status 1; with the flag it opens
    r = _cli("inspect", url, "--json")
    assert r.returncode == 1 and r.stderr.startswith("sluice: error: ") and "Traceback" not in r.stderr, r.stderr
    assert "neither ETag nor Last-Modified" in r.stderr and "--allow-unversioned-remote" in r.stderr
    r = _cli("inspect", url, "--json", "--allow-unversioned-remote")
    assert r.returncode == 0, r.stderr


def test_convert_reads_an_unversioned_model_only_when_allowed(plain, model_dir, tmp_path):
    """``sluice convert`` of an unversioned URL: refused naming the flag (one error line, status
    1, nothing written); with ``--allow-unversioned-remote`` the container is written and runs
    as the local checkpoint's conversion does (the Python API's ``allow_unversioned_remote``)."""
    from sluice.convert import convert

    path = model_dir("qwen3_moe")
    server = plain()
    shutil.copytree(path, server.docroot / "m")
    url = f"{server.url}/m"
    r = _cli("convert", url, tmp_path / "refused", "--no-progress")
    assert r.returncode == 1 and r.stderr.startswith("sluice: error: ") and r.stderr.count("\n") == 1, r.stderr
    assert "neither ETag nor Last-Modified" in r.stderr and "--allow-unversioned-remote" in r.stderr
    assert not (tmp_path / "refused").exists() and not (tmp_path / "refused.partial").exists()
    r = _cli("convert", url, tmp_path / "box", "--no-progress", "--allow-unversioned-remote")
    assert r.returncode == 0, r.stderr
    with pytest.raises(CheckpointError, match="--allow-unversioned-remote"):
        convert(url, tmp_path / "api", progress=False)
    convert(url, tmp_path / "api", progress=False, allow_unversioned_remote=True)
    local = convert(path, tmp_path / "local", progress=False)
    ids = list(range(3, 11))
    outs = []
    for box in (tmp_path / "box", tmp_path / "api", local):
        with sluice.load(box, memory="2GiB", progress=False) as eng:
            outs.append((eng.forward(ids), eng.generate(ids, max_new_tokens=3, ignore_eos=True).token_ids))
    assert all(torch.equal(o[0], outs[2][0]) and o[1] == outs[2][1] for o in outs[:2])


def test_an_unversioned_object_replaced_mid_run_by_another_size_is_an_error(plain):
    server = plain()
    f = server.docroot / "w.bin"
    f.write_bytes(b"a" * 5000)
    src = RemoteSource(f"{server.url}/w.bin", meta=False, allow_unversioned=True, **FAST)
    assert src.version == ""  # no cache keeps it: its size alone tells nothing
    assert src.pread(4, 0) == b"aaaa"
    f.write_bytes(b"b" * 6000)  # replaced between two requests
    with pytest.raises(RemoteObjectChangedError, match=r"the object changed while reading: .*w\.bin .*6000 bytes, "
                                                       r"opened as 5000"):
        src.read_into(memoryview(bytearray(4)), 100)
    with pytest.raises(UnversionedObjectError):
        RemoteSource(f"{server.url}/w.bin", meta=False, **FAST)


def test_a_last_modified_only_object_replaced_mid_run_is_an_error_on_a_range_read(plain):
    """Same size, new Last-Modified, a server that ignores If-Unmodified-Since: the range answer's
    Last-Modified is checked against the one pinned at open."""
    server = plain(validators="last-modified")
    f = server.docroot / "lm.bin"
    f.write_bytes(b"a" * 5000)
    os.utime(f, (1_700_000_000, 1_700_000_000))
    src = RemoteSource(f"{server.url}/lm.bin", meta=False, **FAST)
    assert src.etag is None and src.version.startswith("5000:")
    assert src.pread(4, 0) == b"aaaa"
    f.write_bytes(b"b" * 5000)  # same size, later mtime
    with pytest.raises(RemoteObjectChangedError, match=r"the object changed while reading: .*Last-Modified"):
        src.read_into(memoryview(bytearray(4)), 0)


def test_the_disk_tier_never_serves_an_unversioned_object_from_a_previous_version(plain, tmp_path):
    server = plain()
    f = server.docroot / "t.bin"
    f.write_bytes(b"a" * 8192)
    tier = open_tier("64MiB", tmp_path / "tier")
    try:
        url = f"{server.url}/t.bin"
        first = open_source(url, disk_tier=tier, meta=False, allow_unversioned=True, **FAST)
        assert first.pread(8, 0) == b"a" * 8
        first.close()
        f.write_bytes(b"b" * 8192)  # replaced between runs, same size
        second = open_source(url, disk_tier=tier, meta=False, allow_unversioned=True, **FAST)
        assert second.pread(8, 0) == b"b" * 8  # fetched, never the first version's bytes
        second.close()
    finally:
        tier.close()
    # a versioned server's entries are keyed by its validators: the same size with another one misses
    vs = plain(validators="last-modified")
    g = vs.docroot / "v.bin"
    g.write_bytes(b"c" * 8192)
    os.utime(g, (1_700_000_000, 1_700_000_000))
    tier = open_tier("64MiB", tmp_path / "tier2")
    try:
        s1 = open_source(f"{vs.url}/v.bin", disk_tier=tier, meta=False, **FAST)
        assert s1.pread(8, 0) == b"c" * 8
        g.write_bytes(b"d" * 8192)
        s2 = open_source(f"{vs.url}/v.bin", disk_tier=tier, meta=False, **FAST)
        assert s2.version != s1.version and s2.pread(8, 0) == b"d" * 8
    finally:
        tier.close()


# -- malformed S3 endpoints -------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["not a url", "file:///tmp/x", "http://[::1", "", "http://", "ftp://host"])
def test_a_malformed_endpoint_is_a_named_error_never_a_panic(value, monkeypatch, remote_servers):
    monkeypatch.setenv("AWS_ENDPOINT_URL", value)
    with pytest.raises(InvalidEndpointError, match=r"AWS_ENDPOINT_URL=.*an S3 endpoint is an http"):
        RemoteSource("s3://models/x.bin", meta=False, **FAST)


def test_a_malformed_endpoint_on_the_command_line_is_one_error_line(remote_servers):
    r = _cli("inspect", "s3://models/nothing", env={"AWS_ENDPOINT_URL": "http://[::1"})
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith("sluice: error: ") and "AWS_ENDPOINT_URL='http://[::1'" in r.stderr, r.stderr
    assert "panicked" not in r.stderr and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


# -- passwords in URLs ------------------------------------------------------------------------------


def test_a_url_password_is_basic_auth_and_never_shown(plain, monkeypatch):
    secret = "s3cr3t-Pa55"
    server = plain(validators=True, auth=("reader", secret))
    (server.docroot / "p.bin").write_bytes(b"x" * 3000)
    url = f"http://reader:{secret}@127.0.0.1:{server.port}/p.bin"
    src = RemoteSource(url, meta=False, **FAST)
    assert src.pread(5, 10) == b"xxxxx"  # the server checked the Authorization header
    assert secret not in src.name and src.name == mask_url(url) and "reader:***@" in src.name
    sent = [h.get("authorization") for _, _, h in server.requests]
    assert all(a and a.startswith("Basic ") for a in sent), sent
    with pytest.raises(OSError) as err:  # a wrong password: refused, neither password shown
        RemoteSource(f"http://reader:wrong-password@127.0.0.1:{server.port}/p.bin", meta=False, **FAST)
    msg = str(err.value)
    assert "wrong-password" not in msg and ("401" in msg or "Unauthorized" in msg), msg
    with pytest.raises(OSError) as err:  # a missing file
        RemoteSource(f"http://reader:{secret}@127.0.0.1:{server.port}/none.bin", meta=False, **FAST)
    assert secret not in str(err.value) and "none.bin" in str(err.value)
    assert mask(f"cannot open http://u:{secret}@h/x and {secret}") == "cannot open http://u:***@h/x and ***"


def test_a_url_password_never_reaches_the_terminal(plain, model_dir):
    secret = "cli-s3cr3t-pw"
    server = plain(validators=True, auth=("reader", secret))
    shutil.copytree(model_dir("qwen3_moe"), server.docroot / "m")
    base = f"http://reader:{secret}@127.0.0.1:{server.port}"
    r = _cli("inspect", f"{base}/missing-model")  # an error naming the URL
    assert r.returncode == 1 and r.stderr.startswith("sluice: error: "), r.stderr
    assert secret not in r.stderr and "reader:***@" in r.stderr, r.stderr
    r = _cli("inspect", f"{base}/m", "--json")  # and the model opens with the credentials
    assert r.returncode == 0 and secret not in r.stdout + r.stderr, r.stderr


# -- SIGTERM while a request waits on a stalled remote read -----------------------------------------


def test_sigterm_stops_a_serve_whose_read_stalls(remote_servers, fault_proxy, model_dir):
    """The remote server stops sending mid-body (60 s stall): SIGTERM reaches the read in flight, the
    request ends with a 503 naming shutdown, and ``sluice serve`` exits within its grace period."""
    pytest.importorskip("fastapi")
    import signal
    import threading
    import time

    import httpx
    from remote_servers import Fault
    from serve_process import spawn_serve, wait_for

    urls = remote_servers.publish("stall-model", model_dir("qwen3_moe"))
    proxy = fault_proxy(remote_servers.http.port)
    url = urls["http"].replace(remote_servers.http.url, proxy.url)
    proc, base = spawn_serve(url, "--memory", "2GiB", "--cache-experts", "2", "--no-prefetch", "--threads", "1",
                             "--max-context", "128", "--no-progress", stdout=subprocess.DEVNULL)
    try:
        proxy.inject(*[Fault("stall", after=0, seconds=60) for _ in range(64)])  # every GET from now on
        box: dict = {}

        def ask():
            r = httpx.post(base + "/v1/completions", json={"model": "stall-model", "prompt": list(range(3, 40)),
                                                           "max_tokens": 4}, timeout=60)
            box["r"] = r

        t = threading.Thread(target=ask)
        t.start()
        wait_for(lambda: any(r.fault == "stall" for r in proxy.records), timeout=20, what="a stalled GET")
        time.sleep(0.2)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=15)
        took = time.monotonic() - t0
        t.join(10)
        _, err = proc.communicate()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert took < 6.0, f"sluice serve took {took:.1f} s to exit after SIGTERM"
    assert proc.returncode == 0 and "Traceback" not in err, err
    r = box["r"]
    assert r.status_code == 503, r.text
    e = r.json()["error"]
    assert e["code"] == "shutting_down" and "shutting down" in e["message"], e
