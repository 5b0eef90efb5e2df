"""Bad checkpoints give clear errors naming the file and tensor."""

from __future__ import annotations

import json
import shutil
import struct

import pytest

import sluice
from sluice.checkpoint import Checkpoint


@pytest.fixture
def broken(model_dir, tmp_path):
    """A fresh copy of a tiny checkpoint to damage."""
    src = model_dir("qwen3_moe")
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def test_corrupt_header_length(broken):
    f = broken / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[:8] = struct.pack("<Q", 10**12)
    f.write_bytes(bytes(data))
    with pytest.raises(sluice.CheckpointError, match=r"model\.safetensors: safetensors header length .* impossible"):
        sluice.load(broken, memory="2GiB", progress=False)


def test_corrupt_header_json(broken):
    f = broken / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:12] = b"\xff\xfe{["
    f.write_bytes(bytes(data))
    with pytest.raises(sluice.CheckpointError, match="header is not valid JSON"):
        sluice.load(broken, memory="2GiB", progress=False)


def test_truncated_shard(broken):
    f = broken / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])
    with pytest.raises(sluice.CheckpointError,
                       match=r"tensor '.*' ends at byte \d+ but the file has only \d+ bytes: the file is truncated"):
        sluice.load(broken, memory="2GiB", progress=False)


def test_unknown_dtype(broken):
    f = broken / "model.safetensors"
    data = f.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    name = next(k for k in header if k.endswith("q_proj.weight"))
    header[name]["dtype"] = "Q7"
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (n - len(raw))
    assert len(raw) == n
    f.write_bytes(data[:8] + raw + data[8 + n :])
    with pytest.raises(sluice.CheckpointError, match=rf"tensor '{name}' has unsupported dtype 'Q7'"):
        sluice.load(broken, memory="2GiB", progress=False)


def test_missing_config_key(broken):
    cfg = json.loads((broken / "config.json").read_text())
    del cfg["hidden_size"]
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(sluice.CheckpointError, match=r"config\.json: missing required key 'hidden_size'"):
        sluice.load(broken, memory="2GiB", progress=False)


def test_shape_contradicts_config(broken):
    cfg = json.loads((broken / "config.json").read_text())
    cfg["moe_intermediate_size"] = 48
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(sluice.CheckpointError,
                       match=r"mlp\.experts\.0\.gate_proj\.weight' has shape \[32, 64\] "
                             r"but config\.json implies \[48, 64\]"):
        sluice.load(broken, memory="2GiB", progress=False)


def test_missing_tensor(broken, tmp_path):
    from safetensors.torch import load_file, save_file

    f = broken / "model.safetensors"
    tensors = load_file(f)
    del tensors["model.layers.0.self_attn.k_norm.weight"]
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(sluice.CheckpointError,
                       match=r"tensor 'model\.layers\.0\.self_attn\.k_norm\.weight' is missing"):
        sluice.load(broken, memory="2GiB", progress=False)


def test_missing_config(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(sluice.CheckpointError, match=r"config\.json not found"):
        sluice.load(tmp_path / "m", memory="2GiB")


def test_unsupported_family(broken):
    cfg = json.loads((broken / "config.json").read_text())
    cfg["model_type"] = "llama"
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(sluice.UnsupportedModelError,
                       match=r"model_type 'llama' is not supported \(supported: .*qwen3_moe"):
        sluice.load(broken, memory="2GiB")


def test_sharded_checkpoint_matches_single(model_dir, tmp_path):
    """A checkpoint split into shards with an index reads the same tensors."""
    from transformers import AutoModelForCausalLM

    src = model_dir("mixtral")
    model = AutoModelForCausalLM.from_pretrained(src)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    ck1, ck2 = Checkpoint(src), Checkpoint(tmp_path / "sharded")
    assert set(ck1.tensors) == set(ck2.tensors)
    for name in ck1.tensors:
        assert ck1.read(name).equal(ck2.read(name)), name
    a = sluice.load(src, memory="2GiB", progress=False).generate([5, 6, 7], max_new_tokens=8).token_ids
    b = sluice.load(tmp_path / "sharded", memory="2GiB", progress=False).generate([5, 6, 7], max_new_tokens=8).token_ids
    assert a == b
