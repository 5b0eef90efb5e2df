"""The trained demo model that ships in the package: a real Hugging Face checkpoint that
transformers loads, on which Sluice's greedy output equals transformers' and whose
held-out loss is what training recorded."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

import sluice
from sluice.demo import SHIPPED_MODEL

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "training" / "train_demo_model.py"
METRICS = json.loads((SHIPPED_MODEL / "training_metrics.json").read_text())
PROMPTS = [s["prompt"] for s in METRICS["samples"]]
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def reference():
    model = AutoModelForCausalLM.from_pretrained(SHIPPED_MODEL, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(SHIPPED_MODEL)


@pytest.fixture(scope="module")
def reference_tokens(reference):
    """transformers' greedy NEW_TOKENS for each prompt, generated once for both speculate settings."""
    model, tok = reference
    out = {}
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out[prompt] = model.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                         pad_token_id=tok.pad_token_id)[0, ids.shape[1]:].tolist()
    return out


@pytest.fixture(scope="module")
def engine():
    # a quarter of the experts cached: most routed experts are read from the checkpoint
    return sluice.load(SHIPPED_MODEL, memory="4GiB", cache_experts=48, progress=False)


def test_shipped_checkpoint_is_small_and_complete():
    files = {p.name: p.stat().st_size for p in SHIPPED_MODEL.iterdir()}
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert files.get(name, 0) > 0, name
    assert sum(files.values()) <= 50e6
    cfg = json.loads((SHIPPED_MODEL / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe" and cfg["num_experts"] >= 16
    # a completion model with a chat template added after training (docs/demo-model.md)
    assert json.loads((SHIPPED_MODEL / "tokenizer_config.json").read_text())["chat_stop_strings"]


@pytest.mark.parametrize("speculate", [False, True])
def test_greedy_equals_transformers(reference, reference_tokens, engine, speculate):
    _, tok = reference
    for prompt in PROMPTS:
        ref = reference_tokens[prompt]
        got = engine.generate(prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True, speculate=speculate)
        assert got.token_ids == ref, prompt
        assert got.text == tok.decode(ref)
    assert engine.experts.counters.misses > 0  # experts really came from disk


def test_logits_match_transformers(reference, engine):
    model, tok = reference
    ids = tok("".join(PROMPTS), return_tensors="pt")["input_ids"]
    with torch.no_grad():
        ref = model(ids).logits[0].float()
    got = engine.forward(ids[0])
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4), (got - ref).abs().max()


def _heldout_windows():
    """The first held-out windows exactly as the training script built them, or skip when
    this interpreter's standard library is not the one the model was trained on."""
    spec = importlib.util.spec_from_file_location("train_demo_model", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.modules.pop(spec.name, None)
    corpus = mod.build_corpus(mod.parse_args([]))
    if corpus["sha256"] != METRICS["corpus"]["sha256"]:
        pytest.skip("this Python's standard library differs from the training corpus "
                    f"(Python {METRICS['corpus']['python_version']})")
    from tokenizers import Tokenizer

    stream = mod.encode_stream(Tokenizer.from_file(str(SHIPPED_MODEL / "tokenizer.json")), corpus["heldout_texts"])
    assert len(stream) == METRICS["corpus"]["heldout_tokens"]
    check = METRICS["heldout_check"]
    return mod.heldout_windows(stream, check["seq_len"])[: check["windows"]], check["loss"]


def test_heldout_loss_as_recorded(engine):
    windows, recorded = _heldout_windows()
    total, count = 0.0, 0
    for w in windows:
        logits = engine.forward(w[:-1])
        total += F.cross_entropy(logits, w[1:], reduction="sum").item()
        count += len(w) - 1
    loss = total / count
    assert loss <= recorded + 0.01, f"held-out loss {loss:.4f} > recorded {recorded:.4f}"
    assert abs(loss - recorded) < 1e-3  # same model, same numbers, up to float summation order
    assert np.exp(METRICS["heldout_loss"]) == pytest.approx(METRICS["heldout_perplexity"])


def test_sluice_demo_prints_code_and_stats():
    out = subprocess.run([sys.executable, "-m", "sluice.cli", "demo", "--max-new-tokens", "40", "--no-progress"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("def fibonacci(n):\n")
    completion = out.stdout[len("def fibonacci(n):\n"):]
    assert completion.strip()
    assert "hit rate" in out.stderr and "cache 48/192 experts" in out.stderr
    assert "decode" in out.stderr and "peak RSS" in out.stderr
