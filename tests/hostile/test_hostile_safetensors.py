"""Hostile safetensors files: every header the reference ``safetensors`` library refuses is
refused here too, with an error naming the file and the problem, before anything is loaded
(the rest of the hostile-file corpus: test_hostile_files.py)."""

from __future__ import annotations

import json
import struct

import pytest

import sluice
from test_hostile_files import MEM, cli, hf, packed, tokens  # noqa: F401  (fixtures)


def rewrite_header(path, edit) -> None:
    """Rewrite a safetensors file's header through ``edit(header) -> header`` (data kept)."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = edit(json.loads(data[8 : 8 + n]))
    raw = header if isinstance(header, bytes) else json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])


def _entries(h: dict) -> list[str]:
    """Tensor names in data order."""
    return sorted((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])


def _overlap(h):
    a, b = _entries(h)[:2]
    n = h[b]["data_offsets"][1] - h[b]["data_offsets"][0]
    h[b]["data_offsets"] = [h[a]["data_offsets"][0], h[a]["data_offsets"][0] + n]
    return h


def _gap(h):
    last = _entries(h)[-1]
    del h[last]
    return h


def _swap_order(h):
    a = _entries(h)[3]
    h[a]["data_offsets"] = h[a]["data_offsets"][::-1]
    return h


def _out_of_bounds(h):
    last = _entries(h)[-1]
    b, e = h[last]["data_offsets"]
    h[last]["data_offsets"] = [b + 4096, e + 4096]
    return h


def _deep(h):
    h["__metadata__"] = {"format": "pt"}
    return json.dumps(h, separators=(",", ":")).encode()[:-1] + b',"x":' + b"[" * 5000 + b"]" * 5000 + b"}"


def _dtype(h):
    h[_entries(h)[2]]["dtype"] = "float32"
    return h


def _duplicate(h):
    raw = json.dumps(h, separators=(",", ":")).encode()
    name = _entries(h)[0]
    entry = json.dumps({name: h[name]}, separators=(",", ":")).encode()[1:-1]
    return raw[:-1] + b"," + entry + b"}"


def _bool_shape(h):
    h[_entries(h)[0]]["shape"] = [True, 64]
    return h


def _list_header(h):
    return json.dumps([h]).encode()


def _metadata_object(h):
    h["__metadata__"] = {"format": {"nested": "x"}}
    return h


@pytest.mark.parametrize("edit,message", [
    (_overlap, r"overlaps tensor"),
    (_gap, r"(leaving a gap|the tensors end at data byte \d+ but the data region holds)"),
    (_swap_order, r"data_offsets \[\d+, \d+\] out of order"),
    (_out_of_bounds, r"ends at byte \d+ but the file has only \d+ bytes"),
    (_deep, r"nests JSON 5001 levels deep; the format needs 3"),
    (_dtype, r"unsupported dtype 'float32'"),
    (_duplicate, r"safetensors header names '.*' twice"),
    (_bool_shape, r"malformed shape \[true, 64\]|malformed shape \[True, 64\]"),
    (_list_header, r"not valid JSON \(it does not start with '\{'\)"),
    (_metadata_object, r"__metadata__ must map names to strings"),
], ids=["overlap", "gap", "out_of_order", "out_of_bounds", "deep_nesting", "dtype_string", "duplicate_name",
        "bool_shape", "list_header", "metadata_object"])
def test_safetensors_header(capsys, hf, edit, message):
    rewrite_header(hf / "model.safetensors", edit)
    with pytest.raises(sluice.CheckpointError, match=r"model\.safetensors: .*" + message):
        sluice.load(hf, memory=MEM, progress=False)
    rc, _, err = cli(capsys, "inspect", hf)
    assert rc == 1 and "model.safetensors" in err


def test_safetensors_gap_between_tensors(hf):
    """A hole in the middle (the last tensor's bytes still end the file)."""
    def edit(h):
        names = _entries(h)
        shift = 64
        for k in names[1:]:
            b, e = h[k]["data_offsets"]
            h[k]["data_offsets"] = [b + shift, e + shift]
        return h

    f = hf / "model.safetensors"
    rewrite_header(f, edit)
    f.write_bytes(f.read_bytes() + b"\0" * 64)
    with pytest.raises(sluice.CheckpointError, match="leaving a gap after byte"):
        sluice.load(hf, memory=MEM, progress=False)


def test_safetensors_trailing_bytes(hf):
    f = hf / "model.safetensors"
    f.write_bytes(f.read_bytes() + b"junk")
    with pytest.raises(sluice.CheckpointError, match="corrupt or was appended to"):
        sluice.load(hf, memory=MEM, progress=False)


def test_safetensors_truncated_inside_header(hf):
    f = hf / "model.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(sluice.CheckpointError, match=r"header length \d+ is impossible for a file of 100 bytes"):
        sluice.load(hf, memory=MEM, progress=False)


def test_safetensors_empty_file(hf):
    (hf / "model.safetensors").write_bytes(b"")
    with pytest.raises(sluice.CheckpointError, match="file is 0 bytes, too short to be safetensors"):
        sluice.load(hf, memory=MEM, progress=False)


def test_safetensors_huge_header_refused_before_reading(hf):
    """A header length over 100 MB (the reference's limit) is refused before a byte of it is read,
    even where the file really is that large (sparse here)."""
    from sluice.storage import ReadStats
    from sluice.checkpoint import read_safetensors_header
    from sluice.storage import LocalFile

    f = hf / "model.safetensors"
    hlen = 100_000_001
    with open(f, "wb") as out:
        out.write(struct.pack("<Q", hlen) + b"{")
        out.truncate(8 + hlen + 1024)
    stats = ReadStats()
    reader = LocalFile(str(f), direct=False, stats=stats)
    with pytest.raises(sluice.CheckpointError, match="header length 100000001 is impossible: headers are at most "
                                                     "100000000 bytes"):
        read_safetensors_header(f, reader)
    assert stats.bytes_read == 8
    with pytest.raises(sluice.CheckpointError, match="headers are at most 100000000 bytes"):
        sluice.load(hf, memory=MEM, progress=False)


def test_spine_tensor_stored_as_int32(capsys, hf):
    from safetensors.torch import load_file, save_file

    f = hf / "model.safetensors"
    t = load_file(f)
    name = "model.layers.0.self_attn.q_proj.weight"
    t[name] = t[name].to(dtype=__import__("torch").int32)
    save_file(t, f, metadata={"format": "pt"})
    with pytest.raises(sluice.CheckpointError, match=rf"spine tensor '{name}' is stored as I32"):
        sluice.load(hf, memory=MEM, progress=False)
    rc, _, err = cli(capsys, "convert", hf, hf.parent / "out.sluice", "--no-progress")
    assert rc == 1 and "is stored as I32" in err and not (hf.parent / "out.sluice").exists()


def test_missing_safetensors(hf):
    (hf / "model.safetensors").unlink()
    with pytest.raises(sluice.CheckpointError, match="no model.safetensors or model.safetensors.index.json"):
        sluice.load(hf, memory=MEM, progress=False)


def test_clean_files_load_with_the_reference_library(packed):
    """The checks refuse nothing the reference accepts: the fixture and its container run as before."""
    from safetensors import safe_open

    hf, box, clean = packed
    with safe_open(hf / "model.safetensors", "pt") as f:
        assert len(list(f.keys())) > 0
    assert tokens(hf) == clean


