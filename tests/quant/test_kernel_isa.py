"""Every instruction-set path the C kernels dispatch to gives the AVX2 path's bits.

The kernels pick a path at run time (``kernels.isa_levels()``: AVX2, AVX-512F, AVX-512 with
VNNI); wider paths keep the AVX2 path's per-output accumulation order. Each level this host has
is run against the AVX2 level (``kernels.set_isa_cap``) on shapes with scalar tails, leftover
rows and group tails, at 1 token and at several token counts (tiled paths), and compared with
one token at a time. A host without a level runs the others (CI hosts without AVX-512 test the
AVX2 path against the portable checks elsewhere); the level list is printed in the test id.
"""

from __future__ import annotations

import pytest
import torch

import sluice
from conftest import at_level, prompt_ids
from families import FAMILY_NAMES, kinds
from sluice import kernels, quant
from sluice.quant import QuantMatrix, linear

LEVELS = kernels.isa_levels()
WIDE = [lv for lv in LEVELS if lv > 1]

pytestmark = pytest.mark.skipif(1 not in LEVELS, reason="C kernels not built on this machine")


def check_levels(fn, x: torch.Tensor) -> None:
    """fn(x) at every level (whole batch and row by row) equals the AVX2 level's rows one by one."""
    ref = at_level(1, lambda: torch.cat([fn(x[i : i + 1]) for i in range(x.shape[0])]))
    assert torch.equal(at_level(1, lambda: fn(x)), ref)
    for level in WIDE:
        whole = at_level(level, lambda: fn(x))
        rows = at_level(level, lambda: torch.cat([fn(x[i : i + 1]) for i in range(x.shape[0])]))
        assert torch.equal(whole, ref), (kernels.ISA_LEVELS[level], (whole - ref).abs().max().item())
        assert torch.equal(rows, ref), (kernels.ISA_LEVELS[level], "one row at a time")


def test_levels_listed():
    assert LEVELS[0] == 1 and LEVELS == list(range(1, LEVELS[-1] + 1))
    assert kernels.info()["isa"] == kernels.ISA_LEVELS[LEVELS[-1]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n,k", [(45, 67), (64, 512), (9, 16), (130, 2048)])
def test_dense_every_level(dtype, n, k):
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g)
    x = torch.randn(13, k, generator=g)
    check_levels(lambda v: linear(v, w, b), x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n,k", [(3001, 1000), (1203, 3584), (130, 2048)])
def test_dense_decode_prefetch_every_level_and_thread_count(dtype, n, k):
    """Decode (1-3 tokens) prefetches each row stream ahead and splits rows into 512 KiB chunks per
    thread; a batch of 13 does neither. Every row must come out the same at every level and thread
    count, for rows that end mid-line (k = 1000) and matrices that end a buffer (nothing past it)."""
    g = torch.Generator().manual_seed(n + k)
    store = torch.randn(n + 5, k, generator=g).to(dtype)
    w = store[5:]  # the last rows of its buffer
    x = torch.randn(13, k, generator=g)
    ref = at_level(1, lambda: kernels.dense(x, w))
    before = kernels.info()["threads"]
    try:
        for threads in (1, 2):
            kernels.set_threads(threads)
            for level in LEVELS:
                for t in (1, 2, 3):
                    got = at_level(level, lambda: torch.cat([kernels.dense(x[i : i + t], w) for i in range(0, 12, t)]))
                    assert torch.equal(got, ref[:12]), (kernels.ISA_LEVELS[level], threads, t)
    finally:
        kernels.set_threads(before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("k", [0, 1, 7, 15, 16, 17])
def test_dense_short_rows_every_level(dtype, k):
    """Rows shorter than one vector step (the decode prefetch plans its distances in rows of K:
    K = 0 must not divide by zero), at 1-3 tokens and at a batch, every level."""
    g = torch.Generator().manual_seed(k)
    w = torch.randn(9, k, generator=g).to(dtype)
    for t in (1, 2, 3, 7):
        x = torch.randn(t, k, generator=g)
        want = x.double() @ w.double().T
        for level in LEVELS:
            got = at_level(level, lambda: kernels.dense(x, w))
            assert got.shape == (t, 9) and torch.allclose(got.double(), want, atol=1e-5), (kernels.ISA_LEVELS[level], t)


@pytest.mark.parametrize("mode", ["q8", "f32"])
@pytest.mark.parametrize("fmt", ["q4", "mxfp4", "int8"])
@pytest.mark.parametrize("n,k", [(45, 32 * 13), (33, 32 * 16), (7, 32 * 9), (64, 32 * 64), (5, 32)])
def test_quantized_every_level(fmt, n, k, mode):
    """Nibble formats with q8 activations (the default: AVX-512 VNNI, 1-4 tokens per pass) and
    with fp32 activations (GPT-OSS's native MXFP4: AVX-512F, two groups per zmm)."""
    g = torch.Generator().manual_seed(n + k)
    m = QuantMatrix.quantize(fmt, torch.randn(n, k, generator=g) * 0.05)
    b = torch.randn(n, generator=g)
    x = torch.randn(11, k, generator=g)
    quant.set_activations(mode)
    try:
        check_levels(lambda v: m.matmul(v, b), x)
    finally:
        quant.set_activations(None)


@pytest.mark.parametrize("t", [1, 5])
def test_swiglu_expert_every_level(t):
    """The one-call expert (gate and up in one pool job, then down) at every level and thread count:
    the AVX2 level's bits, and the value of the three products done separately."""
    g = torch.Generator().manual_seed(3)
    gate, up = (torch.randn(200, 256, generator=g).to(torch.bfloat16) for _ in range(2))
    down = torch.randn(256, 200, generator=g).to(torch.bfloat16)
    x = torch.randn(t, 256, generator=g)

    def fn(v):
        if t > 1:
            return kernels.swiglu_rows(v.contiguous(), gate, up, down, 0.7)
        return kernels.swiglu(v, gate, up, down, 0.7)

    ref = at_level(1, lambda: fn(x))
    for threads in (1, 2):
        kernels.set_threads(threads)
        try:
            for level in LEVELS:
                assert torch.equal(at_level(level, lambda: fn(x)), ref), (threads, kernels.ISA_LEVELS[level])
        finally:
            kernels.set_threads(torch.get_num_threads())
    h = torch.nn.functional.silu(linear(x, gate).double()) * linear(x, up).double()
    want = 0.7 * (h @ down.double().T)
    assert torch.allclose(ref.double(), want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@pytest.mark.skipif(not WIDE, reason="this host has no level above AVX2 (the AVX2 path runs everywhere else)")
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_model_logits_every_level(family, family_models):
    """Every family, every checkpoint kind of the registry: a 12-token prompt's logits (tiled
    products, attention, experts) at the widest level equal the AVX2 level's, bit for bit."""
    ids = prompt_ids(12)
    for kind in kinds(family):
        with sluice.load(family_models.hf(family, kind), memory="2G", progress=False) as eng:
            ref = at_level(1, lambda: eng.forward(ids))
            for level in WIDE:
                got = at_level(level, lambda: eng.forward(ids))
                assert torch.equal(got, ref), (kind, kernels.ISA_LEVELS[level], (got - ref).abs().max().item())
