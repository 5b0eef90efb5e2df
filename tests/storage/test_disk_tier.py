"""The local disk tier (``--disk-cache``): memory -> disk tier -> remote store.

Real servers on loopback (``tests/remote_servers.py``), real checkpoints and containers, real
processes sharing one tier directory: a warm tier gives the local run's logits bit for bit
and fetches nothing remote; the size bound holds; a corrupt entry is dropped and refetched;
a killed writer leaves nothing a reader sees; ``sluice cache list|clear`` never touches a
file the tier did not make.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import sluice
from conftest import prompt_ids
from sluice.storage import meta_cache
from sluice.storage.disk_tier import ENTRY_RE, HEADER_BYTES, MARKER, DiskTier, DiskTierError, Key
from sluice.storage.meta_cache import MetaCache
from sluice.storage.tiered import TieredSource

pytest.importorskip("obstore")

N_NEW = 5
CACHE = 4  # a small memory cache: experts are read again and again
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def published(remote_servers, family_models):
    """{name: (local path, URLs)}: a qwen3_moe container and Hugging Face directory on both servers."""
    out = {"container": family_models.container("qwen3_moe"), "hf": family_models.hf("qwen3_moe")}
    return {k: (p, remote_servers.publish(f"dt-{k}", p)) for k, p in out.items()}


@pytest.fixture
def s3_env(remote_servers, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", remote_servers.s3.endpoint)


def _run(location, **options):
    """(logits, tokens, the engine's storage stats after load and generation)."""
    eng = sluice.load(str(location), memory="4GiB", cache_experts=CACHE, progress=False, **options)
    try:
        ids = prompt_ids(12)
        logits = eng.forward(ids)
        result = eng.generate(ids.tolist(), max_new_tokens=N_NEW, ignore_eos=True)
        io = eng.checkpoint.stats
        return logits, result.token_ids, (io.remote_bytes, io.tier_hits, io.tier_misses, io.tier_bytes), result.stats
    finally:
        eng.close()


def _entries(tier_dir: Path) -> list[Path]:
    return sorted(p for p in (tier_dir / "entries").rglob("*") if ENTRY_RE.match(p.name))


@pytest.mark.parametrize("model,server", [("container", "http"), ("hf", "s3")])
def test_cold_then_warm_tier_is_bit_identical_and_fetches_nothing(published, s3_env, tmp_path, model, server):
    path, urls = published[model]
    local_logits, local_tokens, _, _ = _run(path)
    tier = tmp_path / "tier"
    opts = {"disk_cache": "64MiB", "disk_cache_dir": str(tier)}
    logits, tokens, (remote, hits, misses, _), _ = _run(urls[server], **opts)
    assert torch.equal(logits, local_logits) and tokens == local_tokens
    assert remote > 0 and misses > 0 and _entries(tier)
    cold_remote = remote
    logits, tokens, (remote, hits, misses, tier_bytes), stats = _run(urls[server], **opts)
    assert torch.equal(logits, local_logits) and tokens == local_tokens
    # warm: every range (expert records, spine, safetensors headers) came from the tier
    assert remote == 0 and misses == 0 and hits > 0 and tier_bytes >= cold_remote
    assert stats["remote_bytes_read"] == 0 and stats["disk_tier_hits"] > 0
    assert stats["disk_tier_bytes_read"] == stats["bytes_read"] > 0


def test_size_bound_and_frequency_aware_eviction(published, remote_servers, tmp_path):
    """With room for a few records, the tier stays under its size while the model runs exactly; the
    entry used most survives a stream of entries used once."""
    path, urls = published["container"]
    _, local_tokens, _, _ = _run(path)
    bank = next(n for n in os.listdir(path) if n.startswith("experts"))
    record = os.path.getsize(path / bank) // 8  # qwen3_moe's tiny model: 8 experts per bank
    cap = 3 * (HEADER_BYTES + record) + 100
    tier = tmp_path / "tier"
    _, tokens, _, _ = _run(urls["http"], disk_cache=cap, disk_cache_dir=str(tier))
    assert tokens == local_tokens
    assert sum(p.stat().st_size for p in _entries(tier)) <= cap
    t = DiskTier(tier, cap)
    try:
        assert t.usage()["bytes"] <= cap and t.counts["evicted"] == 0
        t.clear()
        src = sluice.storage.open_source(f"{urls['http']}/{bank}", disk_tier=t)
        buf = bytearray(record)
        for _ in range(5):  # record 0 is hot
            src.read_into(memoryview(buf), 0)
        for e in range(1, 8):  # seven records used once each, through a tier of three
            src.read_into(memoryview(buf), e * record)
        names = {p.name[:40] for p in _entries(tier)}
        assert Key(src.name, src.version, 0, record).name in names and len(names) == 3
        assert t.counts["evicted"] >= 5 and t.usage()["bytes"] <= cap
        with open(path / bank, "rb") as f:
            f.seek(7 * record)
            assert bytes(buf) == f.read(record)
    finally:
        t.close()


def test_corrupt_entry_is_detected_dropped_and_refetched(published, tmp_path):
    path, urls = published["container"]
    local_logits, local_tokens, _, _ = _run(path)
    tier = tmp_path / "tier"
    opts = {"disk_cache": "64MiB", "disk_cache_dir": str(tier)}
    _run(urls["http"], **opts)
    entries = _entries(tier)
    big = max(entries, key=lambda p: p.stat().st_size)  # an expert record or a spine group
    header = min(entries, key=lambda p: p.stat().st_size)
    for p, at in ((big, HEADER_BYTES + 1234), (header, 30)):  # a payload bit, a header byte
        raw = bytearray(p.read_bytes())
        raw[at] ^= 0x10
        p.write_bytes(bytes(raw))
    with pytest.warns(UserWarning, match="is corrupt; dropped it"):
        logits, tokens, (remote, hits, misses, _), _ = _run(urls["http"], **opts)
    assert torch.equal(logits, local_logits) and tokens == local_tokens
    assert misses == 2 and 0 < remote and hits > 0
    # the refetched ranges are entries again, intact
    _, tokens, (remote, _, misses, _), _ = _run(urls["http"], **opts)
    assert tokens == local_tokens and remote == 0 and misses == 0


_WRITER = """
import os, sys
sys.path.insert(0, {src!r})
from sluice.storage.disk_tier import DiskTier, Key
t = DiskTier({tier!r}, 1 << 30)
data = memoryview(os.urandom(8 << 20))
i = 0
while True:
    t.put(Key("s3://b/killed/obj", "v", i * len(data), len(data)), data, "s3://b/killed")
    i += 1
"""


def test_a_killed_writer_leaves_no_entry_a_reader_sees(tmp_path):
    """SIGKILL a process while it writes entries: its temporary file is never a hit, the next tier to
    open removes it, and every published entry is whole."""
    tier = tmp_path / "tier"
    DiskTier(tier, 1 << 30).close()
    proc = subprocess.Popen([sys.executable, "-c", _WRITER.format(src=str(ROOT / "src"), tier=str(tier))])
    try:
        deadline = time.monotonic() + 30
        while not list((tier / "tmp").glob("*.tmp")) and time.monotonic() < deadline:
            time.sleep(0.001)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    left = list((tier / "tmp").glob("*.tmp"))
    # one by hand too, as a writer on another machine sharing the directory leaves it (over an hour old)
    stale = tier / "tmp" / f"{'ab' * 20}.999999999.0badf00d.tmp"
    stale.write_bytes(b"partial")
    old = time.time() - 7200
    os.utime(stale, (old, old))
    assert left or _entries(tier)  # it was killed mid-write (or between writes)
    t = DiskTier(tier, 1 << 30)
    try:
        assert not list((tier / "tmp").glob("*.tmp"))
        n = len(_entries(tier))
        assert t.usage()["entries"] == n
        for i in range(n + 1):  # every published entry reads back whole; the one being written is a miss
            buf = bytearray(8 << 20)
            hit = t.get(Key("s3://b/killed/obj", "v", i * len(buf), len(buf)), memoryview(buf))
            assert hit == (i < n)
        assert t.counts["corrupt"] == 0
    finally:
        t.close()


_SHARER = """
import os, random, sys, zlib
sys.path.insert(0, {src!r})
from sluice.storage import open_source
from sluice.storage.disk_tier import DiskTier
t = DiskTier({tier!r}, {cap})
src = open_source({url!r}, disk_tier=t)
data = open({local!r}, "rb").read()
rng = random.Random({seed})
for _ in range(120):
    n = rng.choice([4096, 20000, 65536])
    off = rng.randrange(0, 16) * 4096
    buf = bytearray(n)
    src.read_into(memoryview(buf), off)
    assert bytes(buf) == data[off:off + n], (off, n)
t.close()
print("ok", src.stats.tier_hits, src.stats.tier_misses)
"""


def test_two_processes_share_one_tier(published, tmp_path):
    """Two processes read overlapping ranges through one small tier at once (inserts, hits and
    evictions racing): every byte they get is right, and the tier stays within its bound, the
    directory's as a whole: this process holds the tier open with a third of their size, and
    they keep to it."""
    path, urls = published["container"]
    bank = next(n for n in os.listdir(path) if n.startswith("experts"))
    tier = tmp_path / "tier"
    cap = 12 * (HEADER_BYTES + 65536)
    small = DiskTier(tier, cap // 3)
    try:
        procs = [subprocess.Popen([sys.executable, "-c", _SHARER.format(
            src=str(ROOT / "src"), tier=str(tier), cap=cap, url=f"{urls['http']}/{bank}", local=str(path / bank),
            seed=seed)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for seed in (1, 2)]
        outs = [p.communicate(timeout=120) for p in procs]
        for p, (out, err) in zip(procs, outs):
            assert p.returncode == 0 and out.startswith("ok"), err
        assert sum(int(o.split()[1]) for o, _ in outs) > 0  # the tier served reads
        assert 0 < small.usage()["bytes"] <= cap // 3 and small.usage()["entries"] == len(_entries(tier))
    finally:
        small.close()
    assert list((tier / "openers").iterdir()) == []  # every opener closed: none holds a bound


def test_the_bound_is_the_smallest_open_size_and_a_dead_opener_holds_none(tmp_path):
    from sluice.storage import LocalFile

    blob = tmp_path / "blob.bin"
    blob.write_bytes(os.urandom(40 * 4096))
    entry = HEADER_BYTES + 4096
    big = DiskTier(tmp_path / "tier", 20 * entry)
    try:
        src = TieredSource(LocalFile(str(blob)), big, "m")
        for i in range(10):
            src.pread(4096, i * 4096)
        assert big.usage()["entries"] == 10
        # a dead process's record (its lock is free) is no bound, and is removed; a directory or a link
        # under a record's name, or garbage, bounds nothing and is left alone
        openers = tmp_path / "tier" / "openers"
        (openers / "999999.0badc0de").write_text(f"{entry}\n")
        (openers / "999998.0badc0de").mkdir()
        (openers / "999997.0badc0de").symlink_to(openers / "999999.0badc0de")
        (openers / "not-a-record").write_text("1\n")
        assert big.bound() == 20 * entry and not (openers / "999999.0badc0de").exists()
        assert (openers / "999998.0badc0de").is_dir() and (openers / "not-a-record").exists()
        small = DiskTier(tmp_path / "tier", 4 * entry)  # another opener: evicts down to its size at open
        assert big.usage()["entries"] == 4 and big.bound() == small.bound() == 4 * entry
        for i in range(10, 20):  # the bigger opener keeps to the smaller size while it is open
            src.pread(4096, i * 4096)
            assert big.usage()["bytes"] <= 4 * entry
        small.close()
        for i in range(20, 30):
            src.pread(4096, i * 4096)
        assert big.usage()["entries"] == 14  # its own size again
    finally:
        big.close()


def test_cache_list_and_clear_via_the_cli(text_model, remote_servers, tmp_path, monkeypatch, capsys):
    from sluice.cli import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    urls = remote_servers.publish("dt-text", text_model)
    tier = tmp_path / "tier"
    args = ["--prompt", "x", "--max-new-tokens", "2", "--ignore-eos", "--json", "--no-progress", "--memory", "4GiB",
            "--cache-experts", str(CACHE), "--disk-cache", "64MiB", "--disk-cache-dir", str(tier)]
    assert main(["run", urls["http"], *args]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stats"]["disk_tier_misses"] > 0
    assert main(["run", urls["http"], *[a for a in args if a != "--json"]]) == 0
    assert "| disk tier " in capsys.readouterr().err  # the stats line: warm, hits from the tier
    assert main(["inspect", urls["http"], "--json", "--disk-cache", "64MiB", "--disk-cache-dir", str(tier)]) == 0
    report = json.loads(capsys.readouterr().out)["disk_tier"]
    assert report["model"]["entries"] > 0 and report["opening"]["misses"] == 0 and report["opening"]["hits"] > 0
    # `sluice run` and `sluice bench` close their engine: in this test's process no run holds the tier
    # open any more, nor does one whose budget is refused after the tier was opened
    assert main(["run", urls["http"], *["1MiB" if a == "4GiB" else a for a in args]]) == 1
    assert "memory" in capsys.readouterr().err
    assert main(["bench", "spec", urls["http"], "--tokens", "2", "--json", *args[args.index("--memory"):]]) == 0
    assert json.loads(capsys.readouterr().out)["identical"]
    assert main(["cache", "list", "--disk-cache-dir", str(tier), "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert (listing["open_by"], listing["bound"]) == (0, None)
    assert not list((tier / "openers").iterdir())
    # the metadata cache (config, tokenizer files: read whole, kept outside the tier) is listed too
    meta = listing["meta"]
    assert meta["dir"] == str(tmp_path / "cache" / "sluice" / "meta") and meta["files"] > 0 and meta["bytes"] > 0
    other = tmp_path / "obj.bin"
    other.write_bytes(os.urandom(10000))
    t = DiskTier(tier, 1 << 30)
    src = TieredSource(sluice.storage.LocalFile(str(other)), t, "https://elsewhere/other-model")
    src.pread(5000, 100)
    MetaCache().put("https://elsewhere/other-model/config.json", '"e1"', b"{}")
    assert main(["cache", "list", "--disk-cache-dir", str(tier), "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert (listing["open_by"], listing["bound"]) == (1, 1 << 30)
    assert listing["meta"]["files"] == meta["files"] + 1
    t.close()
    assert main(["cache", "list", "--disk-cache-dir", str(tier), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["open_by"] == 0
    models = {m["model"]: m for m in listing["models"]}
    assert set(models) == {urls["http"], "https://elsewhere/other-model"}
    assert listing["bytes"] == sum(m["bytes"] for m in models.values()) > 0
    assert main(["cache", "list", "--disk-cache-dir", str(tier)]) == 0
    text = capsys.readouterr().out
    assert urls["http"] in text and "entries" in text
    assert f"metadata cache {meta['dir']}: {meta['files'] + 1} files" in text
    # files the tier did not make survive a clear, wherever they are in its directory
    foreign = [tier / "notes.txt", tier / "entries" / "ab" / "mine.txt", tier / "tmp" / "keep.tmp"]
    for f in foreign:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("user data")
    assert main(["cache", "clear", urls["http"], "--disk-cache-dir", str(tier), "--json"]) == 0
    cleared = json.loads(capsys.readouterr().out)
    assert cleared["removed"]["entries"] > 0 and cleared["meta"]["removed"]["files"] == meta["files"]
    assert main(["cache", "list", "--disk-cache-dir", str(tier), "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert [m["model"] for m in listing["models"]] == ["https://elsewhere/other-model"]
    assert [c.url for c in meta_cache.survey().copies] == ["https://elsewhere/other-model/config.json"]
    assert main(["cache", "clear", "--disk-cache-dir", str(tier)]) == 0
    assert "removed 1 files" in capsys.readouterr().out
    assert not _entries(tier) and all(f.read_text() == "user data" for f in foreign)
    assert not meta_cache.survey().copies
    assert main(["cache", "clear", "nope://x", "--disk-cache-dir", str(tier)]) == 1
    assert "holds anything of nope://x" in capsys.readouterr().err


def test_a_directory_of_other_files_is_never_a_tier(tmp_path, capsys):
    """A --disk-cache-dir pointing at a user's directory: refused for running, listing and clearing;
    nothing in it is written or deleted."""
    from sluice.cli import main

    home = tmp_path / "home"
    home.mkdir()
    (home / "thesis.tex").write_text("precious")
    with pytest.raises(DiskTierError, match=r"not a Sluice disk tier \(no SLUICE-DISK-TIER file\) and not empty"):
        DiskTier(home, 1 << 20)
    for action in ("list", "clear"):
        assert main(["cache", action, "--disk-cache-dir", str(home)]) == 1
        assert "not a Sluice disk tier" in capsys.readouterr().err
    assert sorted(p.name for p in home.iterdir()) == ["thesis.tex"] and not (home / MARKER).exists()
    assert main(["cache", "list", "--disk-cache-dir", str(tmp_path / "none")]) == 0
    assert "no disk tier at" in capsys.readouterr().out and not (tmp_path / "none").exists()


def test_an_unusable_tier_directory_is_a_clear_error(published, tmp_path, capsys):
    from sluice.cli import main

    _, urls = published["container"]
    afile = tmp_path / "afile"
    afile.write_text("x")
    args = ["run", urls["http"], "--prompt", "x", "--no-progress", "--memory", "4GiB", "--disk-cache", "1GiB"]
    for where, what in ((afile / "tier", "cannot create it (Not a directory)"), (afile, "not a directory")):
        assert main([*args, "--disk-cache-dir", str(where)]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"sluice: error: disk tier directory {where}: {what}"), err
    assert afile.read_text() == "x"


def test_metrics_report_each_tier(text_model, remote_servers, tmp_path, monkeypatch):
    """``/metrics`` of a server on a remote model with a disk tier: memory hits, tier hits, misses
    and bytes, and remote bytes, summed over completed generations."""
    import httpx
    from live_server import MODEL, LiveServer

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    url = remote_servers.publish("dt-served", text_model)["http"]
    eng = sluice.load(url, memory="4GiB", cache_experts=CACHE, progress=False, disk_cache="64MiB",
                      disk_cache_dir=str(tmp_path / "tier"))
    srv = LiveServer(eng)
    try:
        for prompt in ("def f(x):", "class A:"):
            r = httpx.post(f"{srv.url}/v1/completions", json={"model": MODEL, "prompt": prompt,
                                                                "max_tokens": 6, "ignore_eos": True}, timeout=60)
            assert r.status_code == 200, r.text
        m = srv.metrics()
    finally:
        srv.stop()
        eng.close()
    assert m["sluice_expert_cache_hits_total"] > 0  # memory
    assert m["sluice_disk_tier_misses_total"] > 0 and m["sluice_remote_bytes_read_total"] > 0
    assert m["sluice_disk_tier_hits_total"] > 0 and m["sluice_disk_tier_bytes_read_total"] > 0
    assert m["sluice_bytes_read_total"] == m["sluice_remote_bytes_read_total"] + m["sluice_disk_tier_bytes_read_total"]


def test_the_planner_counts_the_tiers_staging_buffers(published, tmp_path):
    from sluice.engine import ModelInfo, Options
    from sluice.storage.disk_tier import STAGING_BYTES

    _, urls = published["container"]
    plain = ModelInfo(urls["http"])
    tiered = ModelInfo(urls["http"], Options(disk_cache="64MiB", disk_cache_dir=str(tmp_path / "tier"), progress=False))
    try:
        opts = Options()
        extra = tiered.plan("4GiB", opts).activation_bytes - plain.plan("4GiB", opts).activation_bytes
        assert extra == (opts.reader_threads + 1) * STAGING_BYTES
    finally:
        plain.close()
        tiered.close()


def test_tiered_source_keeps_the_byte_source_contract(tmp_path):
    """Cold (fetched and kept) and warm (from the tier, O_DIRECT into aligned or staged into unaligned
    destinations) reads give the inner source's bytes: aligned reads short only at the end, read_into
    and pread at any offset, a range outside the object an OSError."""
    from sluice.storage import AlignedBuffer, LocalFile
    from sluice.storage.disk_tier import STAGING_BYTES

    data = random.Random(3).randbytes(2 * STAGING_BYTES + 5000)
    blob = tmp_path / "blob.bin"
    blob.write_bytes(data)
    tier = DiskTier(tmp_path / "tier", 64 << 20)
    try:
        for temperature in ("cold", "warm"):
            src = TieredSource(LocalFile(str(blob)), tier, "m")
            buf = AlignedBuffer(len(data) + 8192)
            for off, n in [(0, 4096), (8192, 3 * 4096), (0, len(data)), (len(data) - 100, 4096)]:
                got = src.read_aligned(buf.view(0, n), off)
                assert got == min(n, len(data) - off) and bytes(buf.view(0, got)) == data[off:off + got]
            for off, n in [(1, 10), (4095, 2), (12345, 70000), (3, STAGING_BYTES + 1000), (len(data) - 7, 7)]:
                dest = bytearray(n)
                src.read_into(memoryview(dest), off)
                assert bytes(dest) == data[off:off + n], (temperature, off, n)
                staged = bytearray(n + 1)  # the same range into a destination one byte off a page
                src.read_into(memoryview(staged)[1:], off)
                assert bytes(staged[1:]) == data[off:off + n]
            assert src.pread(100, 17) == data[17:117] and src.pread(100, len(data) - 30) == data[-30:]
            with pytest.raises(OSError, match=r"outside the object"):
                src.read_into(memoryview(bytearray(10)), len(data) - 5)
            stats = src.stats
            if temperature == "cold":
                assert stats.tier_hits == 5 and stats.tier_misses == 4 + 5 + 2  # each staged read: the same key, a hit
            else:
                assert stats.tier_misses == 0 and stats.tier_hits == 4 + 2 * 5 + 2
    finally:
        tier.close()


def test_a_warm_hit_reads_a_record_straight_into_a_page_aligned_slot(tmp_path):
    """A tiered source asks aligned reads in pages whatever its inner source's alignment (a remote
    object's is 1), so an expert record lands page-aligned in its slot; a warm hit then reads the
    payload straight into the slot (the staging buffer past the header page stays untouched) and
    still checks the CRC: a flipped payload byte is a miss, never the bytes."""
    from sluice.storage import AlignedBuffer, LocalFile
    from sluice.storage.disk_tier import STAGING_BYTES
    from sluice.storage.source import WrappedSource

    class Unaligned(WrappedSource):  # a byte source that reads at any offset, as a remote one does
        alignment = 1

    data = random.Random(5).randbytes(3 << 20)
    blob = tmp_path / "blob.bin"
    blob.write_bytes(data)
    tier = DiskTier(tmp_path / "tier", 64 << 20)
    try:
        src = TieredSource(Unaligned(LocalFile(str(blob))), tier, "m")
        assert src.inner.alignment == 1 and src.alignment == 4096
        off, n = 8192, (2 << 20) + 3 * 4096
        buf = AlignedBuffer(n)
        assert src.read_aligned(buf.view(0, n), off) == n and src.stats.tier_misses == 1  # cold: kept
        tier._local.buf = stage = AlignedBuffer(STAGING_BYTES)  # a fresh staging buffer: all zero
        buf.release()
        assert src.read_aligned(buf.view(0, n), off) == n and src.stats.tier_hits == 1
        assert bytes(buf.view(0, n)) == data[off:off + n]
        assert not any(stage.view(4096, STAGING_BYTES - 4096)), "a hit into an aligned slot went through staging"
        buf.release()
        assert src.read_aligned(buf.view(0, n), off) == n and src.stats.tier_hits == 2  # the kept-open file
        assert bytes(buf.view(0, n)) == data[off:off + n]
        entry = tier.path(Key(src.name, src.version, off, n).name)
        raw = bytearray(entry.read_bytes())
        raw[HEADER_BYTES + n - 100] ^= 1  # in the second half
        entry.write_bytes(bytes(raw))
        with pytest.warns(UserWarning, match="corrupt"):
            assert src.read_aligned(buf.view(0, n), off) == n  # the CRC caught it: refetched
        assert bytes(buf.view(0, n)) == data[off:off + n] and src.stats.tier_misses == 2
    finally:
        tier.close()


def _open_entry_files(tier_dir: Path) -> set[str]:
    """Paths under ``tier_dir`` this process has open (deleted ones end in " (deleted)")."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(tier_dir)) and ".entry" in target:
            out.add(target)
    return out


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_hits_keep_entry_files_open_and_removing_an_entry_closes_it(tmp_path, monkeypatch):
    """A hit leaves its entry file open for the next (at most OPEN_ENTRIES, least recently used closed
    first); an entry this process evicts or clears is closed with it, so no removed entry's disk
    space stays held, and closing the tier closes them all."""
    from sluice.storage import AlignedBuffer
    from sluice.storage import disk_tier

    monkeypatch.setattr(disk_tier, "OPEN_ENTRIES", 2)
    rng = random.Random(9)
    tier_dir = tmp_path / "tier"
    tier = DiskTier(tier_dir, 4 * (HEADER_BYTES + 8192))  # room for four entries of 8 KiB
    keys = [Key("http://h/o", "v1", i * 8192, 8192) for i in range(3)]
    data = {k: rng.randbytes(8192) for k in keys}
    buf = AlignedBuffer(8192)
    try:
        for k in keys[:3]:
            assert tier.put(k, memoryview(data[k]), "m")
        for k in keys[:3]:
            assert tier.get(k, buf.view(0, 8192)) and bytes(buf.view(0, 8192)) == data[k]
        kept = {str(tier.path(k.name)) for k in keys[1:3]}  # the two most recently used
        assert _open_entry_files(tier_dir) == kept
        assert tier.get(keys[1], buf.view(0, 8192)) and bytes(buf.view(0, 8192)) == data[keys[1]]
        assert _open_entry_files(tier_dir) == kept  # the kept-open file served the hit
        big = Key("http://h/o", "v1", 1 << 20, 9 * 4096)  # room for it evicts all three
        big_data = rng.randbytes(big.length)
        assert tier.put(big, memoryview(big_data), "m")
        assert not any(tier.path(k.name).exists() for k in keys[:3])
        assert _open_entry_files(tier_dir) == set()  # the evicted entries' files were closed with them
        big_buf = AlignedBuffer(big.length)
        assert tier.get(big, big_buf.view(0, big.length)) and bytes(big_buf.view(0, big.length)) == big_data
        assert _open_entry_files(tier_dir) == {str(tier.path(big.name))}
        tier.clear()
        assert _open_entry_files(tier_dir) == set()
        assert tier.put(keys[0], memoryview(data[keys[0]]), "m") and tier.get(keys[0], buf.view(0, 8192))
    finally:
        tier.close()
    assert _open_entry_files(tier_dir) == set()


def test_a_damaged_index_is_rebuilt_from_the_entries(tmp_path):
    from sluice.storage import LocalFile

    blob = tmp_path / "blob.bin"
    blob.write_bytes(os.urandom(100000))
    tier = DiskTier(tmp_path / "tier", 1 << 20)
    src = TieredSource(LocalFile(str(blob)), tier, "m")
    for off in range(0, 50000, 10000):
        src.pread(10000, off)
    before = tier.usage()
    tier.close()
    (tmp_path / "tier" / "index.sqlite").write_bytes(b"this is not a database" * 100)
    for suffix in ("-wal", "-shm"):
        (tmp_path / "tier" / f"index.sqlite{suffix}").unlink(missing_ok=True)
    with pytest.warns(UserWarning, match="index was damaged"):
        tier = DiskTier(tmp_path / "tier", 1 << 20)
    try:
        assert tier.usage()["entries"] == before["entries"] == 5 and tier.usage()["bytes"] == before["bytes"]
        src = TieredSource(LocalFile(str(blob)), tier, "m")
        assert src.pread(10000, 20000) == blob.read_bytes()[20000:30000] and src.stats.tier_hits == 1
    finally:
        tier.close()


def test_entries_of_an_older_version_are_dropped_when_the_object_changed(tmp_path):
    from sluice.storage import LocalFile

    blob = tmp_path / "blob.bin"
    blob.write_bytes(os.urandom(50000))
    tier = DiskTier(tmp_path / "tier", 1 << 20)
    try:
        old = TieredSource(LocalFile(str(blob)), tier, "m")
        old.pread(10000, 0)
        old.pread(10000, 10000)
        assert tier.usage()["entries"] == 2
        st = blob.stat()
        os.utime(blob, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # another version (LocalFile's includes mtime)
        new = TieredSource(LocalFile(str(blob)), tier, "m")
        assert new.version != old.version and tier.usage()["entries"] == 0 and not _entries(tmp_path / "tier")
        assert new.pread(100, 0) == blob.read_bytes()[:100] and new.stats.tier_misses == 1
    finally:
        tier.close()


def test_a_kept_open_entry_is_read_and_checked_in_one_call_and_a_changed_payload_fails(tmp_path, monkeypatch):
    """A hit on a kept-open entry reads the payload and computes its CRC-32 in one C call (zlib's CRC
    for any length and offset); a payload byte changed on disk after the entry's first read is
    caught on the next hit: dropped, never returned."""
    import zlib

    from sluice.storage import AlignedBuffer
    from sluice.storage.crc import pread_crc32

    data = os.urandom(3 * 4096 + 100)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        for off, n in [(0, 4096), (5, 70), (100, 3 * 4096), (0, 15), (4000, 9000)]:
            dest = bytearray(n)
            got = pread_crc32(fd, memoryview(dest), off)
            if got is None:
                pytest.skip("no C kernels in this build")
            want = data[off:off + n]
            assert got == (len(want), zlib.crc32(want)) and bytes(dest[:len(want)]) == want
    finally:
        os.close(fd)
    with pytest.raises(OSError):
        pread_crc32(-1, memoryview(bytearray(8)), 0)
    tier = DiskTier(tmp_path / "tier", 1 << 30)
    try:
        key = Key("http://h/obj", "v", 0, 2 * 4096)
        payload = os.urandom(key.length)
        assert tier.put(key, memoryview(payload), "m")
        buf = AlignedBuffer(key.length)
        calls = []
        monkeypatch.setattr("sluice.storage.tier_entry.pread_crc32", lambda *a: calls.append(a) or pread_crc32(*a))
        for _ in range(2):  # the first read checks the header, the second is the one-call hit
            assert tier.get(key, buf.view(0, key.length)) and bytes(buf.view(0, key.length)) == payload
        assert len(calls) == 1
        entry = tier.path(key.name)
        with open(entry, "r+b") as f:
            f.seek(HEADER_BYTES + 4097)
            f.write(bytes([payload[4097] ^ 0x10]))
        with pytest.warns(UserWarning, match="is corrupt"):
            assert not tier.get(key, buf.view(0, key.length))
        assert tier.counts["corrupt"] == 1 and not entry.exists()
    finally:
        tier.close()


def test_an_aligned_read_clipped_at_the_end_is_read_whole_pages_and_checked(tmp_path, monkeypatch):
    """An aligned read that reaches the end of its object (an entry whose length is not a whole page)
    is, once its header was checked, one whole-page read into the caller's buffer (the C call, the
    payload with its zero padding, checked against the CRC of both): the bytes are the object's, and
    a changed payload byte or a changed padding byte is caught (dropped and refetched)."""
    from sluice.storage import AlignedBuffer, LocalFile
    from sluice.storage import crc as crcmod
    from sluice.storage.buffers import align_up
    from sluice.storage.crc import pread_crc32

    data = random.Random(9).randbytes(5 * 4096 + 1234)
    blob = tmp_path / "blob.bin"
    blob.write_bytes(data)
    tier = DiskTier(tmp_path / "tier", 64 << 20)
    try:
        src = TieredSource(LocalFile(str(blob)), tier, "m")
        off, n = 8192, len(data) - 8192
        buf = AlignedBuffer(4 * 4096)
        assert src.read_aligned(buf.view(0, 4 * 4096), off) == n and src.stats.tier_misses == 1
        calls = []
        monkeypatch.setattr("sluice.storage.tier_entry.pread_crc32", lambda *a: calls.append(a) or pread_crc32(*a))
        for hit in (1, 2):  # the first hit checks the header, the second is one whole-page call
            buf.release()
            assert src.read_aligned(buf.view(0, 4 * 4096), off) == n and src.stats.tier_hits == hit
            assert bytes(buf.view(0, n)) == data[off:]
        if crcmod._pread_crc is not None:  # the C kernels are built
            assert [len(a[1]) for a in calls] == [align_up(n, 4096)]
        entry = tier.path(Key(src.name, src.version, off, n).name)
        for pos in (HEADER_BYTES + n - 1, HEADER_BYTES + n + 5):  # the payload's last byte, then its padding
            raw = bytearray(entry.read_bytes())
            raw[pos] ^= 0x40
            entry.write_bytes(bytes(raw))
            with pytest.warns(UserWarning, match="is corrupt"):
                assert src.read_aligned(buf.view(0, 4 * 4096), off) == n  # refetched, kept again
            assert bytes(buf.view(0, n)) == data[off:]
            assert src.read_aligned(buf.view(0, 4 * 4096), off) == n and bytes(buf.view(0, n)) == data[off:]
        assert tier.counts["corrupt"] == 2
    finally:
        tier.close()
