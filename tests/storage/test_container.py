"""The packed container and the I/O pipeline: bit-identity, corruption, faults, atomic convert."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

import sluice
from conftest import FAMILIES, prompt_ids
from sluice.check import check_container
from sluice.container import HEADER_BYTES, seal_manifest
from sluice.convert import convert
from sluice.storage.faults import FaultPlan, inject_faults


@pytest.fixture(scope="module")
def packed(model_dir, tmp_path_factory):
    """family -> (hf dir, container dir)"""
    root = tmp_path_factory.mktemp("containers")
    return {f: (model_dir(f), convert(model_dir(f), root / f"{f}.sluice", progress=False)) for f in FAMILIES}


def _run(path, ids, n=12, **opts):
    opts.setdefault("progress", False)
    eng = sluice.load(path, memory="2GiB", **opts)
    return eng.forward(ids), eng.generate(ids.tolist(), max_new_tokens=n).token_ids, eng


@pytest.mark.parametrize("family", FAMILIES)
def test_container_bit_identical_to_hf(packed, family):
    hf, box = packed[family]
    ids = prompt_ids()
    a_logits, a_tokens, _ = _run(hf, ids, cache_experts=4)
    b_logits, b_tokens, eng = _run(box, ids, cache_experts=4)
    assert torch.equal(a_logits, b_logits)
    assert a_tokens == b_tokens
    assert eng.info.is_container


def test_scheduling_never_changes_results(packed):
    """Cache size, prefetch, reader threads and O_DIRECT vs buffered: identical bits."""
    hf, box = packed["mixtral"]
    ids = prompt_ids(seed=5)
    base_logits, base_tokens, _ = _run(box, ids, cache_experts=2, prefetch=False, reader_threads=1)
    variants = [
        dict(cache_experts=24, prefetch=False, reader_threads=1),
        dict(cache_experts=2, prefetch=True, reader_threads=1),
        dict(cache_experts=3, prefetch=True, reader_threads=4),
        dict(cache_experts=2, prefetch=False, reader_threads=4, direct_io=False),
        dict(cache_experts=5, prefetch=True, reader_threads=4, cache_policy="lru"),
        dict(cache_experts=3, prefetch=True, reader_threads=4, cache_policy="ulfru"),
    ]
    for v in variants:
        logits, tokens, eng = _run(box, ids, **v)
        assert torch.equal(logits, base_logits), v
        assert tokens == base_tokens, v
        if v.get("direct_io") is False:
            assert eng.last_stats["direct_io"] is False
    logits, tokens, _ = _run(hf, ids, cache_experts=24, prefetch=True, reader_threads=4)
    assert torch.equal(logits, base_logits) and tokens == base_tokens


def test_direct_io_probe_reports(packed):
    _, box = packed["olmoe"]
    _, _, eng = _run(box, prompt_ids(), n=2)
    assert eng.last_stats["direct_io"] in (True, False)  # probed; buffered fallback if the fs refuses
    _, _, eng = _run(box, prompt_ids(), n=2, direct_io=False)
    assert eng.last_stats["direct_io"] is False


def test_lookahead_prefetch_counts(packed):
    _, box = packed["qwen3_moe"]
    # a cache with room beyond the working set: predictions fill free slots (at the working
    # set every slot holds an expert worth more than a guess, and prefetching stops)
    # (a one-token prompt: the experts decoding needs are not already read by a prefill)
    r = sluice.load(box, memory="2GiB", progress=False).generate(prompt_ids().tolist()[:1], max_new_tokens=16)
    s = r.stats
    assert s["prefetch_reads"] > 0 and 0 < s["lookahead_recall"] <= 1
    assert s["prefetch_used"] <= s["prefetch_reads"]


def _copy(box, tmp_path):
    dst = tmp_path / "copy.sluice"
    shutil.copytree(box, dst)
    return dst


def test_truncated_bank(packed, tmp_path):
    box = _copy(packed["qwen3_moe"][1], tmp_path)
    bank = box / "experts-L002.bin"
    bank.write_bytes(bank.read_bytes()[:-5000])
    with pytest.raises(sluice.CheckpointError, match=r"experts-L002\.bin: expert bank is \d+ bytes.*truncated"):
        sluice.load(box, memory="2GiB", progress=False)


def test_flipped_payload_byte(packed, tmp_path):
    box = _copy(packed["olmoe"][1], tmp_path)
    bank = box / "experts-L001.bin"
    data = bytearray(bank.read_bytes())
    rec = json.loads((box / "manifest.json").read_text())["experts"]["layers"]["1"]["record_bytes"]
    data[3 * rec + HEADER_BYTES + 100] ^= 0x40  # expert 3 of layer 1
    bank.write_bytes(bytes(data))
    report = check_container(box, progress=False)
    assert not report["ok"] and len(report["errors"]) == 1
    assert "experts-L001.bin: layer 1 expert 3: CRC mismatch" in report["errors"][0]
    out = subprocess.run([sys.executable, "-m", "sluice.cli", "check", str(box), "--no-progress"],
                         capture_output=True, text=True)
    assert out.returncode == 1 and "CRC mismatch" in out.stdout
    eng = sluice.load(box, memory="2GiB", cache_experts=24, verify_reads=True, progress=False)
    with pytest.raises(sluice.ExpertReadError, match=r"experts-L001\.bin: layer 1 expert 3: CRC mismatch"):
        for _ in range(4):  # routing reaches expert 3 of layer 1 within a few prompts
            for seed in range(8):
                eng.generate(prompt_ids(seed=seed).tolist(), max_new_tokens=8)
    assert (1, 3) not in eng.cache  # nothing cached from the failed read


def test_misplaced_record_header(packed, tmp_path):
    box = _copy(packed["mixtral"][1], tmp_path)
    bank = box / "experts-L000.bin"
    data = bytearray(bank.read_bytes())
    rec = len(data) // 8
    data[0:4] = b"JUNK"  # expert 0's magic
    data[rec + 12] ^= 0x01  # expert 1 claims another expert id
    bank.write_bytes(bytes(data))
    report = check_container(box, progress=False)
    assert any("layer 0 expert 0: bad record magic" in e for e in report["errors"])
    assert any("layer 0 expert 1: record header says layer 0 expert 0" in e for e in report["errors"])


@pytest.mark.parametrize("edit,message", [
    (lambda m: m.update(version=99), "container version 99 is not supported"),
    (lambda m: m["experts"]["layers"]["0"].update(record_bytes=1000), "record_bytes 1000 is not a positive multiple"),
    (lambda m: m["experts"]["layers"]["0"].update(count=3), "layer 0 bank holds 3 experts"),
    (lambda m: m["spine"]["tensors"]["model.norm.weight"].update(offset=10**9), "lies outside the"),
    (lambda m: m["experts"]["layers"]["1"].update(file="../../etc/passwd"), "invalid file name"),
    (lambda m: m["experts"]["layers"]["0"]["parts"][0].update(shape=[7, 7]), "part 'gate' has shape [7, 7]"),
])
def test_edited_manifest(packed, tmp_path, edit, message):
    """Edits with the checksum recomputed (what the checksum cannot catch) still fail the checks behind it."""
    box = _copy(packed["mixtral"][1], tmp_path)
    m = json.loads((box / "manifest.json").read_text())
    edit(m)
    (box / "manifest.json").write_text(json.dumps(seal_manifest(m)))
    with pytest.raises(sluice.CheckpointError, match=message.replace("[", r"\[").replace("]", r"\]")):
        sluice.load(box, memory="2GiB", progress=False)


def test_broken_manifest_json(packed, tmp_path):
    box = _copy(packed["mixtral"][1], tmp_path)
    (box / "manifest.json").write_text("{not json")
    with pytest.raises(sluice.CheckpointError, match="manifest.json: not valid JSON"):
        sluice.load(box, memory="2GiB", progress=False)


@pytest.mark.parametrize("kind", ["fail", "short"])
def test_read_fault_is_clear_and_recoverable(packed, kind):
    hf, box = packed["qwen3_moe"]
    ids = prompt_ids()
    expected = sluice.load(box, memory="2GiB", cache_experts=4, progress=False).generate(
        ids.tolist(), max_new_tokens=12).token_ids
    eng = sluice.load(box, memory="2GiB", cache_experts=4, prefetch=False, progress=False)
    plan = FaultPlan(**({"fail_at": 5} if kind == "fail" else {"short_at": 5}), path_filter="experts-")
    inject_faults(eng.checkpoint, plan)
    msg = (r"experts-L\d{3}\.bin: (reading layer \d+ expert \d+ failed: .*injected I/O error"
           r"|short read for layer \d+ expert \d+)")
    with pytest.raises(sluice.ExpertReadError, match=msg):
        eng.generate(ids.tolist(), max_new_tokens=12)
    assert plan.injected == 1
    assert not eng.cache.loading()  # nothing left in flight, nothing cached from the failed read
    assert eng.generate(ids.tolist(), max_new_tokens=12).token_ids == expected  # serves the next request


def test_convert_is_atomic_and_rerunnable(model_dir, tmp_path, monkeypatch):
    import sluice.convert as conv

    src = model_dir("olmoe")
    dst = tmp_path / "m.sluice"
    calls = {"n": 0}
    real = conv.encode_parts

    def boom(*a, **k):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt("simulated interruption")
        return real(*a, **k)

    monkeypatch.setattr(conv, "encode_parts", boom)
    with pytest.raises(KeyboardInterrupt):
        convert(src, dst, progress=False)
    assert not dst.exists()  # no half-container that loads
    with pytest.raises(sluice.CheckpointError):
        sluice.load(dst, memory="2GiB")
    monkeypatch.setattr(conv, "encode_parts", real)
    convert(src, dst, progress=False)
    convert(src, dst, progress=False, force=True)  # rerun with force replaces it
    assert check_container(dst, progress=False)["ok"]
    assert not (tmp_path / "m.sluice.partial").exists()


def test_convert_dtype_cast(model_dir, tmp_path):
    """--experts bf16 on an fp32 checkpoint casts the experts; results then match a bf16-expert model."""
    src = model_dir("mixtral")
    box = convert(src, tmp_path / "b.sluice", experts="bf16", progress=False)
    eng = sluice.load(box, memory="2GiB", progress=False)
    assert eng.experts_source.format == "bf16"
    assert eng.info.experts.record_bytes < sluice.load(src, memory="2GiB", progress=False).info.experts.record_bytes
    assert len(eng.generate([5, 6, 7], max_new_tokens=4).token_ids) == 4


def test_convert_peak_memory_is_small(big_model, tmp_path):
    path, size = big_model
    script = ("import sys; from sluice.convert import convert; from sluice.sysmem import peak_rss; "
              "convert(sys.argv[1], sys.argv[2], progress=False); print(peak_rss())")
    out = subprocess.run([sys.executable, "-c", script, str(path), str(tmp_path / "big.sluice")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    peak = int(out.stdout.strip().splitlines()[-1])
    assert peak < 450 << 20, f"convert peak RSS {peak / 2**20:.0f} MiB for a {size / 1e9:.1f} GB model"


def test_spine_groups_read_in_pieces(packed, monkeypatch):
    """A spine group longer than the source's read size is read in several pieces (the 65 MB
    embedding of a 6 GB model was the first to hit it: a loop variable overwrote the alignment)."""
    from sluice.storage.file import LocalFile

    hf, box = packed["qwen3_moe"]
    ids = prompt_ids()
    want = _run(box, ids, n=2)[0]
    monkeypatch.setattr(LocalFile, "read_size", 4096)
    assert torch.equal(_run(box, ids, n=2)[0], want)
