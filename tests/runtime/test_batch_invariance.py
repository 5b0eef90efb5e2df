"""Batch invariance: a row's result does not depend on how many rows are computed with it.

Kernel level: random inputs computed in batches of 1, 3, 8, 17, 64 and 300 rows give the
same bits (``torch.equal``) for every product (f32/bf16/f16 weights, output- and input-major,
each quantized format, block FP8), attention (chunks of queries at their positions, GQA,
sliding window, sinks), the one-call SwiGLU expert, the gated delta rule's recurrence, grouped
routing and element-wise math;
also on the portable (non-AVX2) kernels, in a subprocess. Model level: every family of the
registry (``tests/families.py``) gives the same logits with ``prefill_chunk`` 1, 7 and 512,
linear-attention families included (their prefill runs the recurrence token by token, in C).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import sluice
from conftest import prompt_ids
from families import FAMILY_NAMES, kinds
from sluice import kernels
from sluice.layers.attention import attend
from sluice.layers.pointwise import pointwise
from sluice.layers.routing import grouped_topk
from sluice.quant import QuantMatrix, linear, linear_chain, linear_t
from sluice.quant.fp8 import BlockFP8, quantize as fp8_quantize

pytestmark = pytest.mark.skipif(not kernels.batch_invariant(), reason="C kernels not built on this machine")

ROWS = 300
BATCHES = (1, 3, 8, 17, 64, 300)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def batched(fn, x: torch.Tensor, size: int) -> torch.Tensor:
    return torch.cat([fn(x[i : i + size]) for i in range(0, x.shape[0], size)])


def assert_invariant(fn, x: torch.Tensor) -> None:
    """fn over x's rows in every batch size gives the bits of one row at a time."""
    ref = batched(fn, x, 1)
    for size in BATCHES[1:]:
        got = batched(fn, x, size)
        assert torch.equal(got, ref), f"rows in batches of {size}: max diff {(got - ref).abs().max().item():.3e}"


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,k", [(45, 67), (33, 256)])  # odd: scalar tails and leftover rows; a whole-vector one
def test_dense_products(dtype, n, k):
    g = gen(n + k)
    x = torch.randn(ROWS, k, generator=g)
    w = torch.randn(n, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g)
    assert_invariant(lambda r: linear(r, w, bias), x)
    assert_invariant(lambda r: linear_t(r, w.t().contiguous(), bias), x)
    assert_invariant(lambda r: linear_chain(r, w, bias), x)
    assert_invariant(lambda r: linear_chain(r, w.t().contiguous(), bias, input_major=True), x)


@pytest.mark.parametrize("fmt", ["int8", "q4", "mxfp4", "rvq3"])
def test_quantized_products(fmt):
    g = gen(7)
    w = torch.randn(40, 96, generator=g)
    m = QuantMatrix.quantize(fmt, w)
    x = torch.randn(ROWS, 96, generator=g)
    assert_invariant(lambda r: m.linear(r), x)
    assert_invariant(lambda r: linear(r, m), x)


def test_block_fp8_products():
    g = gen(8)
    w, s = fp8_quantize(torch.randn(40, 72, generator=g), (16, 16))
    m = BlockFP8(w, s, (16, 16))
    x = torch.randn(ROWS, 72, generator=g)
    assert_invariant(lambda r: m.linear(r), x)
    assert_invariant(lambda r: m.heads(r.reshape(-1, 2, 36).contiguous(), 0, 20, 20).reshape(r.shape[0], -1), x)


@pytest.mark.parametrize("window,sinks", [(None, False), (5, True)])
def test_attention(window, sinks):
    """Queries in chunks at their positions over the keys written so far (as prefill chunks see them)."""
    g = gen(9)
    t, hq, hkv, d = 120, 4, 2, 24
    q = torch.randn(t, hq, d, generator=g)
    k = torch.randn(hkv, t, d, generator=g)
    v = torch.randn(hkv, t, 20, generator=g)
    s = torch.randn(hq, generator=g) if sinks else None

    def chunked(size):
        return torch.cat([attend(q[i : i + size], k[:, : i + size], v[:, : i + size], i, 0.2, window, s)
                          for i in range(0, t, size)])

    ref = chunked(1)
    for size in BATCHES[1:]:
        assert torch.equal(chunked(size), ref), f"queries in chunks of {size}"
    # and the same attention as the plain formula (rounding apart)
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    if window:
        mask &= ~torch.ones(t, t, dtype=torch.bool).tril(-window)
    scores = torch.einsum("thd,hld->htl", q, k.repeat_interleave(hq // hkv, 0)) * 0.2
    scores = scores.masked_fill(~mask, float("-inf"))
    if s is not None:
        scores = torch.cat([scores, s[:, None, None].expand(hq, t, 1)], -1)
    p = torch.softmax(scores, -1)[..., :t]
    want = torch.einsum("htl,hle->the", p, v.repeat_interleave(hq // hkv, 0))
    assert (ref - want).abs().max() < 1e-5


@pytest.mark.parametrize("window,sinks", [(None, False), (37, True)])
@pytest.mark.parametrize("group", [2, 4, 8, 17])
@pytest.mark.parametrize("d", [29, 64])
def test_attention_grouped_heads_as_one_head_at_a_time(group, window, sinks, d):
    """The kernel runs a key/value head's query heads together (each key block read once); each
    head's output equals the same head with its keys and values repeated per head (one head at a
    time), at 1 and 2 threads, over keys past a block of 64 with a tail of 3, with a D tail of 5 and without one."""
    if not kernels.available():
        pytest.skip("C kernels not built on this machine")
    g = gen(11)
    t, hkv, dv, start = 7, 2, 21, 143
    hq = hkv * group
    q = torch.randn(t, hq, d, generator=g)
    k = torch.randn(hkv, start + t, d, generator=g)
    v = torch.randn(hkv, start + t, dv, generator=g)
    s = torch.randn(hq, generator=g) if sinks else None
    k1, v1 = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    before = kernels.info()["threads"]
    try:
        for threads in (1, 2):
            kernels.set_threads(threads)
            one = kernels.attend(q, k1, v1, start, 0.3, window, s)
            assert torch.equal(kernels.attend(q, k, v, start, 0.3, window, s), one), threads
            for i in range(t):  # decode, one query at its position
                assert torch.equal(kernels.attend(q[i : i + 1], k, v, start + i, 0.3, window, s), one[i : i + 1])
    finally:
        kernels.set_threads(before)


def test_attention_weights_below_the_smallest_normal_are_zero():
    """A peaked softmax (scores 80-110 below the maximum: weights of 2^-126 and less, subnormal or
    0 in fp32) gives those keys weight 0 on every path (subnormals cost a microcode assist per
    fma); the outputs stay the plain formula's, and grouped heads stay one head's bits."""
    if not kernels.available():
        pytest.skip("C kernels not built on this machine")
    g = gen(12)
    t, hkv, group, d, n = 3, 2, 4, 64, 90
    hq = hkv * group
    q = torch.randn(t, hq, d, generator=g)
    k = torch.randn(hkv, n, d, generator=g)
    v = torch.randn(hkv, n, 24, generator=g)
    # scores: key 0 is the maximum; the others fall 80-110 below it
    k[:, 1:] = -q.mean((0, 1)) * torch.linspace(0.5, 0.7, n - 1)[None, :, None] * (110 / q.mean((0, 1)).norm() ** 2)
    out = kernels.attend(q, k, v, n - t, 1.0)
    k1, v1 = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    assert torch.equal(kernels.attend(q, k1, v1, n - t, 1.0), out)
    scores = torch.einsum("thd,hld->htl", q.double(), k1.double())
    mask = torch.arange(n)[None, :] <= torch.arange(n - t, n)[:, None]
    scores = scores.masked_fill(~mask, float("-inf"))
    p = torch.softmax(scores, -1)
    assert ((p > 0) & (p < 2.0**-126)).any()  # the case is there
    want = torch.einsum("htl,hle->the", p, v1.double()).float()
    assert torch.isfinite(out).all() and (out - want).abs().max() < 1e-5


def test_swiglu_expert_rows():
    g = gen(10)
    gate, up, down = (torch.randn(*s, generator=g).to(torch.bfloat16) for s in ((48, 40), (48, 40), (40, 48)))
    x = torch.randn(ROWS, 40, generator=g)
    one = torch.cat([kernels.swiglu(x[i : i + 1].contiguous(), gate, up, down, 0.7) for i in range(ROWS)])
    assert_invariant(lambda r: kernels.swiglu_rows(r.contiguous(), gate, up, down, 0.7), x)
    assert torch.equal(kernels.swiglu_rows(x, gate, up, down, 0.7), one)


def test_routing_and_pointwise():
    g = gen(11)
    logits = torch.randn(ROWS, 16, generator=g)
    bias = torch.randn(16, generator=g) * 0.3
    for size in BATCHES:
        ids, w = zip(*(grouped_topk(logits[i : i + size], 4, bias=bias, n_group=4, topk_group=2, scale=2.5)
                       for i in range(0, ROWS, size)))
        if size == 1:
            ref_ids, ref_w = torch.cat(ids), torch.cat(w)
        assert torch.equal(torch.cat(ids), ref_ids) and torch.equal(torch.cat(w), ref_w)
    x = torch.randn(ROWS, 37, generator=g) * 4
    for fn in (torch.sigmoid, torch.exp, torch.cos, torch.nn.functional.silu, torch.nn.functional.softplus):
        assert_invariant(lambda r: pointwise(fn, r), x)
    big = torch.randn(3000, 37, generator=g)  # several blocks
    assert torch.equal(pointwise(torch.sigmoid, big)[2990:], pointwise(torch.sigmoid, big[2990:]))


@pytest.mark.parametrize("per_channel", [False, True], ids=["per_head", "per_channel"])
def test_delta_rule_recurrence(per_channel):
    """The gated delta rule in chunks of any size (carrying the state) gives the bits of one
    token at a time, and the fp64 chunked form's values (rounding apart)."""
    from sluice.layers.gated_delta import delta_rule, delta_rule_chunked

    g_ = gen(14)
    h, t, dk, dv = 3, 60, 16, 12
    q = torch.nn.functional.normalize(torch.randn(h, t, dk, generator=g_), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(h, t, dk, generator=g_), dim=-1)
    v = torch.randn(h, t, dv, generator=g_)
    g = -torch.rand(h, t, dk, generator=g_) if per_channel else -torch.rand(h, t, generator=g_)
    beta = torch.rand(h, t, generator=g_)

    def chunked(size):
        outs, S = [], None
        for i in range(0, t, size):
            o, S = delta_rule(q[:, i : i + size], k[:, i : i + size], v[:, i : i + size], g[:, i : i + size],
                              beta[:, i : i + size], S)
            outs.append(o)
        return torch.cat(outs, dim=1), S

    ref, ref_s = chunked(1)
    for size in (3, 8, 17, 64):
        o, S = chunked(size)
        assert torch.equal(o, ref) and torch.equal(S, ref_s), f"chunks of {size}"
    o64, _ = delta_rule_chunked(q.double(), k.double(), v.double(), g.double(), beta.double(), None)
    assert (ref.double() - o64).abs().max() < 1e-5


def test_fast_path_still_close():
    """With batch invariance off (benchmarks), the sgemm / torch paths agree to rounding."""
    g = gen(12)
    x = torch.randn(64, 67, generator=g)
    w = torch.randn(45, 67, generator=g).to(torch.bfloat16)
    q = torch.randn(64, 4, 16, generator=g)
    kv = torch.randn(2, 64, 16, generator=g)
    inv = (linear(x, w), attend(q, kv, kv, 0, 0.25))
    prev = kernels.set_batch_invariant(False)
    try:
        assert not kernels.batch_invariant()
        fast = (linear(x, w), attend(q, kv, kv, 0, 0.25))
    finally:
        kernels.set_batch_invariant(prev)
    for a, b in zip(inv, fast):
        assert (a - b).abs().max() < 1e-4


def test_portable_kernels_invariant():
    """The portable C path (hosts without AVX2) is batch-invariant too."""
    code = (
        "import torch, sys\n"
        "sys.path[:0] = ['tests/runtime', 'tests']\n"
        "from sluice import kernels\n"
        "assert not kernels.info()['avx2']\n"
        "import test_batch_invariance as t\n"
        "for dt in t.DTYPES: t.test_dense_products(dt, 45, 67)\n"
        "t.test_attention(5, True)\n"
        "t.test_swiglu_expert_rows()\n"
        "t.test_quantized_products('q4')\n"
        "t.test_block_fp8_products()\n"
        "t.test_delta_rule_recurrence(True)\n"
    )
    env = dict(os.environ, SLUICE_KERNELS_PORTABLE="1")
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_prefill_chunk_bitwise(family, family_models):
    ids = prompt_ids(20)
    for kind in kinds(family):
        logits = {}
        for chunk in (512, 7, 1):
            with sluice.load(family_models.hf(family, kind), memory="2G", progress=False,
                             prefill_chunk=chunk) as eng:
                logits[chunk] = eng.forward(ids)
        for chunk in (7, 1):
            diff = (logits[chunk] - logits[512]).abs().max().item()
            assert torch.equal(logits[chunk], logits[512]), f"{kind}: prefill_chunk={chunk} differs by {diff:.3e}"


def test_avx512_tile_matches_avx2():
    """Where the CPU has AVX-512F the tiled product runs on it: the same bits as the AVX2 tile
    and as one row at a time (CI hosts without it run the AVX2 tile in the tests above)."""
    if not kernels.allow_avx512(True):
        assert kernels.info()["avx512"] is False  # nothing to compare on this host
        return
    g = gen(13)
    for dtype in DTYPES:
        for n, k in ((45, 67), (64, 512)):
            x = torch.randn(50, k, generator=g)
            w = torch.randn(n, k, generator=g).to(dtype)
            wide = linear(x, w)
            try:
                kernels.allow_avx512(False)
                narrow = linear(x, w)
            finally:
                kernels.allow_avx512(True)
            one = torch.cat([linear(x[i : i + 1], w) for i in range(50)])
            assert torch.equal(wide, narrow) and torch.equal(wide, one), (dtype, n, k)
