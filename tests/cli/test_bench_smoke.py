"""The benchmark harness on a tiny model, so that it does not rot (the real runs are not in CI).

Exercises ``benchmarks/run.py`` end to end for Sluice and transformers + accelerate (both in
the test environment): model writing, arms as child processes, counters sampled from
``/proc/<pid>/io`` and ``/proc/<pid>/status``, the cgroup memory cap (skipped with the reason
when this machine does not allow one), the exactness comparison, the report. llama.cpp and
AirLLM are optional heavy peers (``python benchmarks/peers.py install``): their tests are
skipped, with the reason, when they are not installed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import harness  # noqa: E402
import peers  # noqa: E402
import run  # noqa: E402

COMMON = ["--tiny", "--new-tokens", "4", "--prompt-tokens", "12", "--python", "hf=current", "--timeout", "600"]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    return root / "cache", root / "results"


def _load(results: Path, name: str) -> dict:
    return json.loads((results / f"{name}.json").read_text())


def _check_run(r: dict, n: int) -> None:
    assert r["ok"], r.get("error")
    res = r["result"]
    assert len(res["token_ids"]) == n and res["generated_tokens"] == n
    assert res["ttft_s"] > 0 and res["decode_tok_s"] > 0 and res["prefill_tok_s"] > 0
    # sampled from outside, at every phase mark
    for mark in ("start", "loaded", "first_token", "end"):
        assert "read_bytes" in r["marks"][mark] and "VmHWM" in r["marks"][mark]
    assert r["peak_rss_bytes"] > 50 << 20
    assert r["read_bytes_total"] is not None and r["read_bytes_per_decode_token"] is not None


def test_exact_sluice_and_transformers(work):
    cache, results = work
    assert run.main(["exact", "--engines", "sluice,hf", "--cache", str(cache), "--results", str(results)] + COMMON) == 0
    data = _load(results, "exact")
    ref = data["reference"]
    _check_run(ref, 4)
    assert ref["result"]["logit_margins"] and len(ref["result"]["logit_margins"]) == 4
    runs = {r["engine"]: r for r in data["runs"]}
    _check_run(runs["sluice"], 4)
    _check_run(runs["hf"], 4)
    # Sluice computes in fp32 on the bf16 weights: the same greedy tokens as the fp32 reference
    assert runs["sluice"]["match"] is True, (runs["sluice"]["result"]["token_ids"], ref["result"]["token_ids"])


def test_cold_under_a_cgroup_cap(work):
    cache, results = work
    kind, why = harness.cgroup_support()
    if kind is None:
        pytest.skip(f"memory cap not enforceable here: {why}")
    assert run.main(["cold", "--engines", "sluice,hf", "--cache", str(cache), "--results", str(results)] + COMMON) == 0
    data = _load(results, "cold")
    assert data["cgroup"] == kind
    lim = data["limits"]
    assert lim["direct_read"]["bytes_per_s"] > 0 and lim["memory_read"]["bytes_per_s"] > 0
    for r in data["runs"]:
        _check_run(r, 4)
        assert r["cap_enforced"] and r["cgroup"]["limit_bytes"] == data["cap_bytes"]
        assert r["cgroup"]["max_usage_bytes"] <= data["cap_bytes"]
    sluice = next(r for r in data["runs"] if r["engine"] == "sluice")
    assert sluice["peak_rss_bytes"] <= sluice["result"]["engine_stats"]["budget_bytes"]
    assert sluice["match_bf16"] is not None  # compared with the transformers arm
    if (data.get("reference") or {}).get("ok"):  # the fp32 reference needs AirLLM
        assert sluice["match"] is True


def test_sweep_and_report(work, tmp_path):
    cache, results = work
    kind, _ = harness.cgroup_support()
    extra = [] if kind else ["--no-cgroup"]
    assert run.main(["sweep", "--shares", "0.25,1.0", "--cache", str(cache), "--results", str(results)]
                    + COMMON + extra) == 0
    data = _load(results, "sweep")
    assert data["runs"] and all(r["engine"] == "sluice" for r in data["runs"])
    for r in data["runs"]:
        _check_run(r, 4)
        assert r["result"]["warmup_stats"]["generated_tokens"] == 4
        assert r["peak_rss_bytes"] <= r["cap_bytes"]
    import report

    doc = tmp_path / "benchmarks.md"
    assert report.main(["--results", str(results), "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert "### (c) Sluice alone" in text and "### Exactness" in text
    assert (tmp_path / "benchmarks" / "sweep.png").stat().st_size > 1000


@pytest.mark.parametrize("engine", ["llamacpp", "airllm"])
def test_heavy_peer(work, engine):
    """Only where the optional peers are installed; a skip here is not a pass."""
    cache_default = peers.cache_dir()
    if not peers.installed(cache_default, engine):
        pytest.skip(f"{engine} not installed (optional heavy peer): "
                    f"python benchmarks/peers.py install --peers {engine}")
    cache, results = work
    assert run.main(["exact", "--engines", engine, "--cache", str(cache), "--venvs", str(cache_default),
                     "--results", str(results), "--name", f"exact-{engine}"] + COMMON) == 0
    data = _load(results, f"exact-{engine}")
    r = data["runs"][0]
    _check_run(r, 4)
    assert r["match"] is True, (r["result"]["token_ids"], data["reference"]["result"]["token_ids"])


def test_kernel_ab_same_library_twice(tmp_path):
    """benchmarks/kernel_ab.py on the built kernels against themselves (an A/A run): every case
    runs in both copies, the outputs are compared bit for bit, and the JSON says so."""
    import kernel_ab

    from sluice import kernels

    lib = kernels._find_library() if kernels.available() else None
    if not lib:
        pytest.skip("C kernels not built on this machine")
    out = tmp_path / "ab.json"
    cases = "up,down,kv,swiglu,up32,attn40,sum"
    assert kernel_ab.main([lib, lib, "--threads", "1", "2", "--rounds", "2", "--calls", "0.01", "--pool", "128",
                           "--cases", cases, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 * len(cases.split(","))
    assert all(r["same_bits"] and len(r["gb_s"]) == 2 and all(g > 0 for g in r["gb_s"]) for r in rows)


def test_prefetch_bench_policy_arms(tmp_path):
    """benchmarks/prefetch.py on the shipped demo model with the previous and today's eviction
    (lfru's cold-fresh rule off and on) as interleaved arms: the script fails if the arms'
    tokens differ, and its JSON carries every rep's counters; an unknown arm setting is
    refused by name."""
    import prefetch

    out = tmp_path / "pf.json"
    assert prefetch.main(["demo", "--cache-experts", "30", "--tokens", "12", "--reps", "2", "--read-seconds", "0.05",
                          "--prompt", "import os", "--arm", "prev:cross=0", "--arm", "default",
                          "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"prev", "default"} and all(len(r) == 2 for r in results.values())
    assert all(r["reads_per_token"] >= r["demand_per_token"] > 0 and 0 < r["hit_rate"] < 1
               for rs in results.values() for r in rs)
    with pytest.raises(SystemExit, match="unknown setting"):
        prefetch.parse_arm("x:crosss=0")
