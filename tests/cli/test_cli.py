"""The command line, run as a user would: a subprocess per command."""

from __future__ import annotations

import json
import subprocess
import sys


def sluice_cmd(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "sluice.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def test_run_json(text_model):
    out = sluice_cmd("run", text_model, "--prompt", "def f():", "--max-new-tokens", "8", "--ignore-eos",
                     "--memory", "2GiB", "--cache-experts", "6", "--json")
    assert out.returncode == 0, out.stderr
    obj = json.loads(out.stdout)
    assert len(obj["token_ids"]) == 8 and isinstance(obj["text"], str)
    for key in ("prefill_tok_s", "decode_tok_s", "hit_rate", "bytes_read", "peak_rss_bytes"):
        assert key in obj["stats"]


def test_run_streams_text_and_stats_line(text_model):
    import sluice

    expected = sluice.load(text_model, memory="2GiB", progress=False).generate(
        "import sys", max_new_tokens=6, ignore_eos=True).text
    out = sluice_cmd("run", text_model, "-p", "import sys", "--max-new-tokens", "6", "--ignore-eos", "--memory", "2GiB")
    assert out.returncode == 0, out.stderr
    assert out.stdout == expected + "\n"
    line = [x for x in out.stderr.splitlines() if x.startswith("[sluice]")]
    assert len(line) == 1
    for part in ("prefill", "decode", "hit rate", "read", "peak RSS"):
        assert part in line[0]


def test_run_below_floor_fails_clearly(text_model):
    out = sluice_cmd("run", text_model, "-p", "x", "--memory", "10MiB")
    assert out.returncode == 1
    assert "sluice: error: memory budget 10.00 MiB is below the floor" in out.stderr
    assert "Traceback" not in out.stderr


def test_bad_size_argument(text_model):
    out = sluice_cmd("run", text_model, "-p", "x", "--memory", "lots")
    assert out.returncode == 2 and "cannot parse size 'lots'" in out.stderr


def test_inspect(text_model):
    out = sluice_cmd("inspect", text_model, "--json")
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["model_type"] == "qwen3_moe" and r["experts_per_layer"] == 8 and r["moe_layers"] == 2
    assert r["working_set_experts"] == 4 and r["floor_bytes"] > r["spine_bytes"]
    assert r["budgets"][0]["budget_bytes"] == r["floor_bytes"]
    text = sluice_cmd("inspect", text_model, "--memory", "1GiB").stdout
    assert "memory floor" in text and "budget -> expert cache" in text


def test_help_explains():
    out = sluice_cmd("run", "--help")
    assert out.returncode == 0 and "--memory" in out.stdout and "floor" in out.stdout
    assert sluice_cmd().returncode == 2


def test_demo_small(tmp_path):
    out = sluice_cmd("demo", "--synthetic", "100MB", "--cache-dir", tmp_path, "--max-new-tokens", "6",
                     "--no-progress", "--json")
    assert out.returncode == 0, out.stderr
    obj = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(obj["token_ids"]) >= 1
    model_size = sum(p.stat().st_size for p in tmp_path.rglob("*.safetensors"))
    assert obj["stats"]["budget_bytes"] < model_size * 10  # small models are dominated by the torch baseline
    assert obj["stats"]["cache_slots"] < obj["stats"]["total_experts"]
    assert obj["stats"]["peak_rss_bytes"] <= obj["stats"]["budget_bytes"]
    again = sluice_cmd("demo", "--synthetic", "100MB", "--cache-dir", tmp_path, "--max-new-tokens", "2",
                       "--no-progress")
    assert again.returncode == 0 and "writing" not in again.stderr  # built once, reused


def test_demo_synthetic_deepseek_v4_certain_reads_on_and_off(tmp_path):
    """``--family deepseek_v4`` writes a V4 shape (valid hash tables); ``--no-certain-reads`` reaches
    the engine: no certain reads, the same tokens."""
    runs = []
    for extra in ((), ("--no-certain-reads",)):
        out = sluice_cmd("demo", "--synthetic", "100MB", "--family", "deepseek_v4", "--cache-dir", tmp_path,
                         "--max-new-tokens", "4", "--no-progress", "--json", *extra)
        assert out.returncode == 0, out.stderr
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert (tmp_path / "synthetic-deepseek_v4-0.1GB-v1" / "config.json").is_file()
    assert runs[0]["stats"]["certain_reads"] > 0 and runs[1]["stats"]["certain_reads"] == 0
    assert runs[0]["token_ids"] == runs[1]["token_ids"]


def test_demo_synthetic_qwen4_exp_reads_its_tables_by_row(tmp_path):
    """``--family qwen4_exp`` writes a Qwen3.8-Flash-Next shape whose n-gram tables are looked up
    by row (the row store's counters in the stats)."""
    out = sluice_cmd("demo", "--synthetic", "0.7GB", "--family", "qwen4_exp", "--cache-dir", tmp_path,
                     "--max-new-tokens", "4", "--no-progress", "--json")
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout.strip().splitlines()[-1])["stats"]
    assert (tmp_path / "synthetic-qwen4_exp-0.7GB-v1" / "config.json").is_file()
    assert stats["row_lookups"] > 0
