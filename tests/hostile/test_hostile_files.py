"""Hostile and damaged files: every case gets a clear error naming the problem, never a
traceback, never wrong tokens, never a deleted user file.

The corpus is generated here from the tiny checkpoints of conftest (no committed binaries):
``sluice convert`` onto paths it must not touch, a full disk mid-write, flipped bytes in
spine.bin and in expert records (before a run and during one), edited, truncated and
missing container files. Hostile safetensors headers: test_hostile_safetensors.py. CLI
cases run in-process through ``sluice.cli.main``.
"""

from __future__ import annotations

import errno
import json
import shutil
import warnings

import pytest

import sluice
from sluice.cli import main
from sluice.check import check_container
from sluice.container import CHECKSUM_KEY, HEADER_BYTES, seal_manifest
from sluice.convert import ConvertError, convert

MEM = "2GiB"
PROMPT = [5, 9, 17, 33, 61, 7, 3, 120]
N_NEW = 8
TEXT = "hello world"


# -- helpers ------------------------------------------------------------------------------------


def cli(capsys, *argv) -> tuple[int, str, str]:
    """Run ``sluice ARGV`` in-process; (exit code, stdout, stderr). Never a traceback."""
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:  # argparse usage errors
        rc = e.code
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err
    return rc, out.out, out.err


def flip(path, offset: int, mask: int = 0x40) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ mask]))


def tokens(path, prompt=PROMPT, **opts) -> list[int]:
    opts.setdefault("progress", False)
    with sluice.load(path, memory=MEM, **opts) as eng:
        return eng.generate(prompt, max_new_tokens=N_NEW, ignore_eos=True).token_ids


def manifest(box) -> dict:
    return json.loads((box / "manifest.json").read_text())


def write_manifest(box, m: dict, seal: bool = False) -> None:
    (box / "manifest.json").write_text(json.dumps(seal_manifest(m) if seal else m))


def tree(path) -> dict:
    """Every file under ``path`` -> its bytes (to prove nothing was touched)."""
    return {p.relative_to(path): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def spine_offset(box, name: str) -> int:
    return manifest(box)["spine"]["tensors"][name]["offset"]


# -- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def packed(model_dir, tmp_path_factory):
    """(hf dir, container, clean tokens) of the tiny Qwen3-MoE (f32 experts)."""
    hf = model_dir("qwen3_moe")
    box = convert(hf, tmp_path_factory.mktemp("hostile") / "clean.sluice", progress=False)
    return hf, box, tokens(box)


@pytest.fixture
def box(packed, tmp_path):
    """A fresh copy of the clean container to damage."""
    dst = tmp_path / "box.sluice"
    shutil.copytree(packed[1], dst)
    return dst


@pytest.fixture
def hf(packed, tmp_path):
    """A fresh copy of the Hugging Face directory to damage (or convert around)."""
    dst = tmp_path / "models" / "hf"
    shutil.copytree(packed[0], dst)
    return dst


@pytest.fixture(scope="module")
def text_box(text_model, tmp_path_factory):
    """A container of the tokenizer-carrying model, and its clean `sluice run --json` token ids."""
    box = convert(text_model, tmp_path_factory.mktemp("hostile-text") / "text.sluice", progress=False)
    return box, tokens(box, TEXT)


def run_json(capsys, box, *extra) -> tuple[int, list[int] | None, str]:
    rc, out, err = cli(capsys, "run", box, "-p", TEXT, "--max-new-tokens", N_NEW, "--ignore-eos",
                       "--memory", MEM, "--no-progress", "--json", *extra)
    return rc, (json.loads(out)["token_ids"] if rc == 0 else None), err


# -- convert never destroys data ------------------------------------------------------------------


def test_convert_onto_source(capsys, hf):
    before = tree(hf)
    rc, _, err = cli(capsys, "convert", hf, hf, "--no-progress")
    assert rc == 1 and "the output is the source model directory" in err
    assert tree(hf) == before


def test_convert_onto_source_with_force(capsys, hf):
    before = tree(hf)
    rc, _, err = cli(capsys, "convert", hf, hf, "--force", "--no-progress")
    assert rc == 1 and "the output is the source model directory" in err
    assert tree(hf) == before


def test_convert_into_source(capsys, hf):
    before = tree(hf)
    rc, _, err = cli(capsys, "convert", hf, hf / "packed", "--no-progress")
    assert rc == 1 and "lies inside the source model directory" in err
    assert tree(hf) == before and not (hf / "packed").exists() and not (hf / "packed.partial").exists()


def test_convert_onto_parent_of_source(capsys, hf):
    parent = hf.parent
    (parent / "notes.txt").write_text("mine")
    before = tree(parent)
    rc, _, err = cli(capsys, "convert", hf, parent, "--force", "--no-progress")
    assert rc == 1 and "contains the source model directory" in err
    assert tree(parent) == before


def test_convert_onto_regular_file(capsys, hf, tmp_path):
    target = tmp_path / "out.sluice"
    target.write_text("precious")
    rc, _, err = cli(capsys, "convert", hf, target, "--force", "--no-progress")
    assert rc == 1 and f"{target}: exists and is not a directory" in err
    assert target.read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models", "out.sluice"]  # no .old, no .partial


def test_convert_onto_other_directory(capsys, hf, tmp_path):
    target = tmp_path / "photos"
    target.mkdir()
    (target / "cat.jpg").write_bytes(b"\xff\xd8meow")
    rc, _, err = cli(capsys, "convert", hf, target, "--force", "--no-progress")
    assert rc == 1 and "exists and is not a Sluice container" in err
    assert (target / "cat.jpg").read_bytes() == b"\xff\xd8meow"


def test_convert_onto_container_needs_force(capsys, hf, box):
    before = tree(box)
    rc, _, err = cli(capsys, "convert", hf, box, "--no-progress")
    assert rc == 1 and "a Sluice container already exists there; pass --force" in err
    assert tree(box) == before


def test_convert_onto_container_with_force(capsys, packed, hf, box):
    (box / "stale.bin").write_bytes(b"x")  # a file that is not the container's: --force refuses, deletes nothing
    before = tree(box)
    rc, _, err = cli(capsys, "convert", hf, box, "--force", "--no-progress")
    assert rc == 1 and "not the container's (stale.bin)" in err and tree(box) == before
    (box / "stale.bin").unlink()
    rc, _, err = cli(capsys, "convert", hf, box, "--force", "--no-progress")
    assert rc == 0 and f"wrote {box}" in err
    assert not (box / ".sluice-partial").exists()
    assert sorted(p.name for p in box.parent.iterdir()) == ["box.sluice", "models"]  # no .old, no .partial
    assert check_container(box, progress=False)["ok"]
    assert tokens(box) == packed[2]


def test_convert_force_without_rename_exchange(monkeypatch, packed, hf, box):
    """Where renameat2(RENAME_EXCHANGE) is missing: rename aside, rename in, delete; nothing left over."""
    import sluice.convert_install as conv

    monkeypatch.setattr(conv, "exchange", lambda a, b: False)
    convert(hf, box, progress=False, force=True)
    assert sorted(p.name for p in box.parent.iterdir()) == ["box.sluice", "models"]
    assert tokens(box) == packed[2]


def test_convert_refuses_foreign_partial(capsys, hf, tmp_path):
    """``OUT.partial`` that convert did not leave behind is not deleted."""
    foreign = tmp_path / "out.sluice.partial"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    rc, _, err = cli(capsys, "convert", hf, tmp_path / "out.sluice", "--no-progress")
    assert rc == 1 and "out.sluice.partial: exists and was not left by sluice convert" in err
    assert (foreign / "keep.txt").read_text() == "mine"


class FullDisk:
    """A file whose writes fail with ENOSPC once ``budget`` bytes are written (shared budget)."""

    def __init__(self, path, budget: list[int]):
        self._f, self._budget = open(path, "wb"), budget

    def write(self, data) -> int:
        n = memoryview(data).nbytes
        if n > self._budget[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        self._budget[0] -= n
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)


@pytest.mark.parametrize("budget,where", [(3000, "spine.bin"), (650_000, "experts-L002.bin")])
def test_convert_enospc_mid_write(capsys, monkeypatch, packed, hf, tmp_path, budget, where):
    import sluice.convert as conv

    sizes = [budget]
    monkeypatch.setattr(conv, "open_writer", lambda path: FullDisk(path, sizes))
    out = tmp_path / "full.sluice"
    rc, _, err = cli(capsys, "convert", hf, out, "--no-progress")
    assert rc == 1 and "no space left on the device while writing the container" in err
    assert f"{where}:" in err and "full.sluice.partial was removed" in err
    assert not out.exists() and not (tmp_path / "full.sluice.partial").exists()
    monkeypatch.undo()
    convert(hf, out, progress=False)  # the disk has room again: converting works
    assert tokens(out) == packed[2]


def test_convert_enospc_replacing_keeps_old_container(monkeypatch, packed, hf, box):
    import sluice.convert as conv

    before = tree(box)
    monkeypatch.setattr(conv, "open_writer", lambda path: FullDisk(path, [200_000]))
    with pytest.raises(ConvertError, match="no space left"):
        convert(hf, box, progress=False, force=True)
    assert tree(box) == before and not box.with_name("box.sluice.partial").exists()


# -- containers: flipped bytes ----------------------------------------------------------------


def test_spine_flip_caught_at_load(capsys, text_box, tmp_path):
    box = tmp_path / "t.sluice"
    shutil.copytree(text_box[0], box)
    flip(box / "spine.bin", spine_offset(box, "model.layers.1.self_attn.q_proj.weight") + 101)
    rc, ids, err = run_json(capsys, box)
    assert rc == 1 and ids is None
    assert "spine.bin: spine group 'layer.1' CRC mismatch" in err


@pytest.mark.parametrize("tensor", ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"])
def test_spine_flip_global_groups(box, tensor):
    flip(box / "spine.bin", spine_offset(box, tensor) + 3, 0x01)
    with pytest.raises(sluice.CheckpointError, match=r"spine\.bin: spine group '(embed|head)' CRC mismatch"):
        sluice.load(box, memory=MEM, progress=False)


def test_spine_flip_in_streamed_layer_caught_at_load(box):
    flip(box / "spine.bin", spine_offset(box, "model.layers.2.mlp.gate.weight") + 7)
    with pytest.raises(sluice.CheckpointError, match="spine group 'layer.2' CRC mismatch"):
        sluice.load(box, memory=MEM, progress=False, max_resident_layers=0)


def test_spine_flip_during_streamed_run(packed, box):
    """A streamed layer's spine is CRC-checked on every fill: damage mid-run is an error, not tokens."""
    eng = sluice.load(box, memory=MEM, progress=False, max_resident_layers=0)
    assert eng.spine is not None and len(eng.plan.streamed_layers) == 3
    assert eng.generate(PROMPT, max_new_tokens=N_NEW, ignore_eos=True).token_ids == packed[2]
    # (with 3 streamed layers in 2 buffers, layers 0 and 2 share one and are read for every forward)
    flip(box / "spine.bin", spine_offset(box, "model.layers.2.self_attn.o_proj.weight") + 64)
    with pytest.raises(sluice.CheckpointError, match="spine group 'layer.2' CRC mismatch when streamed"):
        eng.generate(PROMPT, max_new_tokens=N_NEW, ignore_eos=True)
    eng.close()


def test_spine_flip_during_resident_run_is_harmless(packed, box):
    """A resident spine was verified when loaded; later damage on disk cannot change the tokens."""
    eng = sluice.load(box, memory=MEM, progress=False)
    assert eng.spine is None
    first = eng.generate(PROMPT, max_new_tokens=N_NEW, ignore_eos=True).token_ids
    flip(box / "spine.bin", spine_offset(box, "model.layers.0.self_attn.q_proj.weight") + 5)
    assert eng.generate(PROMPT, max_new_tokens=N_NEW, ignore_eos=True).token_ids == first == packed[2]
    eng.close()


def _flip_every_record(box, layer: int, offset: int, mask: int = 0x40) -> None:
    bank = box / f"experts-L{layer:03d}.bin"
    rec = manifest(box)["experts"]["layers"][str(layer)]["record_bytes"]
    data = bytearray(bank.read_bytes())
    for e in range(len(data) // rec):
        data[e * rec + offset] ^= mask
    bank.write_bytes(bytes(data))


@pytest.mark.parametrize("byte", [3, 0], ids=["high_byte", "low_byte"])
def test_expert_flip_default_run(capsys, text_box, tmp_path, byte):
    """Default options (no flag): the payload CRC is checked, a flipped byte is an error naming it."""
    box = tmp_path / "t.sluice"
    shutil.copytree(text_box[0], box)
    _flip_every_record(box, 0, HEADER_BYTES + byte)  # the first gate weight's high / low byte (f32)
    rc, ids, err = run_json(capsys, box)
    assert rc == 1 and ids is None
    assert "experts-L000.bin: layer 0 expert" in err and "CRC mismatch" in err


def test_expert_flip_with_verify_reads_flag(capsys, text_box, tmp_path):
    box = tmp_path / "t.sluice"
    shutil.copytree(text_box[0], box)
    _flip_every_record(box, 2, HEADER_BYTES + 1000)
    rc, _, err = run_json(capsys, box, "--verify-reads")
    assert rc == 1 and "experts-L002.bin: layer 2 expert" in err and "CRC mismatch" in err


def test_no_verify_reads_flag_same_tokens(capsys, text_box):
    rc, ids, _ = run_json(capsys, text_box[0], "--no-verify-reads")
    assert rc == 0 and ids == text_box[1]
    rc, ids, _ = run_json(capsys, text_box[0])
    assert rc == 0 and ids == text_box[1]


def test_expert_flip_api_error_names_file_layer_expert(box):
    _flip_every_record(box, 2, HEADER_BYTES + 4 * 64 + 2, 0x80)
    with pytest.raises(sluice.ExpertReadError, match=r"experts-L002\.bin: layer 2 expert \d+: CRC mismatch"):
        tokens(box)


def test_expert_flip_during_run(packed, box):
    eng = sluice.load(box, memory=MEM, progress=False, cache_experts=4, prefetch=False)
    assert eng.options.verify_reads is True
    assert eng.generate(PROMPT, max_new_tokens=N_NEW, ignore_eos=True).token_ids == packed[2]
    _flip_every_record(box, 0, HEADER_BYTES + 17)
    with pytest.raises(sluice.ExpertReadError, match=r"experts-L000\.bin: layer 0 expert \d+: CRC mismatch"):
        eng.generate(PROMPT, max_new_tokens=N_NEW, ignore_eos=True)
    assert not eng.cache.loading()
    eng.close()


def test_flip_in_record_padding_is_harmless(packed, box):
    """Bytes after a record's payload are never used: the run goes on, same tokens."""
    rec = manifest(box)["experts"]["layers"]["0"]["record_bytes"]
    _flip_every_record(box, 0, rec - 1)
    assert tokens(box) == packed[2]


def test_flip_in_record_header(box):
    _flip_every_record(box, 0, 1)  # the magic
    with pytest.raises(sluice.ExpertReadError, match=r"layer 0 expert \d+: bad record magic"):
        tokens(box)


# -- containers: the manifest -------------------------------------------------------------------


@pytest.mark.parametrize("edit", [
    lambda m: m["spine"]["tensors"]["model.norm.weight"].update(dtype="BF16"),
    lambda m: m["spine"]["tensors"]["model.layers.0.self_attn.q_proj.weight"].update(offset=0),
    lambda m: m["config"].update(num_experts_per_tok=1),
    lambda m: m["experts"]["layers"]["0"]["parts"][1].update(offset=0),
], ids=["spine_dtype", "spine_offset", "num_experts_per_tok", "part_offset"])
def test_manifest_edit_is_caught(capsys, box, edit):
    m = manifest(box)
    edit(m)
    write_manifest(box, m)
    with pytest.raises(sluice.CheckpointError, match=r"manifest\.json: manifest checksum mismatch"):
        sluice.load(box, memory=MEM, progress=False)
    rc, _, err = cli(capsys, "check", box, "--no-progress")
    assert rc == 1 and "manifest checksum mismatch" in err


def test_manifest_truncated(box):
    raw = (box / "manifest.json").read_bytes()
    (box / "manifest.json").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(sluice.CheckpointError, match=r"manifest\.json: not valid JSON .*the container is damaged"):
        sluice.load(box, memory=MEM, progress=False)


def test_manifest_not_json(capsys, box):
    (box / "manifest.json").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    rc, _, err = cli(capsys, "check", box, "--no-progress")
    assert rc == 1 and "manifest.json: not valid JSON" in err


def test_manifest_checksum_not_a_string(box):
    m = manifest(box)
    m[CHECKSUM_KEY] = 12345
    write_manifest(box, m)
    with pytest.raises(sluice.CheckpointError, match="manifest checksum mismatch"):
        sluice.load(box, memory=MEM, progress=False)


def test_old_container_without_checksum_warns(packed, box, capsys):
    m = manifest(box)
    del m[CHECKSUM_KEY]
    write_manifest(box, m)
    with pytest.warns(UserWarning, match="manifest has no checksum.*convert the model again"):
        assert tokens(box) == packed[2]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = check_container(box, progress=False)
    assert report["ok"] and report["manifest_checksum"] is None


def test_sealed_edit_moving_tensor_out_of_its_group(box):
    """Even a re-sealed manifest cannot point a spine tensor at bytes no CRC covers."""
    m = manifest(box)
    m["spine"]["tensors"]["model.norm.weight"]["group"] = "layer.0"
    write_manifest(box, m, seal=True)
    with pytest.raises(sluice.CheckpointError, match="'model.norm.weight' .* lies outside its group 'layer.0'"):
        sluice.load(box, memory=MEM, progress=False)


def test_check_reports_spine_and_record_damage(capsys, box):
    flip(box / "spine.bin", spine_offset(box, "model.layers.0.self_attn.k_proj.weight") + 9)
    _flip_every_record(box, 2, HEADER_BYTES + 33)
    rc, out, _ = cli(capsys, "check", box, "--no-progress")
    assert rc == 1
    assert "BAD  " in out and "spine group 'layer.0' CRC mismatch" in out
    assert out.count("experts-L002.bin: layer 2 expert") == 8


@pytest.mark.parametrize("name,message", [
    ("spine.bin", r"spine\.bin: cannot open \(No such file"),
    ("experts-L002.bin", r"experts-L002\.bin: cannot open \(No such file"),
    ("manifest.json", r"config\.json not found"),
])
def test_container_file_missing(box, name, message):
    (box / name).unlink()
    with pytest.raises(sluice.CheckpointError, match=message):
        sluice.load(box, memory=MEM, progress=False)


def test_spine_truncated(box):
    spine = box / "spine.bin"
    spine.write_bytes(spine.read_bytes()[:-8192])
    with pytest.raises(sluice.CheckpointError,
                       match=r"spine\.bin: spine (tensor|group) .* (lies outside|outside the file)"):
        sluice.load(box, memory=MEM, progress=False)


def test_no_verify_reads_opts_out(box):
    """``verify_reads=False`` skips the payload CRC (the opt-out's documented cost: damage goes unseen)."""
    _flip_every_record(box, 0, HEADER_BYTES + 17, 0x01)
    with sluice.load(box, memory=MEM, progress=False, verify_reads=False) as eng:
        assert len(eng.generate(PROMPT, max_new_tokens=2, ignore_eos=True).token_ids) == 2
        assert eng.experts_source.crc_bytes == 0


def test_fast_crc_equals_zlib():
    """The CRC records are checked with is zlib's CRC-32 exactly (the C kernel only computes it faster)."""
    import os
    import random
    import zlib

    from sluice.storage.crc import crc32

    rng = random.Random(0)
    for n in [0, 1, 15, 16, 63, 64, 65, 255, 256, 257, 1000, 4096, 65_537, 1 << 20, (1 << 20) + 13]:
        data = os.urandom(n)
        start = rng.randrange(1 << 32)
        assert crc32(data, start) == zlib.crc32(data, start), n
        assert crc32(memoryview(bytearray(data)), start) == zlib.crc32(data, start), n
