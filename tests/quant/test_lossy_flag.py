"""A container whose experts ``sluice convert`` quantized says it is lossy: in every result's
stats, in ``sluice inspect`` and in ``sluice run``'s summary line. The source's own weights
(a container of the checkpoint's format, a widening cast) are not lossy."""

from __future__ import annotations

import json

import pytest

from sluice import cli, load
from sluice.convert import convert
from sluice.lossy import expert_loss


@pytest.fixture(scope="module")
def containers(text_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("lossy")
    return {fmt: convert(text_model, root / f"{fmt or 'stored'}.sluice", experts=fmt, progress=False)
            for fmt in (None, "q4")}


def test_quantized_experts_are_lossy_everywhere(containers, capsys):
    q4 = containers["q4"]
    with load(q4, "2GiB", progress=False, cache_experts=6) as eng:
        r = eng.generate("def f():", max_new_tokens=2, ignore_eos=True)
    assert r.stats["lossy"] == {"experts": "q4"}
    assert cli.main(["inspect", str(q4)]) == 0
    out = capsys.readouterr().out
    assert "expert format     q4 (LOSSY: q4 quantized from the source's" in out
    assert cli.main(["inspect", str(q4), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["expert_lossy"].startswith("q4 quantized from the source's")
    assert cli.main(["run", str(q4), "-p", "def f():", "--max-new-tokens", "2", "--ignore-eos", "--memory", "2GiB",
                     "--cache-experts", "6", "--no-progress"]) == 0
    assert "| LOSSY: experts q4" in capsys.readouterr().err


def test_the_sources_own_weights_are_not_lossy(containers, capsys):
    with load(containers[None], "2GiB", progress=False, cache_experts=6) as eng:
        assert eng.generate("def f():", max_new_tokens=2, ignore_eos=True).stats["lossy"] == {}
    assert cli.main(["inspect", str(containers[None])]) == 0
    assert "LOSSY" not in capsys.readouterr().out


@pytest.mark.parametrize("fmt, source, lossy", [
    ("mxfp4", "mxfp4", False), ("fp8", "fp8", False), ("bf16", "bf16", False), ("f32", "bf16", False),
    ("f32", "f16", False), ("bf16", "f32", True), ("f16", "bf16", True), ("q4", "bf16", True),
    ("int8", "f32", True), ("rvq3", "bf16", True), ("mxfp4", "bf16", True), ("q4", None, True), ("bf16", None, False),
])
def test_what_is_lossy(fmt, source, lossy):
    assert (expert_loss(fmt, source) is not None) == lossy
