"""Hostile paths and sizes around a model's files (issue 24): an output that is an input, a
container replaced over a user's file, FIFOs and directories where files belong, prompts and
JSON files too large or too deep, manifest names that leave the container.

Every case: one ``sluice: error:`` line naming the file and the problem (or, for a disk-tier
entry, a refetch), nothing destroyed, nothing blocking. CLI cases run in-process through
``sluice.cli.main``; the ones that could hang run in a subprocess under a timeout.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import sluice
from sluice.cli import main
from sluice.container import seal_manifest
from sluice.container_files import remove_container
from sluice.convert import PARTIAL_MARK, convert
from sluice.storage.jsonfile import MAX_JSON_BYTES

SRC = Path(__file__).resolve().parents[2] / "src"
RUN = ["--memory", "2GiB", "--threads", "1", "--max-context", "64", "--no-progress", "--max-new-tokens", "2",
       "--ignore-eos", "--no-speculate"]


def cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return rc, out, err


def one_error(err: str, *parts: str) -> None:
    lines = [ln for ln in err.splitlines() if ln.startswith("sluice: error:")]
    assert len(lines) == 1, err
    for p in parts:
        assert p in lines[0], (p, lines[0])


def sub(*argv, timeout: float = 60) -> subprocess.CompletedProcess:
    """``sluice ARGV`` in a fresh process that must end within ``timeout`` (a hang fails the test)."""
    env = dict(os.environ, PYTHONPATH=str(SRC))
    return subprocess.run([sys.executable, "-m", "sluice.cli", *map(str, argv)], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="module")
def text_dir(text_model, tmp_path_factory):
    dst = tmp_path_factory.mktemp("outputs") / "hf"
    shutil.copytree(text_model, dst)
    return dst


@pytest.fixture(scope="module")
def text_box(text_model, tmp_path_factory):
    return convert(text_model, tmp_path_factory.mktemp("outputs-box") / "text.sluice", progress=False)


@pytest.fixture
def box(text_box, tmp_path):
    dst = tmp_path / "box.sluice"
    shutil.copytree(text_box, dst)
    return dst


# -- 1. an output is never one of the inputs ------------------------------------------------------------


@pytest.mark.parametrize("target", ["model.safetensors", "config.json", "tokenizer.json", "symlink", "hardlink"])
def test_trace_routing_onto_a_model_file_is_refused(text_dir, tmp_path, capsys, target):
    if target == "symlink":
        out = tmp_path / "trace.jsonl"
        out.symlink_to(text_dir / "model.safetensors")
        victim = text_dir / "model.safetensors"
    elif target == "hardlink":
        out = tmp_path / "trace.jsonl"
        os.link(text_dir / "config.json", out)
        victim = text_dir / "config.json"
    else:
        out = victim = text_dir / target
    before = victim.read_bytes()
    rc, _, err = cli(capsys, "run", text_dir, "-p", "hello", "--trace-routing", out, *RUN)
    assert rc == 2
    one_error(err, f"--trace-routing {out}", "the input file", str(victim), "choose another output")
    assert victim.read_bytes() == before


def test_trace_routing_onto_a_container_bank_is_refused_and_a_new_file_is_written(box, tmp_path, capsys):
    bank = next(p for p in box.iterdir() if p.name.startswith("experts-"))
    before = bank.read_bytes()
    rc, _, err = cli(capsys, "run", box, "-p", "hello", "--trace-routing", bank, *RUN)
    assert rc == 2 and bank.read_bytes() == before
    one_error(err, "is the input file", bank.name)
    rc, _, err = cli(capsys, "run", box, "-p", "hello", "--trace-routing", tmp_path / "t.jsonl", *RUN)
    assert rc == 0 and (tmp_path / "t.jsonl").read_text().count("\n") >= 1


def test_write_pins_onto_its_own_trace_is_refused(box, tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    assert cli(capsys, "run", box, "-p", "hello", "--trace-routing", trace, *RUN)[0] == 0
    before = trace.read_bytes()
    rc, _, err = cli(capsys, "trace-replay", trace, "--write-pins", trace, "--pin-count", "2")
    assert rc == 2 and trace.read_bytes() == before
    one_error(err, f"--write-pins {trace}", "is the input file")


# -- 2. convert --force removes only the container's own files -------------------------------------------


def test_removing_a_replaced_container_keeps_a_foreign_file(box):
    (box / "notes.txt").write_text("mine")
    (box / PARTIAL_MARK).touch()
    left = remove_container(box, PARTIAL_MARK)
    assert left == ["notes.txt"] and (box / "notes.txt").read_text() == "mine"
    assert not (box / "manifest.json").exists() and not (box / PARTIAL_MARK).exists()  # unmarked: never rmtree'd


def test_convert_force_over_a_container_holding_a_user_directory_is_refused(text_dir, box, capsys):
    (box / "runs").mkdir()
    (box / "runs" / "log.txt").write_text("mine")
    rc, _, err = cli(capsys, "convert", text_dir, box, "--force", "--no-progress")
    assert rc == 1 and (box / "runs" / "log.txt").read_text() == "mine"
    one_error(err, "not the container's (runs)", "move them out")


# -- 3. FIFOs, directories and devices where a file belongs: refused at once, never a hang ---------------


def test_fifo_bank_fails_check_and_run_at_once(box):
    bank = next(p for p in box.iterdir() if p.name.startswith("experts-"))
    bank.unlink()
    os.mkfifo(bank)
    for argv in (["check", box, "--no-progress"], ["run", box, "-p", "hello", *RUN]):
        r = sub(*argv)
        assert r.returncode == 1 and "Traceback" not in r.stderr
        one_error(r.stderr, bank.name, "is a FIFO (named pipe), not a regular file")


def test_directory_spine_and_fifo_config_are_named(box, text_dir, tmp_path, capsys):
    (box / "spine.bin").unlink()
    (box / "spine.bin").mkdir()
    rc, _, err = cli(capsys, "check", box, "--no-progress")
    assert rc == 1
    one_error(err, "spine.bin", "is a directory, not a regular file")
    hf = tmp_path / "hf"
    shutil.copytree(text_dir, hf)
    (hf / "config.json").unlink()
    os.mkfifo(hf / "config.json")
    r = sub("run", hf, "-p", "hello", *RUN)
    assert r.returncode == 1
    one_error(r.stderr, "config.json", "is a FIFO (named pipe)")


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_tokenizer_that_is_not_a_file_is_named(text_dir, box, tmp_path, kind):
    """tokenizer.json a FIFO or a directory, in a model directory and in a container: run,
    convert and check end at once with one error naming the tokenizer and what the file is
    (not "no tokenizer.json", and never a tokenizer library blocked on the FIFO)."""
    hf = tmp_path / "hf"
    shutil.copytree(text_dir, hf)
    what = "a FIFO (named pipe)" if kind == "fifo" else "a directory"
    for model in (hf, box):
        (model / "tokenizer.json").unlink()
        os.mkfifo(model / "tokenizer.json") if kind == "fifo" else (model / "tokenizer.json").mkdir()
    for argv in (["run", hf, "-p", "hello", *RUN], ["run", box, "-p", "hello", *RUN],
                 ["convert", hf, tmp_path / "out", "--no-progress"], ["check", box, "--no-progress"]):
        r = sub(*argv)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        one_error(r.stderr, "tokenizer.json: cannot load the tokenizer", f"is {what}, not a regular file")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_disk_tier_entry_that_is_not_a_file_is_a_miss(remote_servers, text_model, tmp_path, kind):
    from sluice.storage import open_source
    from sluice.storage.disk_tier import DiskTier

    url = remote_servers.publish("i24-tier", text_model)["http"] + "/model.safetensors"
    want = (text_model / "model.safetensors").read_bytes()[:8192]
    tier_dir = tmp_path / "tier"
    t = DiskTier(tier_dir, 64 << 20)
    try:
        buf = bytearray(len(want))
        open_source(url, disk_tier=t).read_into(memoryview(buf), 0)
    finally:
        t.close()
    entries = [p for p in (tier_dir / "entries").rglob("*.entry")]
    assert entries and bytes(buf) == want
    for p in entries:
        p.unlink()
        os.mkfifo(p) if kind == "fifo" else p.mkdir()
    code = ("import sys\nfrom sluice.storage import open_source\nfrom sluice.storage.disk_tier import DiskTier\n"
            f"t = DiskTier({str(tier_dir)!r}, 64 << 20)\nbuf = bytearray({len(want)})\n"
            f"src = open_source({url!r}, disk_tier=t)\nsrc.read_into(memoryview(buf), 0)\n"
            "sys.stdout.buffer.write(bytes(buf))\nt.close()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=str(SRC)))
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout == want  # refetched from the server


# -- 4. a prompt file or stdin is read and counted in pieces ---------------------------------------------


def test_huge_prompt_file_is_refused_in_pieces(text_dir, tmp_path, capsys):
    big = tmp_path / "big.txt"
    with open(big, "w") as f:
        line = "the quick brown fox jumps over the lazy dog\n" * 1000
        for _ in range(50_000_000 // len(line)):
            f.write(line)
    rc, _, err = cli(capsys, "run", text_dir, "--prompt-file", big, *RUN)
    assert rc == 2
    one_error(err, f"--prompt-file {big}", "longer than the context", "64")


def test_prompt_file_dev_zero_and_stdin_are_bounded(text_dir, capsys, monkeypatch):
    rc, _, err = cli(capsys, "run", text_dir, "--prompt-file", "/dev/zero", *RUN)
    assert rc == 2
    one_error(err, "--prompt-file /dev/zero", "longer than the context")
    monkeypatch.setattr(sys, "stdin", io.StringIO("word " * 2_000_000))
    rc, _, err = cli(capsys, "run", text_dir, *RUN)
    assert rc == 2
    one_error(err, "stdin", "longer than the context")
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello world"))
    assert cli(capsys, "run", text_dir, *RUN)[0] == 0


# -- 5. JSON files: size-capped before reading, depth-checked before parsing -----------------------------


def _sparse(path: Path, size: int) -> None:
    path.unlink(missing_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)


def test_huge_config_json_is_refused_unread(text_dir, tmp_path, capsys):
    hf = tmp_path / "hf"
    shutil.copytree(text_dir, hf)
    _sparse(hf / "config.json", 300 << 20)
    with pytest.raises(sluice.CheckpointError, match=r"config\.json: is 314572800 bytes, more than the"):
        sluice.load(hf, memory="2GiB", progress=False)
    rc, _, err = cli(capsys, "inspect", hf)
    assert rc == 1
    one_error(err, "config.json", f"at most {MAX_JSON_BYTES >> 20} MiB")


def test_huge_config_json_over_http_is_refused_before_the_get(remote_servers, text_dir, capsys):
    root = remote_servers.docroot / "i24-huge"
    shutil.copytree(text_dir, root, dirs_exist_ok=True)
    _sparse(root / "config.json", 300 << 20)
    url = f"{remote_servers.http.url}/i24-huge"
    rc, _, err = cli(capsys, "inspect", url)
    assert rc == 1
    one_error(err, f"{url}/config.json", "is 314572800 bytes")


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json", "manifest.json"])
def test_json_nested_100000_deep_is_a_named_error(text_dir, box, tmp_path, capsys, name):
    where = box if name == "manifest.json" else tmp_path / "hf"
    if where != box:
        shutil.copytree(text_dir, where)
    (where / name).write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    rc, _, err = cli(capsys, "run", where, "-p", "hello", *RUN)
    assert rc == 1
    one_error(err, name, "nests JSON 100001 levels deep, more than the 64")


# -- 6. names in a manifest stay inside the container ----------------------------------------------------


@pytest.mark.parametrize("bad", ["../../../../etc/passwd", "/etc/passwd", "..", "a\\..\\b", "tok\x00.json"])
def test_manifest_names_outside_the_container_are_refused(box, capsys, bad):
    m = json.loads((box / "manifest.json").read_text())
    m["tokenizer_files"] = ["tokenizer.json", bad]
    (box / "manifest.json").write_text(json.dumps(seal_manifest(m)))
    rc, _, err = cli(capsys, "check", box, "--no-progress")
    assert rc == 1
    one_error(err, "manifest.json", "invalid tokenizer file name", "plain files inside its directory")


def test_metadata_copy_that_is_a_fifo_or_too_deep_is_no_copy(tmp_path):
    """The metadata cache beside the disk tier: a FIFO under a copy's name is no copy (at once), and
    a header nested thousands deep is a corrupt copy, not a RecursionError."""
    from sluice.storage.meta_cache import MAGIC, MetaCache
    from sluice.storage.tier_entry import MAGIC as ENTRY_MAGIC, parse_header

    cache = MetaCache(tmp_path / "meta")
    url = "http://example.invalid/m/config.json"
    p = cache.path(url, 0, None)
    p.parent.mkdir(parents=True)
    os.mkfifo(p)
    assert cache.get(url) is None
    p.unlink()
    p.write_bytes(MAGIC + b"[" * 5000 + b"]" * 5000 + b"\n{}")
    with pytest.warns(UserWarning):
        assert cache.get(url) is None
    with pytest.raises(ValueError, match="nests too deep"):
        parse_header(ENTRY_MAGIC + b"[" * 3000 + b"]" * 3000 + b"\n")
