"""A remote model's metadata (config, index, manifest, tokenizer files, safetensors headers): kept in
the local cache directory by URL and ETag, revalidated at a restart (one HEAD or conditional GET per
object, no body), refetched when the object changed, never used when its copy is corrupt; and
shown while it is fetched (on a terminal only, and only when progress was asked for).

Real servers on loopback (nginx, moto S3) behind the tests' proxy, which records every request.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import warnings
from collections import Counter
from pathlib import Path

import pytest

from sluice.engine import ModelInfo, Options
from sluice.progress import Activity
from sluice.storage.meta_cache import MAGIC, MetaCache

pytest.importorskip("obstore")


@pytest.fixture(scope="module")
def meta_models(remote_servers, text_model, family_models, tmp_path_factory):
    """{name: local copy}: a sharded Hugging Face directory with a tokenizer, and a container; each
    published to both servers under a name of its own (tests change files in them)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("meta-models")
    sharded = root / "sharded"
    AutoModelForCausalLM.from_pretrained(text_model).save_pretrained(sharded, max_shard_size="300KB")
    for f in text_model.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, sharded / f.name)
    assert (sharded / "model.safetensors.index.json").is_file() and (sharded / "tokenizer.json").is_file()
    container = root / "container"
    shutil.copytree(family_models.container("qwen3_moe"), container)
    return {"sharded": sharded, "container": container}


def _publish(remote_servers, name: str, path: Path, server: str, proxy) -> str:
    """The model's URL through ``proxy`` (in front of the server)."""
    remote_servers.publish(name, path)
    if server == "http":
        return f"{proxy.url}/{name}"
    return f"s3://{remote_servers.bucket}/{name}"


def _open(url: str, **kw) -> ModelInfo:
    info = ModelInfo(url, Options(**{"progress": False, **kw}))
    info.close()
    return info


def _proxy(remote_servers, fault_proxy, monkeypatch, server):
    if server == "http":
        return fault_proxy(remote_servers.http.port)
    proxy = fault_proxy(remote_servers.s3.port)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    return proxy


@pytest.mark.parametrize("model,server", [("sharded", "http"), ("container", "s3")])
def test_a_restart_revalidates_metadata_instead_of_refetching(meta_models, remote_servers, fault_proxy, tmp_path,
                                                             monkeypatch, model, server):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    proxy = _proxy(remote_servers, fault_proxy, monkeypatch, server)
    url = _publish(remote_servers, f"meta-{model}-{server}", meta_models[model], server, proxy)
    cold = _open(url)
    first = list(proxy.records)
    assert sum(r.body_bytes for r in first) > 0
    proxy.reset()
    warm = _open(url)
    again = list(proxy.records)
    assert warm.raw_config == cold.raw_config and warm.checkpoint.tensors.keys() == cold.checkpoint.tensors.keys()
    # no object's bytes are fetched again: HEADs, 304s and (S3) one listing, nothing with a body
    assert sum(r.body_bytes for r in again if r.method == "GET" and "list-type" not in r.target) == 0
    assert all(r.status in (200, 304, 404) for r in again)
    per_object = Counter(r.target for r in again if "list-type" not in r.target)
    assert max(per_object.values()) == 1, per_object  # one request per object, at most
    assert len(again) < len(first)


def test_a_changed_object_is_refetched_never_served_stale(meta_models, remote_servers, fault_proxy, tmp_path,
                                                         monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    proxy = fault_proxy(remote_servers.http.port)
    local = tmp_path / "model"
    shutil.copytree(meta_models["sharded"], local)
    url = _publish(remote_servers, "meta-changing", local, "http", proxy)
    _open(url)
    cfg = json.loads((local / "config.json").read_text())
    cfg["sluice_test_marker"] = 7
    (local / "config.json").write_text(json.dumps(cfg))
    tok = json.loads((local / "tokenizer_config.json").read_text())
    tok["model_max_length"] = 12345
    (local / "tokenizer_config.json").write_text(json.dumps(tok))
    shard = sorted(local.glob("model-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())  # the same tensors, the header's JSON padded with one more space
    hlen = int.from_bytes(data[:8], "little")
    shard.write_bytes((hlen + 1).to_bytes(8, "little") + data[8:8 + hlen] + b" " + data[8 + hlen:])
    remote_servers.publish("meta-changing", local)
    proxy.reset()
    info = _open(url)
    assert info.raw_config["sluice_test_marker"] == 7
    assert info.tokenizer.config["model_max_length"] == 12345
    t = next(t for t in info.checkpoint.tensors.values() if t.file.endswith(shard.name))
    assert t.offset >= 8 + hlen + 1  # the new header's data offsets
    fetched = {r.target.rpartition("/")[2] for r in proxy.records if r.method == "GET" and r.status in (200, 206)}
    assert {"config.json", "tokenizer_config.json", shard.name} <= fetched


def test_a_corrupt_cached_copy_is_detected_and_refetched(meta_models, remote_servers, fault_proxy, tmp_path,
                                                        monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    proxy = fault_proxy(remote_servers.http.port)
    url = _publish(remote_servers, "meta-corrupt", meta_models["sharded"], "http", proxy)
    good = _open(url)
    copies = sorted((tmp_path / "cache" / "sluice" / "meta").rglob("*.meta"))
    assert len(copies) >= 4  # config, generation config, index, tokenizer config, shard headers
    damage = [
        lambda b: b[:-1] + bytes([b[-1] ^ 1]),  # a flipped bit in the body
        lambda b: b[: len(b) // 2],  # truncated
        lambda b: b"garbage" + b[7:],  # bad magic
        lambda b: b.replace(b'"etag":"', b'"etag":"X', 1),  # another version claimed (CRC still matches)
        lambda b: MAGIC + b"{not json\n" + b.split(b"\n", 2)[2],
    ]
    for i, p in enumerate(copies):
        p.write_bytes(damage[i % len(damage)](p.read_bytes()))
    proxy.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info = _open(url)
    assert info.raw_config == good.raw_config and info.checkpoint.tensors == good.checkpoint.tensors
    assert info.tokenizer.config == good.tokenizer.config
    corrupt = [w for w in caught if "is corrupt" in str(w.message)]
    changed = sum(1 for i in range(len(copies)) if i % len(damage) != 3)
    assert len(corrupt) == changed
    # every copy is whole again: a third start fetches no bodies
    proxy.reset()
    _open(url)
    assert sum(r.body_bytes for r in proxy.records if r.method == "GET") == 0


def test_meta_cache_round_trip_and_write_failure(tmp_path):
    c = MetaCache(tmp_path / "m")
    assert c.get("http://h/x") is None
    c.put("http://h/x", '"e1"', b"body")
    c.put("http://h/x", None, b"no etag: not kept", 5, 10)
    assert c.get("http://h/x") == ('"e1"', b"body") and c.get("http://h/x", 5, 10) is None
    assert c.get("http://h/y") is None  # another URL
    ro = MetaCache(tmp_path / "file")
    (tmp_path / "file").write_text("not a directory")
    with pytest.warns(UserWarning, match="cannot keep remote metadata"):
        ro.put("http://h/x", '"e1"', b"body")
    ro.put("http://h/x", '"e1"', b"body")  # warned once


class _Tty(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("tty,progress", [(True, True), (True, False), (False, True)])
def test_metadata_fetches_show_progress_on_a_terminal_when_asked(meta_models, remote_servers, tmp_path, monkeypatch,
                                                                tty, progress):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    urls = remote_servers.publish("meta-progress", meta_models["sharded"])
    err = _Tty() if tty else io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    monkeypatch.setattr("sluice.progress.Activity.step", _every_step(Activity.step))
    _open(urls["http"], progress=progress)
    out = err.getvalue()
    if not (tty and progress):
        assert out == ""
        return
    assert f"{urls['http']}: metadata" in out
    for name in ("config.json", "model.safetensors.index.json", "tokenizer.json"):
        assert name in out
    last = out.rstrip("\n").rpartition("\r")[2]
    assert " requests, " in last and " KB" in last and last.endswith("\x1b[K")


def _every_step(step):
    """``Activity.step`` without its 0.1 s redraw limit (the test sees every request named)."""
    def every(self, what):
        self._last = -1.0
        return step(self, what)
    return every


@pytest.mark.parametrize("server", ["http", "s3"])
def test_a_member_read_whole_is_revalidated_by_one_conditional_get(meta_models, remote_servers, fault_proxy, tmp_path,
                                                                  monkeypatch, server):
    """Without this run's HEAD of it, a kept copy costs one GET answered 304 (no body); a changed
    member is one GET with its new body."""
    from sluice.storage import open_store

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    proxy = _proxy(remote_servers, fault_proxy, monkeypatch, server)
    local = tmp_path / "m"
    local.mkdir()
    (local / "config.json").write_text('{"a": 1}')
    url = _publish(remote_servers, f"meta-cond-{server}", local, server, proxy)
    assert open_store(url).read_bytes("config.json") == b'{"a": 1}'
    proxy.reset()
    assert open_store(url).read_bytes("config.json") == b'{"a": 1}'
    assert [(r.method, r.status, r.body_bytes) for r in proxy.records] == [("GET", 304, 0)]
    (local / "config.json").write_text('{"a": 22}')  # another size: nginx's ETag is mtime (seconds) and size
    _publish(remote_servers, f"meta-cond-{server}", local, server, proxy)
    proxy.reset()
    assert open_store(url).read_bytes("config.json") == b'{"a": 22}'
    assert [(r.method, r.status) for r in proxy.records] == [("GET", 200)]


def test_cache_list_and_clear_cover_the_metadata_cache(tmp_path, monkeypatch, capsys):
    """``sluice cache list|clear`` with no disk tier: the metadata cache's copies are listed and removed
    (all, or a model's by the URL in each copy's header); foreign files, links and a live writer's
    temporary file are left alone; a corrupt copy is cleared with the rest."""
    from sluice.cli import main
    from sluice.storage import meta_cache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    c = MetaCache()
    a = "https://h/models/a"
    for url, offset, length in ((f"{a}/config.json", 0, None), (f"{a}/tokenizer.json", 0, None),
                                (f"{a}/model.safetensors", 0, 8), ("https://h/models/ab/config.json", 0, None),
                                ("s3://b/other.sluice/manifest.json", 0, None)):
        c.put(url, '"e1"', b"{}" * 10, offset, length)
    corrupt = c.path("https://h/models/x/config.json", 0, None)
    corrupt.parent.mkdir(parents=True, exist_ok=True)
    corrupt.write_bytes(MAGIC + b"{not json\nbody")
    dead = corrupt.with_name(f".{corrupt.name}.999999999.0123abcd.tmp")  # a killed writer's (no such pid)
    dead.write_bytes(MAGIC + b"partial")
    live = corrupt.with_name(f".{corrupt.name}.{os.getpid()}.0123abcd.tmp")  # being written now
    live.write_bytes(MAGIC + b"partial")
    user = tmp_path / "user.meta"
    user.write_bytes(MAGIC + b"a user's file that looks like a copy")
    link = c.path("https://h/models/a/linked", 0, None)
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(user)
    foreign = [c.dir / "notes.txt", c.dir / "ab" / ("0" * 40 + ".meta"), corrupt.parent / "mine.meta", link]
    for f in foreign[:3]:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("user data")  # no magic line, or not a copy's name
    assert main(["cache", "list", "--json"]) == 0
    out = capsys.readouterr()
    report = json.loads(out.out)
    assert (report["exists"], report["entries"], report["models"]) == (False, 0, [])  # no disk tier: keys kept
    m = report["meta"]
    assert (m["dir"], m["files"], m["corrupt"], m["partial"], m["foreign"]) == (str(c.dir), 6, 1, 2, 4)
    assert m["bytes"] == sum(p.stat().st_size for p in c.dir.rglob("*.meta") if p.is_file() and
                             not p.is_symlink() and p.read_bytes().startswith(MAGIC))
    assert "4 file(s)" in out.err and "left alone" in out.err
    assert main(["cache", "list"]) == 0
    text = capsys.readouterr().out
    assert "no disk tier at" in text and f"metadata cache {c.dir}: 6 files" in text and "1 corrupt" in text
    # one model: its copies only (not .../ab, whose URL only starts with the same letters)
    assert main(["cache", "clear", a + "/", "--json"]) == 0
    m = json.loads(capsys.readouterr().out)["meta"]
    assert m["removed"]["files"] == 3 and m["files"] == 3 and m["notes"] == []
    assert sorted(x.url or "?" for x in meta_cache.survey().copies) == [
        "?", "?", "?", "https://h/models/ab/config.json", "s3://b/other.sluice/manifest.json"]
    assert main(["cache", "clear", "https://h/models/zzz"]) == 1
    assert "holds anything of https://h/models/zzz" in capsys.readouterr().err
    assert main(["cache", "clear"]) == 0
    assert "removed 3 files" in capsys.readouterr().out
    left = meta_cache.survey()
    assert [x.path for x in left.copies] == [live] and sorted(left.foreign) == sorted(foreign)
    assert all(f.read_text() == "user data" for f in foreign[:3]) and user.read_bytes().startswith(MAGIC)
    assert not dead.exists() and live.exists()
    assert main(["cache", "--help"]) == 0
    assert "metadata cache" in capsys.readouterr().out


def test_an_unreadable_metadata_cache_is_reported_not_a_traceback(tmp_path, monkeypatch, capsys):
    from sluice.cli import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    meta = tmp_path / "cache" / "sluice" / "meta"
    meta.parent.mkdir(parents=True)
    meta.write_text("a file where the directory belongs")
    assert main(["cache", "list"]) == 0
    out = capsys.readouterr()
    assert f"sluice: warning: metadata cache: cannot read {meta}: Not a directory" in out.err
    assert "Traceback" not in out.err
    assert main(["cache", "clear", "--json"]) == 1
    out = capsys.readouterr()
    assert json.loads(out.out)["meta"]["notes"] == [f"cannot read {meta}: Not a directory"]
    assert out.err.startswith("sluice: error: the metadata cache was not cleared completely: cannot read")
    assert main(["cache", "clear", "https://h/models/a"]) == 1
    assert "not cleared completely: cannot read" in capsys.readouterr().err
    assert meta.read_text() == "a file where the directory belongs"
