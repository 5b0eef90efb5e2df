"""The demo-model training script runs end to end (``--tiny``) and writes a
checkpoint that transformers loads."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "training" / "train_demo_model.py"

CHECKPOINT_FILES = [
    "config.json",
    "model.safetensors",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "training_metrics.json",
]


def _load_script_module():
    spec = importlib.util.spec_from_file_location("train_demo_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(spec.name, None)
    return module


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tiny_train")
    out = tmp / "model"
    plot = tmp / "img" / "loss.png"
    doc = tmp / "report.md"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--out", str(out), "--plot", str(plot),
         "--doc", str(doc)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {"out": out, "plot": plot, "doc": doc, "stdout": proc.stdout}


def test_tiny_run_writes_all_files(tiny_run):
    out = tiny_run["out"]
    for name in CHECKPOINT_FILES:
        assert (out / name).is_file(), name
        assert (out / name).stat().st_size > 0, name
    assert tiny_run["plot"].is_file() and tiny_run["plot"].read_bytes()[:4] == b"\x89PNG"
    report = tiny_run["doc"].read_text()
    assert "held-out" in report.lower() and "def fibonacci(n):" in report
    # progress output reports throughput and ETA
    assert "tok/s" in tiny_run["stdout"] and "ETA" in tiny_run["stdout"]


def test_tiny_config_and_tokenizer_files(tiny_run):
    out = tiny_run["out"]
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe"
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert 0 <= config[key] < config["vocab_size"], key
    assert config["num_experts"] == config["num_local_experts"]
    assert 1 <= config["num_experts_per_tok"] <= config["num_experts"]

    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert "chat_template" not in tok_cfg
    assert not (out / "chat_template.jinja").exists()
    assert tok_cfg["bos_token"] == tok_cfg["eos_token"] == tok_cfg["pad_token"] == "<|endoftext|>"
    tok_json = json.loads((out / "tokenizer.json").read_text())
    pre = tok_json["pre_tokenizer"]
    steps = pre["pretokenizers"] if pre["type"] == "Sequence" else [pre]
    assert steps[-1]["type"] == "ByteLevel"
    assert tok_json["decoder"]["type"] == "ByteLevel"
    assert tok_json["model"]["vocab"]["<|endoftext|>"] == config["eos_token_id"]


def test_tiny_checkpoint_loads_in_transformers(tiny_run):
    out = tiny_run["out"]
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    model.eval()
    assert model.config.model_type == "qwen3_moe"
    assert tokenizer.eos_token_id == model.config.eos_token_id

    prompt = "def fibonacci(n):\n"
    enc = tokenizer(prompt, return_tensors="pt")
    # add_bos_token is false: the prompt is encoded as is and round-trips
    assert enc["input_ids"][0, 0].item() != tokenizer.bos_token_id
    assert tokenizer.decode(enc["input_ids"][0]) == prompt
    with torch.no_grad():
        logits = model(**enc).logits
        gen = model.generate(**enc, do_sample=False, max_new_tokens=5)
    assert logits.shape == (1, enc["input_ids"].shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()
    assert gen.shape[1] > enc["input_ids"].shape[1]


def test_tiny_metrics(tiny_run):
    metrics = json.loads((tiny_run["out"] / "training_metrics.json").read_text())
    assert metrics["tiny"] is True
    assert "--tiny" in metrics["command"]
    assert math.isfinite(metrics["heldout_loss"])
    assert math.isfinite(metrics["heldout_perplexity"]) and metrics["heldout_perplexity"] > 1.0
    assert math.isclose(metrics["heldout_perplexity"], math.exp(metrics["heldout_loss"]), rel_tol=1e-9)
    assert math.isfinite(metrics["final_train_loss"])
    assert metrics["tokens_trained"] > 0 and metrics["train_wall_seconds"] >= 0
    corpus = metrics["corpus"]
    assert corpus["train_files"] > 0 and corpus["heldout_files"] > 0
    assert corpus["train_tokens"] > 0 and corpus["heldout_tokens"] > 0
    assert metrics["history"]["train"] and metrics["history"]["heldout"]
    assert len(metrics["samples"]) >= 2
    shares = metrics["routing"]["share_per_layer_and_expert"]
    assert len(shares) == metrics["architecture"]["num_hidden_layers"]
    for row in shares:
        assert math.isclose(sum(row), 1.0, abs_tol=1e-3)


def test_corpus_split_is_deterministic_and_excludes_tests():
    mod = _load_script_module()
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    files = mod.collect_files(root, 200_000)
    assert files == sorted(files) and len(files) > 50
    for rel in files:
        parts = rel.split("/")
        assert not set(parts[:-1]) & {"site-packages", "test", "tests", "idle_test"}, rel
        assert rel.endswith(".py")
    held = [f for f in files if mod.is_heldout(f, 30)]
    assert held == [f for f in files if mod.is_heldout(f, 30)]
    assert 0 < len(held) < 0.1 * len(files)
