"""Models run straight from S3 and HTTP(S): the same logits and tokens as from the local directory.

Real servers on loopback (``tests/remote_servers.py``: moto S3, nginx over HTTP and HTTPS, the
fault proxy); real checkpoints (a sharded Hugging Face directory, a hybrid family, a container).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import pytest
import torch

import sluice
from conftest import prompt_ids
from sluice.errors import CheckpointError, ExpertReadError

pytest.importorskip("obstore")

N_NEW = 6
CACHE = 4  # a small expert cache: most experts are read again and again


@pytest.fixture(scope="module")
def remote_models(remote_servers, family_models, tmp_path_factory):
    """{name: (local path, {http, https, s3} URLs)}: a sharded qwen3_moe directory, the hybrid
    qwen3_next directory and a qwen3_moe container, published to both servers."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("remote-models")
    sharded = root / "qwen3-sharded"
    model = AutoModelForCausalLM.from_pretrained(family_models.hf("qwen3_moe"))
    model.save_pretrained(sharded, max_shard_size="300KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    out = {"sharded": sharded, "hybrid": family_models.hf("qwen3_next"),
           "container": family_models.container("qwen3_moe")}
    return {k: (p, remote_servers.publish(f"rm-{k}", p)) for k, p in out.items()}


@pytest.fixture
def s3_env(remote_servers, monkeypatch):
    """``s3://`` URLs read from the test's moto server, as a user's AWS_ENDPOINT_URL points at one."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", remote_servers.s3.endpoint)


def _ids(path) -> torch.Tensor:
    return prompt_ids(12)  # ids < 256: in every tiny model's vocabulary


def _run(location, ids, **options):
    """Logits at every prompt position, greedy tokens, bytes read by the run, and the engine."""
    eng = sluice.load(str(location), memory="4GiB", cache_experts=CACHE, progress=False, **options)
    before = eng.checkpoint.stats.bytes_read
    logits = eng.forward(ids)
    tokens = eng.generate(ids.tolist(), max_new_tokens=N_NEW, ignore_eos=True).token_ids
    return logits, tokens, eng.checkpoint.stats.bytes_read - before, eng


CASES = [("sharded", "s3"), ("sharded", "https"), ("hybrid", "http"), ("container", "s3"), ("container", "https")]


@pytest.mark.parametrize("model,server", CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_remote_model_is_bit_identical_to_local(remote_models, remote_servers, s3_env, model, server):
    path, urls = remote_models[model]
    ids = _ids(path)
    local_logits, local_tokens, local_bytes, local = _run(path, ids)
    local.close()
    opts = {"ca_bundle": str(remote_servers.http.ca_path)} if server == "https" else {}
    logits, tokens, fetched, eng = _run(urls[server], ids, **opts)
    try:
        assert eng.model_id == f"rm-{model}"
        assert eng.path == urls[server]
        assert not eng.checkpoint.direct_io  # O_DIRECT is for local files
        # the planner counts a response body per reader thread and one for the spine stream
        from sluice.storage.remote import READ_BYTES

        reader_threads = eng.options.reader_threads
        assert eng.plan.activation_bytes - local.plan.activation_bytes == (reader_threads + 1) * READ_BYTES
        assert torch.equal(logits, local_logits)
        assert tokens == local_tokens
        assert local_bytes > 0 and fetched <= 1.05 * local_bytes, (fetched, local_bytes)
    finally:
        eng.close()


def test_remote_reads_run_concurrently(remote_models, remote_servers, fault_proxy):
    """Expert reads on the reader pool's threads overlap on the wire (the client releases the GIL):
    with 0.3 s added per response, four reads on four threads take far less than four in a row."""
    from sluice.storage import open_store

    path, urls = remote_models["container"]
    proxy = fault_proxy(remote_servers.http.port, latency=0.3)
    store = open_store(f"{proxy.url}/rm-container")
    src = store.open(next(n for n in os.listdir(path) if n.startswith("experts")))
    bufs = [bytearray(4096) for _ in range(4)]
    threads = [threading.Thread(target=src.read_into, args=(memoryview(b), i * 4096)) for i, b in enumerate(bufs)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    assert sum(1 for r in proxy.records if r.method == "GET") >= 4
    assert wall < 4 * 0.3 * 0.75, wall  # serial reads would take >= 1.2 s
    with open(src.name.replace(f"{proxy.url}/rm-container", str(path)), "rb") as f:
        assert all(bytes(b) == f.read(4096) for b in bufs)
        # a long read is one GET per read_size bytes (a GET's body is held whole before the copy)
        proxy.set(latency=0.0)
        src.read_size = 1000
        gets = sum(1 for r in proxy.records if r.method == "GET")
        out = bytearray(4096)
        src.read_into(memoryview(out), 100)
        f.seek(100)
        assert bytes(out) == f.read(4096)
        assert sum(1 for r in proxy.records if r.method == "GET") - gets == 5


def test_faults_are_retried_and_tokens_are_identical(remote_models, remote_servers, fault_proxy):
    from remote_servers import Fault

    path, _ = remote_models["container"]
    ids = _ids(path)
    _, local_tokens, _, local = _run(path, ids)
    local.close()
    proxy = fault_proxy(remote_servers.http.port)
    eng = sluice.load(f"{proxy.url}/rm-container", memory="4GiB", cache_experts=CACHE, progress=False)
    try:
        proxy.inject(Fault("status", status=503), Fault("reset"), Fault("status", status=500),
                     Fault("reset", after=1000), Fault("truncate", after=2000))
        tokens = eng.generate(ids.tolist(), max_new_tokens=N_NEW, ignore_eos=True).token_ids
        assert tokens == local_tokens
        assert not proxy.faults  # every fault was met, and retried
        assert sum(1 for r in proxy.records if r.fault) >= 5
    finally:
        eng.close()


def test_object_changed_mid_run_is_an_expert_read_error(remote_models, remote_servers):
    """A shard replaced on the server (another ETag) after the model was opened: the next expert
    read is an ExpertReadError naming the URL and the expert, never a token from mixed bytes."""
    path, _ = remote_models["sharded"]
    urls = remote_servers.publish("rm-changing", path)
    eng = sluice.load(urls["http"], memory="4GiB", cache_experts=CACHE, progress=False)
    try:
        for shard in (remote_servers.docroot / "rm-changing").glob("*.safetensors"):
            st = shard.stat()
            os.utime(shard, (st.st_atime, st.st_mtime + 100))  # nginx's ETag is mtime-size
        with pytest.raises(ExpertReadError) as err:
            eng.generate(_ids(path).tolist(), max_new_tokens=N_NEW, ignore_eos=True)
        msg = str(err.value)
        assert urls["http"] in msg and "expert" in msg and "the object changed while reading" in msg, msg
    finally:
        eng.close()


def test_wrong_credentials_are_a_checkpoint_error(remote_models, s3_auth_server, monkeypatch):
    path, _ = remote_models["container"]
    s3_auth_server.put_dir("locked", path, prefix="model")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_auth_server.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_auth_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    with pytest.raises(CheckpointError) as err:
        sluice.load("s3://locked/model", memory="4GiB", progress=False)
    assert "s3://locked/model" in str(err.value) and "wrong-secret" not in str(err.value)


def test_credentials_from_an_aws_profile_file(remote_models, s3_auth_server, tmp_path, monkeypatch):
    """No keys in the environment: keys, region and endpoint come from the AWS_PROFILE profile in
    the shared credentials/config files (moto checks the signatures); a profile with a wrong
    secret, or one in neither file, is a CheckpointError naming the URL and never the secret."""
    path, _ = remote_models["container"]
    s3_auth_server.put_dir("locked", path, prefix="model")
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3",
                "AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(var, raising=False)
    creds, config = tmp_path / "credentials", tmp_path / "config"
    key, secret, stale = s3_auth_server.access_key, s3_auth_server.secret_key, "stale-secret-0123456789"
    creds.write_text(f"[default]\naws_access_key_id = {key}\naws_secret_access_key = {stale}\n\n"
                     f"[sluice]\naws_access_key_id = {key}\naws_secret_access_key = {secret}\n")
    config.write_text("".join(f"[{section}]\nregion = us-east-1\nendpoint_url = {s3_auth_server.endpoint}\n\n"
                              for section in ("default", "profile sluice")))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_PROFILE", "sluice")
    ids = _ids(path)
    _, local_tokens, _, local = _run(path, ids)
    local.close()
    eng = sluice.load("s3://locked/model", memory="4GiB", cache_experts=CACHE, progress=False)
    try:
        assert eng.generate(ids.tolist(), max_new_tokens=N_NEW, ignore_eos=True).token_ids == local_tokens
    finally:
        eng.close()
    monkeypatch.delenv("AWS_PROFILE")  # the default profile: its secret is stale
    with pytest.raises(CheckpointError) as err:
        sluice.load("s3://locked/model", memory="4GiB", progress=False)
    assert "s3://locked/model" in str(err.value) and stale not in str(err.value) and secret not in str(err.value)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)  # no keys anywhere, IMDS off: said before any request
    monkeypatch.setenv("AWS_PROFILE", "sluice")
    with pytest.raises(CheckpointError, match="no AWS credentials") as err:
        sluice.load("s3://locked/model", memory="4GiB", progress=False)
    assert "s3://locked/model" in str(err.value)
    monkeypatch.setenv("AWS_PROFILE", "nowhere")
    with pytest.raises(CheckpointError, match="AWS profile 'nowhere' \\(from AWS_PROFILE\\) is in neither") as err:
        sluice.load("s3://locked/model", memory="4GiB", progress=False)
    assert "s3://locked/model" in str(err.value)


def test_cli_run_and_inspect_a_url(text_model, remote_servers, s3_env, tmp_path, monkeypatch, capsys):
    """``sluice inspect`` and ``sluice run`` with an s3:// URL; the tokenizer file comes through the
    local file cache (under XDG_CACHE_HOME)."""
    from sluice.cli import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    url = remote_servers.publish("rm-text", text_model)["s3"]
    args = ["--prompt", "def f():", "--max-new-tokens", "4", "--ignore-eos", "--json", "--no-progress",
            "--memory", "4GiB", "--cache-experts", str(CACHE)]
    assert main(["run", str(text_model), *args]) == 0
    local = json.loads(capsys.readouterr().out)
    assert main(["inspect", url, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model_id"] == "rm-text" and report["path"] == url and not report["container"]
    assert main(["run", url, *args]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == "rm-text" and out["token_ids"] == local["token_ids"] and out["text"] == local["text"]
    # one local cache of what opening reads: the tokenizer's bytes are a metadata copy, no file copy of their own
    assert list((tmp_path / "cache").rglob("*.meta")) and not list((tmp_path / "cache").rglob("tokenizer.json"))


def test_without_the_remote_extra_a_url_says_what_to_install(monkeypatch):
    from sluice.storage import RemoteUnavailableError

    monkeypatch.setitem(sys.modules, "obstore", None)
    with pytest.raises(RemoteUnavailableError, match=r's3://b/m: .*pip install "sluice\[remote\]"'):
        sluice.load("s3://b/m", memory="4GiB", progress=False)



def test_serve_a_url(text_model, remote_servers, tmp_path):
    """``sluice serve https://...`` as a user runs it (``--ca-bundle`` for the test CA): it serves
    the model under the URL's model id and completes like the local model."""
    import signal

    import httpx

    url = remote_servers.publish("rm-text", text_model)["https"]
    local = sluice.load(str(text_model), memory="4GiB", cache_experts=CACHE, progress=False)
    want = local.generate("def f():", max_new_tokens=4, ignore_eos=True).text
    local.close()
    from serve_process import spawn_serve

    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    env.pop("SLUICE_API_KEY", None)
    proc, root = spawn_serve(url, "--memory", "4GiB", "--cache-experts", str(CACHE), "--threads", "1", "--max-context",
                             "128", "--no-progress", "--ca-bundle", str(remote_servers.http.ca_path), "--log-level",
                             "warning", env=env, timeout=60, ready_path="/v1/models")
    base = f"{root}/v1"
    try:
        assert [m["id"] for m in httpx.get(f"{base}/models").json()["data"]] == ["rm-text"]
        r = httpx.post(f"{base}/completions", json={"model": "rm-text", "prompt": "def f():", "max_tokens": 4,
                                                     "temperature": 0, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert f"serving 'rm-text' on {base}" in err


def test_convert_from_a_url(remote_models, s3_env, tmp_path):
    """``sluice convert s3://...`` writes the same container as converting the local directory."""
    from sluice.convert import convert

    path, urls = remote_models["sharded"]
    a = convert(str(path), tmp_path / "local.sluice", progress=False)
    b = convert(urls["s3"], tmp_path / "remote.sluice", progress=False)
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir()) and "manifest.json" in names
    for name in names:
        if name != "manifest.json":
            assert (a / name).read_bytes() == (b / name).read_bytes(), name
    ma, mb = (json.loads((c / "manifest.json").read_text()) for c in (a, b))
    assert (ma["source"]["path"], mb["source"]["path"]) == ("qwen3-sharded", "rm-sharded")
    for m in (ma, mb):
        del m["source"]["path"], m["manifest_sha256"]  # the checksum covers the source's name
    assert ma == mb


def test_missing_or_unreachable_remote_model_is_a_checkpoint_error(remote_models, remote_servers, s3_env):
    from remote_servers import free_port

    for url in ("s3://models/no-such-model", f"{remote_servers.http.url}/no-such-model"):
        with pytest.raises(CheckpointError, match=rf"{url}: not a directory"):
            sluice.load(url, memory="4GiB", progress=False)
    with pytest.raises(CheckpointError, match=r"s3://no-such-bucket/m: cannot open the model: cannot list"):
        sluice.load("s3://no-such-bucket/m", memory="4GiB", progress=False)
    url = f"http://127.0.0.1:{free_port()}/models/m"
    with pytest.raises(CheckpointError, match=rf"{url}: cannot open the model: .*connection refused"):
        sluice.load(url, memory="4GiB", progress=False)


def test_a_bad_ca_bundle_is_a_clear_error(remote_servers, tmp_path):
    from sluice.errors import InvalidArgumentError

    url = f"{remote_servers.http.tls_url}/rm-none"
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate\n")
    for path, what in ((bad, "not a PEM file of CA certificates"), (tmp_path / "missing.pem", "cannot read it")):
        with pytest.raises(CheckpointError, match=rf"{url}: cannot open the model: CA bundle {path}: {what}"):
            sluice.load(url, memory="4GiB", progress=False, ca_bundle=str(path))
    with pytest.raises(InvalidArgumentError, match="ca_bundle must be a file path"):
        sluice.load(url, memory="4GiB", progress=False, ca_bundle=3)
    # without the test CA, the server's certificate is not trusted, and the error says what to do
    with pytest.raises(CheckpointError, match=rf"{url}: cannot open the model: .*not trusted.*CA bundle"):
        sluice.load(url, memory="4GiB", progress=False)
