"""Streaming the spine layer by layer when it does not fit: exact, bounded, refused below the floor."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import sluice
from conftest import SPINE_BUDGET, prompt_ids, save_tiny
from sluice.convert import convert


@pytest.fixture(scope="module")
def six_layers(tmp_path_factory):
    root = tmp_path_factory.mktemp("six")
    hf = save_tiny(root / "hf", "qwen3_moe", num_hidden_layers=6)
    return hf, convert(hf, root / "box.sluice", progress=False)


@pytest.mark.parametrize("which", ["hf", "container"])
def test_streamed_spine_is_bit_identical(six_layers, which):
    path = six_layers[0] if which == "hf" else six_layers[1]
    ids = prompt_ids()
    ref = sluice.load(path, memory="2GiB", cache_experts=4, progress=False)
    ref_logits, ref_tokens = ref.forward(ids), ref.generate(ids.tolist(), max_new_tokens=16).token_ids
    for resident in (0, 2, 5):
        eng = sluice.load(path, memory="2GiB", cache_experts=4, max_resident_layers=resident, progress=False)
        assert len(eng.plan.streamed_layers) == 6 - resident
        assert torch.equal(eng.forward(ids), ref_logits)
        r = eng.generate(ids.tolist(), max_new_tokens=16)
        assert r.token_ids == ref_tokens
        if 6 - resident > 2:  # more streamed layers than buffers: every token re-reads them
            assert r.stats["spine_bytes_read"] > 0


def test_budget_smaller_than_spine(spine_model):
    from sluice.engine import ModelInfo

    spine = ModelInfo(spine_model).spine_bytes()
    assert spine > SPINE_BUDGET  # the spine alone does not fit
    runner = (
        "import json, sys, sluice\n"
        "from sluice.sysmem import peak_rss\n"
        "e = sluice.load(sys.argv[1], memory=int(sys.argv[2]), max_context=256, progress=False)\n"
        "r = e.generate(list(range(3, 40)), max_new_tokens=6, ignore_eos=True)\n"
        "print(json.dumps({'peak': peak_rss(), 'stats': r.stats,"
        " 'streamed': e.plan.streamed_layers}))\n"
    )
    out = subprocess.run([sys.executable, "-c", runner, str(spine_model), str(SPINE_BUDGET)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["peak"] <= SPINE_BUDGET, f"peak {res['peak'] / 2**20:.0f} MiB > budget {SPINE_BUDGET / 2**20:.0f} MiB"
    assert res["streamed"] and res["stats"]["spine_bytes_read"] > 0
    assert res["stats"]["spine_streamed_layers"] == len(res["streamed"])


def test_below_streaming_floor_is_refused(spine_model):
    with pytest.raises(sluice.BudgetError) as e:
        sluice.load(spine_model, memory="300MiB", max_context=256, progress=False)
    msg = str(e.value)
    assert "below the floor" in msg and "2 layers' spine buffers" in msg and "Raise --memory to at least" in msg


def test_inspect_shows_streaming_plan(spine_model):
    out = subprocess.run([sys.executable, "-m", "sluice.cli", "inspect", str(spine_model), "--memory",
                          f"{SPINE_BUDGET}B", "--max-context", "256", "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["floor_bytes"] < r["floor_resident_bytes"]
    assert r["plan"]["streamed_layers"]
    assert r["plan"]["spine_streamed_bytes"] > 0


def test_streamed_spine_linear_attention_family(tmp_path):
    """Streaming the spine of a hybrid linear-attention model (qwen3_next) changes no bit."""
    path = save_tiny(tmp_path / "q3n", "qwen3_next", seed=2, num_hidden_layers=6, layer_types=None,
                     full_attention_interval=3, linear_num_key_heads=2, linear_num_value_heads=4,
                     linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                     shared_expert_intermediate_size=32)
    ids = prompt_ids()
    ref = sluice.load(path, memory="2GiB", cache_experts=4, progress=False)
    ref_logits, ref_tokens = ref.forward(ids), ref.generate(ids.tolist(), max_new_tokens=12).token_ids
    eng = sluice.load(path, memory="2GiB", cache_experts=4, max_resident_layers=1, progress=False)
    assert len(eng.plan.streamed_layers) == 5
    assert torch.equal(eng.forward(ids), ref_logits)
    r = eng.generate(ids.tolist(), max_new_tokens=12)
    assert r.token_ids == ref_tokens and r.stats["spine_bytes_read"] > 0
