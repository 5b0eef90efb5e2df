"""Finding models where users keep them: local paths, ``demo``, and repo ids in the Hugging Face cache.

The cache is laid out by the test as ``hf download`` lays it out (``models--org--name/blobs/``
holding the files by hash, ``snapshots/<commit>/`` holding relative symlinks to them,
``refs/<branch>`` holding a commit hash), and read through ``huggingface_hub``'s cache functions.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import sluice
from sluice.resolve import DEMO_DIR, DEMO_MODEL_ID, ModelNotFoundError, resolve_model

REPO = "tiny-org/qwen3-text"
COMMIT_MAIN = "a" * 40
COMMIT_OLD = "b" * 40


def _etag(data: bytes, lfs: bool) -> str:
    """The name the hub client gives a blob: sha256 for LFS files, the git blob sha1 otherwise."""
    if lfs:
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def add_snapshot(cache: Path, repo_id: str, commit: str, files: dict[str, bytes], refs: tuple[str, ...] = ()) -> Path:
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for name, data in files.items():
        blob = repo / "blobs" / _etag(data, name.endswith(".safetensors"))
        blob.write_bytes(data)
        (snap / name).symlink_to(os.path.relpath(blob, snap))
    for ref in refs:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)  # as the hub client writes it: no newline
    return snap


@pytest.fixture(scope="module")
def hub_cache(text_model, tmp_path_factory):
    """A Hugging Face cache with REPO at two commits: main (the model) and an older one, tagged v1,
    whose config differs only in a field Sluice ignores."""
    cache = tmp_path_factory.mktemp("hf") / "hub"
    files = {p.name: p.read_bytes() for p in sorted(text_model.iterdir()) if p.is_file()}
    main = add_snapshot(cache, REPO, COMMIT_MAIN, files, refs=("main",))
    cfg = json.loads(files["config.json"])
    cfg["_name_or_path"] = "old"
    old = add_snapshot(cache, REPO, COMMIT_OLD, {**files, "config.json": json.dumps(cfg).encode()}, refs=("v1",))
    return cache, main, old


def test_repo_id_resolves_main_and_revisions(hub_cache):
    cache, main, old = hub_cache
    assert resolve_model(REPO, cache_dir=cache) == (main, REPO)
    assert resolve_model(REPO, "v1", cache_dir=cache) == (old, REPO)  # a tag under refs/
    assert resolve_model(REPO, COMMIT_OLD, cache_dir=cache) == (old, REPO)  # a commit hash
    assert (main / "config.json").is_symlink() and (main / "model.safetensors").resolve().parent.name == "blobs"


def test_missing_models_say_what_to_do(hub_cache, tmp_path, monkeypatch):
    cache, _, _ = hub_cache
    with pytest.raises(ModelNotFoundError, match=r"no model 'tiny-org/absent' in the Hugging Face cache .*"
                                                 r"hf download tiny-org/absent$"):
        resolve_model("tiny-org/absent", cache_dir=cache)
    with pytest.raises(ModelNotFoundError, match=r"not revision 'v9'.*hf download tiny-org/qwen3-text --revision v9"):
        resolve_model(REPO, "v9", cache_dir=cache)
    add_snapshot(cache, "tiny-org/partial", COMMIT_MAIN, {"config.json": b"{}"}, refs=("main",))
    with pytest.raises(ModelNotFoundError, match=r"has a config.json but no safetensors weights.*"
                                                 r"finish it: hf download tiny-org/partial$"):
        resolve_model("tiny-org/partial", cache_dir=cache)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFoundError, match=r"^\./absent: no such file or directory$"):
        resolve_model("./absent")
    with pytest.raises(ModelNotFoundError, match="--revision applies to a Hugging Face repo id"):
        resolve_model(".", "main")


def test_local_path_wins(hub_cache, text_model, tmp_path, monkeypatch):
    cache, _, _ = hub_cache
    assert resolve_model("demo") == (DEMO_DIR, DEMO_MODEL_ID)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny-org").mkdir()
    (tmp_path / "tiny-org" / "qwen3-text").symlink_to(text_model)
    (tmp_path / "demo").symlink_to(text_model)
    assert resolve_model(REPO, cache_dir=cache) == (Path(REPO), "qwen3-text")
    assert resolve_model("demo") == (Path("demo"), "demo")


def test_load_and_cli_use_the_cache(hub_cache, text_model):
    """``sluice.load`` takes a repo id; the CLI finds the cache through HF_HOME (offline)."""
    cache, main, _ = hub_cache
    from huggingface_hub import constants

    old = constants.HF_HUB_CACHE
    constants.HF_HUB_CACHE = str(cache)  # what HF_HUB_CACHE in the environment sets at import
    try:
        with sluice.load(REPO, memory="2GiB", threads=1, progress=False) as eng:
            assert (eng.model_id, eng.path) == (REPO, main)
            got = eng.generate("import os", max_new_tokens=4, ignore_eos=True).token_ids
    finally:
        constants.HF_HUB_CACHE = old
    with sluice.load(text_model, memory="2GiB", threads=1, progress=False) as eng:
        assert eng.generate("import os", max_new_tokens=4, ignore_eos=True).token_ids == got

    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")}
    env.update(HF_HOME=str(cache.parent), HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-m", "sluice.cli", "inspect", REPO, "--revision", "v1", "--json"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["model_id"] == REPO and report["path"] == str(hub_cache[2]) and report["experts_per_layer"] == 8


def test_urls_resolve_to_themselves(hub_cache):
    """A URL is a remote store, ahead of the demo and repo-id rules: returned as the URL (a str), its
    model id the last path component; --revision is for repo ids only; unknown schemes are refused."""
    from sluice.errors import CheckpointError

    assert resolve_model("s3://bucket/models/Qwen3-30B-A3B/") == ("s3://bucket/models/Qwen3-30B-A3B", "Qwen3-30B-A3B")
    assert resolve_model("https://host/demo") == ("https://host/demo", "demo")
    assert resolve_model("HTTP://host/m.sluice") == ("HTTP://host/m.sluice", "m.sluice")
    with pytest.raises(ModelNotFoundError, match="--revision applies to a Hugging Face repo id"):
        resolve_model("s3://bucket/m", revision="main")
    with pytest.raises(CheckpointError, match="unknown URL scheme 'gs'"):
        resolve_model("gs://bucket/m")
