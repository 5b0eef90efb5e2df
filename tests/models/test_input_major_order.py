"""Experts a family stores input-major (GPT-OSS) are summed in one order whatever their layout:
the Hugging Face directory's fused input-major slices and a container's canonical records give
the same bits, for every batch size, with and without the C kernels."""

from __future__ import annotations

import pytest
import torch

import sluice
from conftest import prompt_ids
from sluice import kernels
from sluice.kernels import backend
from sluice.quant import dense


@pytest.mark.skipif(not kernels.chain_available(), reason="C kernels not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t,k,n", [(1, 1, 1), (1, 45, 37), (3, 128, 64), (5, 1000, 300), (8, 512, 2048),
                                   (7, 77, 130), (11, 64, 96), (16, 2880, 17)])
def test_chain_kernel_is_the_input_major_order(dtype, t, k, n):
    g = torch.Generator().manual_seed(n * k + t)
    w = torch.randn(k, n, generator=g).to(dtype)  # input-major [K, N]
    x = torch.randn(t, k, generator=g)
    b = torch.randn(n, generator=g)
    om = w.t().contiguous()  # the same matrix output-major [N, K]
    assert torch.equal(kernels.dense_chain(x, om, b), kernels.dense_t(x, w, b))
    assert torch.equal(kernels.dense_chain(x, om), kernels.dense_t(x, w))
    ref = (x.double() @ w.double() + b.double()).float()
    assert torch.allclose(kernels.dense_chain(x, om, b), ref, atol=1e-4 * k**0.5, rtol=1e-5)
    rows = torch.cat([kernels.dense_chain(x[i : i + 1].contiguous(), om, b) for i in range(t)])
    assert torch.equal(rows, kernels.dense_chain(x, om, b))  # a token's result never depends on T


@pytest.mark.skipif(not kernels.chain_available(), reason="C kernels not built")
def test_chain_kernel_thread_independent():
    w = torch.randn(1000, 777).to(torch.bfloat16)
    x = torch.randn(3, 777)
    before = kernels.info()["threads"]
    try:
        kernels.set_threads(1)
        a = kernels.dense_chain(x, w)
        kernels.set_threads(2)
        b = kernels.dense_chain(x, w)
    finally:
        kernels.set_threads(before)
    assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["f32", "bf16"])
@pytest.mark.parametrize("with_kernels", [True, False])
def test_gpt_oss_container_bit_identical_to_directory(family_models, monkeypatch, kind, with_kernels):
    """A 150-token prompt in one chunk: experts see more tokens than the chain kernels take
    (sgemm on the same fp32 copy for both layouts) as well as fewer."""
    if not with_kernels:
        monkeypatch.setattr(backend.cpu, "chain_available", lambda: False)
    ids = prompt_ids(150, seed=5)
    outs = []
    for path in (family_models.hf("gpt_oss", kind), family_models.container("gpt_oss", kind)):
        with sluice.load(path, memory="4GiB", progress=False) as eng:
            outs.append((eng.forward(ids), eng.generate(ids[:20].tolist(), max_new_tokens=8).token_ids))
    assert torch.equal(outs[0][0], outs[1][0]) and outs[0][1] == outs[1][1]
    assert dense.CHAIN_BATCH < 150 * 2 // 8  # some expert got more tokens than the chain kernels take
