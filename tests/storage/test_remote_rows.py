"""Row tables from S3 and HTTP, and through the disk tier: streamed row by row (a one-row cache
per table) from a remote Hugging Face directory and a remote container, the logits are the
local directory's bit for bit; a second run behind the disk tier reads its rows from the tier."""

from __future__ import annotations

import pytest
import torch

import sluice
from families import PROMPT

pytest.importorskip("obstore")


@pytest.fixture(scope="module")
def remote_qwen4(remote_servers, family_models):
    out = {"hf": family_models.hf("qwen4_exp"), "container": family_models.container("qwen4_exp")}
    return {k: (p, remote_servers.publish(f"rows-{k}", p)) for k, p in out.items()}


@pytest.fixture
def s3_env(remote_servers, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", remote_servers.s3.endpoint)


@pytest.mark.parametrize("model,server", [("hf", "s3"), ("hf", "http"), ("container", "s3")])
def test_remote_rows_are_bit_identical(remote_qwen4, s3_env, model, server):
    path, urls = remote_qwen4[model]
    with sluice.load(path, memory="2GiB", progress=False) as eng:
        want = eng.forward(PROMPT)
    with sluice.load(urls[server], memory="2GiB", progress=False, row_cache=1) as eng:
        got = eng.forward(PROMPT)
        assert eng.rows.stats.read > 0 and not eng.plan.rows_resident
    assert torch.equal(got, want)


def test_rows_through_the_disk_tier(remote_qwen4, s3_env, tmp_path):
    path, urls = remote_qwen4["hf"]
    with sluice.load(path, memory="2GiB", progress=False) as eng:
        want = eng.forward(PROMPT)
    tier = dict(disk_cache="64MiB", disk_cache_dir=str(tmp_path / "tier"))
    runs = []
    for _ in range(2):
        with sluice.load(urls["s3"], memory="2GiB", progress=False, row_cache=1, **tier) as eng:
            before = eng.checkpoint.stats.tier_hits
            assert torch.equal(eng.forward(PROMPT), want)
            runs.append((eng.rows.stats.read, eng.checkpoint.stats.tier_hits - before))
    assert runs[0][0] > 0 and runs[1][0] == runs[0][0]  # the same rows read through the seam ...
    assert runs[1][1] > runs[0][1]  # ... the second time served by the tier
