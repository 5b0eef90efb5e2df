"""Quantized weight formats: layouts, round trips, fused kernels against the plain-torch
reference, MXFP4 bit-exactness against transformers, rvq3 determinism, and the interface
(``assemble``, ``record_layout``, ``linear``) the expert path uses."""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from sluice import kernels, quant
from sluice.kernels import backend
from sluice.experts.compute import expert_forward
from sluice.experts.spec import ExpertSpec
from sluice.quant import FORMATS, QuantMatrix, assemble_views, fake_quantize_activations, linear, record_layout
from sluice.quant.mxfp4 import FP4_VALUES, e2m1_codes

LOSSY = ["int8", "q4", "mxfp4", "rvq3"]
SHAPES = [(1, 32), (37, 96), (130, 200), (64, 1000), (257, 320)]  # odd rows; K not a block multiple
TOKENS = [1, 3, 8, 9, 33, 65]
needs_c = pytest.mark.skipif(not kernels.available(), reason="C kernels not built on this machine")


@contextmanager
def torch_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextmanager
def kernel_threads(n: int):
    before = kernels.info()["threads"]
    kernels.set_threads(n)
    try:
        yield
    finally:
        kernels.set_threads(before)


@contextmanager
def activations(mode: str | None):
    quant.set_activations(mode)
    try:
        yield
    finally:
        quant.set_activations(None)


_QUANTIZED: dict = {}


def quantized(name: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, QuantMatrix]:
    """N(0, 1) weights [n, k] and their quantization (cached: rvq3's k-means takes a moment)."""
    key = (name, n, k, seed)
    if key not in _QUANTIZED:
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed * 7919 + n * 31 + k))
        with torch_threads(1):  # k-means on small problems: threads only add overhead
            _QUANTIZED[key] = (w, QuantMatrix.quantize(name, w, seed=seed))
    return _QUANTIZED[key]


def bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Scale of the rounding error of x @ w.T: sum_k |x_k| |w_nk| per output."""
    return x.abs().double() @ w.abs().double().T


def expected(fmt, x: torch.Tensor, qm: QuantMatrix, t: int) -> torch.Tensor:
    """What the fused or batched path computes in exact arithmetic: the reference dequantized
    matrix times the activations the kernel uses (q8-rounded in "q8" mode, for few tokens, or
    for every batch with batch-invariant kernels: the fused kernel then serves every batch)."""
    kp = fmt.padded_k(qm.k)
    xp = torch.nn.functional.pad(x, (0, kp - qm.k))
    fused = t <= fmt.batch_limit() or kernels.batch_invariant()
    if kernels.available() and fused and quant.activations(fmt.name) == "q8":
        xp = fake_quantize_activations(xp)
    w = fmt.dequantize_rows(qm.parts, qm.n, qm.k, 0, qm.n)
    return xp.double() @ w.double().T, bound(xp, w)


# ------------------------------------------------------------------------ registry --


def test_registry_and_layouts():
    from sluice.container import FORMAT_IDS

    assert set(FORMATS) >= {"f32", "bf16", "f16", "int8", "q4", "mxfp4", "rvq3", "fp8"}
    assert set(FORMATS) == set(FORMAT_IDS)  # every expert format a container names is registered
    for name, fmt in FORMATS.items():
        assert fmt.name == name
        # fp8, int4, fp4: lossy from float (a checkpoint's own FP8 / INT4 / FP4: as stored, not lossy)
        assert fmt.lossy == (name in LOSSY or name in ("fp8", "int4", "fp4"))
        n, k = 14336, 4096
        bits = fmt.nbytes(n, k) * 8 / (n * k)
        assert abs(bits - fmt.bits_per_weight) < 0.02, (name, bits)
    assert FORMATS["q4"].parts(10, 100) == {"blocks": (torch.uint8, (10, 4, 16)), "scales": (torch.float16, (10, 4))}
    assert FORMATS["mxfp4"].parts(10, 64) == {"blocks": (torch.uint8, (10, 2, 16)), "scales": (torch.uint8, (10, 2))}
    assert FORMATS["int8"].parts(3, 40) == {"weight": (torch.int8, (3, 64)), "scales": (torch.float32, (3,))}
    assert FORMATS["rvq3"].parts(5, 20) == {"codes": (torch.uint8, (5, 3, 3)),
                                            "codebooks": (torch.float16, (3, 256, 8))}
    assert FORMATS["bf16"].parts(4, 6) == {"weight": (torch.bfloat16, (4, 6))}
    assert FORMATS["fp8"].parts(300, 200) == {"weight": (torch.float8_e4m3fn, (300, 200)),
                                              "scale_inv": (torch.float32, (3, 2))}
    # how an expert record names each part: "<role>.<part>", the role itself for plain dtypes, and
    # the checkpoints' own "<role>" + "<role>_scale_inv" for FP8
    assert FORMATS["q4"].record_parts("up") == {"blocks": "up.blocks", "scales": "up.scales"}
    assert FORMATS["bf16"].record_parts("up") == {"weight": "up"}
    assert FORMATS["fp8"].record_parts("up") == {"weight": "up", "scale_inv": "up_scale_inv"}


def test_fp8_is_a_registered_format():
    """FP8 goes through the registry like the others: quantize, reference, matmul, and an expert
    record's "<role>" + "<role>_scale_inv" views assembled into one ``BlockFP8`` per role."""
    from sluice.quant.fp8 import BlockFP8, quantize

    fmt = FORMATS["fp8"]
    w = torch.randn(300, 200)
    parts = fmt.quantize(w)
    q, s = quantize(w, (128, 128))
    assert torch.equal(parts["weight"].view(torch.uint8), q.view(torch.uint8)) and torch.equal(parts["scale_inv"], s)
    ref = fmt.dequantize(parts, 300, 200)
    assert torch.equal(ref, BlockFP8(q, s, (128, 128)).dequantize())
    assert ((ref - w).norm() / w.norm()).item() < 0.05
    x = torch.randn(3, 200)
    assert torch.allclose(fmt.matmul(x, parts, 300, 200), x @ ref.T, rtol=1e-4, atol=1e-4)
    spec = ExpertSpec(hidden=200, intermediate=300)
    views = {}
    for role, (n, k) in spec.matrix_shapes().items():
        p = fmt.quantize(torch.randn(n, k))
        views[role], views[role + "_scale_inv"] = p["weight"], p["scale_inv"]
    got = assemble_views(views, block=(128, 128))
    assert set(got) == {"gate", "up", "down"} and all(isinstance(got[r], BlockFP8) for r in got)
    assert got.swiglu is None  # no one-call expert kernel for FP8: gate/up/down products instead
    dense = assemble_views({r: got[r].dequantize() for r in got})
    assert dense.swiglu is not None
    y, ref = expert_forward(spec, got, x), expert_forward(spec, dense, x)
    assert torch.allclose(y, ref, rtol=1e-4, atol=1e-5 * ref.abs().max().item())  # fp32 sums, two orders
    with pytest.raises(Exception, match="weight block"):
        assemble_views(views)  # FP8 without its block: refused, never misread


@pytest.mark.parametrize("name", LOSSY)
def test_quantize_matches_parts(name):
    for n, k in [(37, 96), (130, 200)]:
        _, qm = quantized(name, n, k)
        spec = FORMATS[name].parts(n, k)
        assert set(qm.parts) == set(spec)
        for part, (dtype, shape) in spec.items():
            assert qm.parts[part].dtype == dtype and tuple(qm.parts[part].shape) == shape, part
        assert qm.dequantize().shape == (n, k)


# Relative Frobenius error on N(0, 1) [256, 1024] matrices (measured values in docs/quantization.md).
ERROR_BOUNDS = {"int8": 0.01, "q4": 0.085, "mxfp4": 0.125, "rvq3": 0.25}


@pytest.mark.parametrize("name", LOSSY)
def test_reconstruction_error(name):
    w, qm = quantized(name, 256, 1024)
    rel = ((qm.dequantize() - w).norm() / w.norm()).item()
    print(f"{name}: relative reconstruction error {rel:.4f}")
    assert rel < ERROR_BOUNDS[name]


@pytest.mark.parametrize("name", ["bf16", "f16", "f32"])
def test_dense_formats_pass_through(name):
    w = torch.randn(33, 70)
    fmt = FORMATS[name]
    parts = fmt.quantize(w)
    assert torch.equal(fmt.dequantize(parts, 33, 70), w.to(fmt.dtype).float())
    x = torch.randn(2, 70)
    assert torch.equal(fmt.matmul(x, parts, 33, 70), linear(x, parts["weight"]))


# ----------------------------------------------------------------------- kernels ----


@pytest.mark.parametrize("name", LOSSY)
@pytest.mark.parametrize("mode", ["f32", "q8"])
def test_matmul_matches_reference(name, mode):
    fmt = FORMATS[name]
    if name == "rvq3" and mode == "q8":
        pytest.skip("rvq3 multiplies fp32 activations through its tables")
    with activations(mode):
        for n, k in SHAPES:
            if name == "rvq3" and n * k > 40000:
                continue  # k-means time; rvq3 has its own larger tests below
            _, qm = quantized(name, n, k)
            for t in TOKENS:
                x = torch.randn(t, k, generator=torch.Generator().manual_seed(t))
                b = torch.randn(n)
                y = qm.matmul(x, b)
                assert y.dtype == torch.float32 and y.shape == (t, n)
                ref, scale = expected(fmt, x, qm, t)
                err = ((y.double() - b.double()) - ref).abs()
                assert (err <= 2e-5 * scale + 1e-6).all(), (name, n, k, t, (err / (scale + 1e-9)).max().item())


@pytest.mark.parametrize("name", LOSSY)
def test_q8_is_close_to_fp32_reference(name):
    """The "q8" activation rounding costs a fraction of a percent against the fp32 reference."""
    if name == "rvq3":
        pytest.skip("rvq3 has no q8 mode")
    _, qm = quantized(name, 130, 200)
    x = torch.randn(1, 200)
    with activations("q8"):
        y = qm.matmul(x)
    ref = FORMATS[name].reference_matmul(x, qm.parts, 130, 200)
    assert ((y - ref).norm() / ref.norm()).item() < 0.02


def _layout_order(g: int, layout: int) -> torch.Tensor:
    """Element index held at each position of a row of g blocks in the kernels' activation layouts."""
    block = [2 * i for i in range(16)] + [2 * i + 1 for i in range(16)]
    order = []
    for b in range(g):
        if layout == 0:
            order += [b * 32 + i for i in range(32)]
        elif layout == 1 or (b % 2 == 0 and b == g - 1):
            order += [b * 32 + e for e in block]
        elif b % 2 == 0:
            ev = lambda c: [c * 32 + e for e in block[:16]]  # noqa: E731
            od = lambda c: [c * 32 + e for e in block[16:]]  # noqa: E731
            order += ev(b) + ev(b + 1) + od(b) + od(b + 1)
    return torch.tensor(order)


@needs_c
def test_q8_activations_match_torch():
    for g in (8, 7, 3):
        x = torch.randn(5, 32 * g) * torch.logspace(-3, 3, 32 * g)
        x[1, :32] = 0.0  # an all-zero block
        want = fake_quantize_activations(x)
        for layout in (0, 1, 2):
            xq, xd, xs = kernels.q8_activations(x, layout)
            order = _layout_order(g, layout)
            natural = torch.empty_like(xq)
            natural[:, order] = xq
            got = (natural.float().reshape(5, g, 32) * xd[..., None]).reshape(5, 32 * g)
            assert torch.equal(got, want), (g, layout)
            assert torch.allclose(xs, natural.float().reshape(5, g, 32).sum(-1) * xd)


@needs_c
@pytest.mark.parametrize("name", LOSSY)
def test_c_dequant_is_the_reference(name):
    fmt = FORMATS[name]
    for n, k in [(37, 96), (130, 200)]:
        _, qm = quantized(name, n, k)
        w, s = fmt._kernel_parts(qm.parts)
        kp = fmt.padded_k(k)
        ref = fmt.dequantize_rows(qm.parts, n, k, 0, n)
        assert torch.equal(kernels.qdequant(fmt.code, w, s, 0, n, kp), ref)
        assert torch.equal(kernels.qdequant(fmt.code, w, s, 5, 17, kp), ref[5:17])


@needs_c
@pytest.mark.parametrize("name", ["bf16"] + LOSSY)
def test_thread_counts_bit_identical(name):
    n, k = (300, 1024) if name != "rvq3" else (300, 512)
    fmt = FORMATS[name]
    if name == "rvq3":
        _, qm = quantized(name, 64, 512)
        qm = QuantMatrix(fmt, {"codes": torch.randint(0, 256, (n, k // 8, 3), dtype=torch.uint8),
                               "codebooks": qm.parts["codebooks"]}, n, k)
    else:
        qm = QuantMatrix.quantize(name, torch.randn(n, k))
    for mode in ("f32", "q8"):
        with activations(mode):
            for t in (1, 3, 8):
                x = torch.randn(t, k)
                outs = []
                for threads in (1, 2, 1, 2):
                    with kernel_threads(threads):
                        outs.append(linear(x, qm if name != "bf16" else qm.parts["weight"]))
                for o in outs[1:]:
                    assert torch.equal(o, outs[0]), (mode, t)


def test_torch_fallback_without_c_kernels(monkeypatch):
    monkeypatch.setattr(backend.cpu, "available", lambda: False)  # what the call sites ask
    for name in LOSSY:
        fmt = FORMATS[name]
        _, cached = quantized(name, 37, 96)
        qm = QuantMatrix(fmt, cached.parts, 37, 96)  # built without C kernels: no fast path
        for t in (1, 9):
            x = torch.randn(t, 96)
            y = qm.matmul(x)
            ref = fmt.reference_matmul(x, qm.parts, 37, 96)
            scale = bound(x, qm.dequantize())
            assert ((y.double() - ref.double()).abs() <= 1e-5 * scale + 1e-6).all(), (name, t)


PORTABLE_SCRIPT = """
import torch
from sluice import kernels, quant
from sluice.quant import FORMATS, QuantMatrix, fake_quantize_activations
assert kernels.available() and not kernels.info()["avx2"]
torch.manual_seed(0)
for name in ["int8", "q4", "mxfp4", "rvq3"]:
    fmt = FORMATS[name]
    n, k = 45, 96
    qm = QuantMatrix.quantize(name, torch.randn(n, k))
    w, s = fmt._kernel_parts(qm.parts)
    ref_w = fmt.dequantize_rows(qm.parts, n, k, 0, n)
    assert torch.equal(kernels.qdequant(fmt.code, w, s, 0, n, k), ref_w), name
    for mode in ("f32", "q8"):
        quant.set_activations(mode)
        x = torch.randn(2, k)
        xa = fake_quantize_activations(x) if mode == "q8" and name != "rvq3" else x
        ref = xa.double() @ ref_w.double().T
        err = (qm.matmul(x).double() - ref).abs().max().item()
        assert err < 1e-4, (name, mode, err)
print("portable ok")
"""


@needs_c
def test_portable_c_path():
    env = dict(os.environ, SLUICE_KERNELS_PORTABLE="1", PYTHONPATH=str(Path(__file__).resolve().parents[2] / "src"))
    out = subprocess.run([sys.executable, "-c", PORTABLE_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "portable ok" in out.stdout


# ------------------------------------------------------------------------- mxfp4 -----


def _all_codes_all_exponents() -> tuple[torch.Tensor, torch.Tensor]:
    """blocks [1, 256, 1, 16], scales [1, 256, 1]: row e has E8M0 exponent e and holds every
    E2M1 code twice (code c at elements c and 16 + c)."""
    codes = torch.arange(32) % 16
    packed = (codes[0::2] | (codes[1::2] << 4)).to(torch.uint8)
    blocks = packed.repeat(256, 1).reshape(1, 256, 1, 16)
    scales = torch.arange(256, dtype=torch.uint8).reshape(1, 256, 1)
    return blocks, scales


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.float(), b.float()
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


def test_mxfp4_every_code_and_exponent_exact():
    blocks, scales = _all_codes_all_exponents()
    fmt = FORMATS["mxfp4"]
    parts = {"blocks": blocks[0], "scales": scales[0]}
    got = fmt.dequantize(parts, 256, 32)
    for e in range(256):
        for i in range(32):
            v = FP4_VALUES[i % 16]
            exact = v * 2.0 ** (e - 127)  # exact in a Python float; fp32 rounds it (inf past 2^128)
            want = torch.tensor(exact if abs(exact) < 2.0**128 else exact * float("inf"), dtype=torch.float32)
            assert got[e, i].view(torch.int32) == want.view(torch.int32), (e, i % 16)
    if kernels.available():
        c = kernels.qdequant(fmt.code, parts["blocks"], parts["scales"], 0, 256, 32)
        assert _same_bits(c, got)


def test_mxfp4_matches_transformers_dequantization():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    fmt = FORMATS["mxfp4"]
    blocks, scales = _all_codes_all_exponents()
    for dtype in (torch.float32, torch.bfloat16):
        ref = convert_moe_packed_tensors(blocks, scales, dtype=dtype)[0].T  # [E, in, out] -> [out, in]
        assert _same_bits(fmt.dequantize({"blocks": blocks[0], "scales": scales[0]}, 256, 32), ref)
    g = torch.Generator().manual_seed(0)
    e, n, k = 3, 40, 96
    blocks = torch.randint(0, 256, (e, n, k // 32, 16), generator=g, dtype=torch.int32).to(torch.uint8)
    for lo, hi in ((110, 135), (0, 255)):  # realistic exponents, then the whole range but NaN
        scales = torch.randint(lo, hi, (e, n, k // 32), generator=g, dtype=torch.int32).to(torch.uint8)
        for dtype in (torch.float32, torch.bfloat16):
            ref = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
            for i in range(e):
                parts = {"blocks": blocks[i], "scales": scales[i]}  # one expert's slices, as stored
                assert _same_bits(fmt.dequantize(parts, n, k), ref[i].T)
                if kernels.available():
                    assert _same_bits(kernels.qdequant(fmt.code, blocks[i], scales[i], 0, n, k), ref[i].T)


def test_e2m1_rounding_ties_to_even():
    vals = torch.tensor([0.1, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, 7.0, 100.0])
    want = [0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0]
    lut = torch.tensor(FP4_VALUES)
    assert lut[e2m1_codes(vals).long()].tolist() == want
    assert lut[e2m1_codes(-vals).long()].tolist() == [-v if v else 0.0 for v in want]


def test_mxfp4_quantize_is_exact_on_representable_values():
    g = torch.Generator().manual_seed(3)
    n, k = 16, 256
    blocks = torch.randint(0, 256, (n, k // 32, 16), generator=g, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(100, 140, (n, k // 32), generator=g, dtype=torch.int32).to(torch.uint8)
    fmt = FORMATS["mxfp4"]
    w = fmt.dequantize({"blocks": blocks, "scales": scales}, n, k)
    again = fmt.dequantize(fmt.quantize(w), n, k)
    assert torch.equal(again, w + 0.0)  # -0.0 may come back as +0.0


# -------------------------------------------------------------------------- rvq3 -----


def test_rvq3_kmeans_deterministic_for_a_seed():
    w = torch.randn(64, 256)
    with torch_threads(1):
        a = FORMATS["rvq3"].quantize(w, seed=5)
        b = FORMATS["rvq3"].quantize(w, seed=5)
        c = FORMATS["rvq3"].quantize(w, seed=6)
    assert all(torch.equal(a[p], b[p]) for p in a)
    assert not torch.equal(a["codes"], c["codes"])


def test_rvq3_table_lookup_equals_reference():
    fmt = FORMATS["rvq3"]
    _, small = quantized("rvq3", 64, 512)
    n, k = 700, 1016  # codes need not come from k-means for the kernel: random codes, learned codebooks
    g = torch.Generator().manual_seed(1)
    parts = {"codes": torch.randint(0, 256, (n, k // 8, 3), generator=g, dtype=torch.int32).to(torch.uint8),
             "codebooks": small.parts["codebooks"]}
    qm = QuantMatrix(fmt, parts, n, k)
    w = qm.dequantize()
    for t in (1, 2, 4, 5, 16):
        x = torch.randn(t, k, generator=g)
        ref = x.double() @ w.double().T
        scale = bound(x, w)
        for y in (qm.matmul(x), fmt.table_matmul(x, parts, n, k)):
            assert ((y.double() - ref).abs() <= 1e-5 * scale + 1e-6).all(), t


# ---------------------------------------------------------------------- interface ----


def _expert_views(fmt_name: str, spec: ExpertSpec, seed: int = 0):
    """Quantize an expert, write its parts into one byte record at ``record_layout`` offsets,
    and return the views a cache slot would hold, plus the dense fp32 weights."""
    shapes = spec.matrix_shapes()
    g = torch.Generator().manual_seed(seed)
    dense = {role: torch.randn(n, k, generator=g) for role, (n, k) in shapes.items()}
    entries, total = record_layout(fmt_name, shapes)
    record = torch.zeros(total, dtype=torch.uint8)
    q = {}
    with torch_threads(1):
        for role, w in dense.items():
            q[role] = FORMATS[fmt_name].quantize(w)
    views = {}
    names = {name: (role, part) for role in shapes for part, name in FORMATS[fmt_name].record_parts(role).items()}
    for name, off, dtype, shape in entries:
        role, part = names[name]
        src = q[role][part].contiguous().view(torch.uint8).reshape(-1)
        record[off : off + src.numel()] = src
        views[name] = record[off : off + src.numel()].view(dtype).view(shape)
    return shapes, views, dense


@pytest.mark.parametrize("fmt_name", ["bf16", "int8", "q4", "mxfp4", "rvq3"])
def test_assemble_and_expert_forward(fmt_name):
    spec = ExpertSpec(hidden=64, intermediate=96)
    shapes, views, dense = _expert_views(fmt_name, spec)
    views["gate_bias"] = torch.randn(96)
    w = assemble_views(views, None if fmt_name == "bf16" else fmt_name, shapes)
    assert torch.equal(w["gate_bias"], views["gate_bias"])
    if fmt_name == "bf16":
        assert isinstance(w["gate"], torch.Tensor) and w["gate"].dtype == torch.bfloat16
    else:
        assert isinstance(w["gate"], QuantMatrix) and w["gate"].shape == (96, 64)
    ref_w = {role: (w[role] if isinstance(w[role], torch.Tensor) else w[role].dequantize()).float()
             for role in shapes}
    ref_w["gate_bias"] = views["gate_bias"]
    ref_w = assemble_views(ref_w)
    x = torch.randn(3, 64)
    with activations("f32"):
        y = expert_forward(spec, w, x)
    ref = expert_forward(spec, ref_w, x)
    assert torch.allclose(y, ref, rtol=1e-4, atol=1e-5 * ref.abs().max().item())  # fp32 sums of O(100) terms
    if fmt_name != "bf16":
        err = ((ref - expert_forward(spec, assemble_views(dense), x)).norm() / ref.norm()).item()
        print(f"{fmt_name}: expert output relative error vs fp32 weights {err:.4f}")


def test_assemble_errors():
    shapes = {"gate": (96, 64)}
    with pytest.raises(ValueError, match="missing part 'gate.scales'"):
        assemble_views({"gate.blocks": torch.zeros(96, 2, 16, dtype=torch.uint8)}, "q4", shapes)
    with pytest.raises(ValueError, match="dtype"):
        assemble_views({"gate.blocks": torch.zeros(96, 2, 16, dtype=torch.uint8),
                        "gate.scales": torch.zeros(96, 2, dtype=torch.float32)}, "q4", shapes)


def test_record_layout_offsets():
    shapes = {"gate": (96, 64), "up": (96, 64), "down": (64, 96)}
    entries, total = record_layout("q4", shapes, align=64)
    assert [e[0] for e in entries] == ["gate.blocks", "gate.scales", "up.blocks", "up.scales",
                                       "down.blocks", "down.scales"]
    end = 0
    for _name, off, dtype, shape in entries:
        assert off % 64 == 0 and off >= end
        end = off + dtype.itemsize * int(torch.Size(shape).numel())
    assert total == end
    assert total - FORMATS["q4"].nbytes(96, 64) * 2 - FORMATS["q4"].nbytes(64, 96) < 64 * len(entries)


def test_linear_accepts_quant_matrix():
    _, qm = quantized("q4", 37, 96)
    x, b = torch.randn(2, 96), torch.randn(37)
    assert torch.equal(linear(x, qm, b), qm.matmul(x, b))
    assert linear(x[0], qm).shape == (37,)


def test_cache_slot_assembles_quantized_records():
    """A quantized record in a cache slot comes out of ``ready()`` as QuantMatrix weights."""
    from sluice.experts.cache import ExpertCache
    from sluice.experts.layout import ExpertLayout, View
    from sluice.experts.policy import LRU

    spec = ExpertSpec(hidden=64, intermediate=96)
    shapes, views, _ = _expert_views("mxfp4", spec, seed=2)
    entries, total = record_layout("mxfp4", shapes)
    layout = ExpertLayout(reads=(), views=tuple(View(name, off, dtype, shape) for name, off, dtype, shape in entries),
                          slot_bytes=-(-total // 4096) * 4096, format="mxfp4",
                          shapes=tuple((role, n, k) for role, (n, k) in shapes.items()))
    cache = ExpertCache(2, layout.slot_bytes, LRU())
    slot = cache.allocate((0, 1), layout)
    for name, off, dtype, shape in entries:  # what a reader thread would have written
        cache.arena.tensor(cache.base(slot) + off, dtype, shape).copy_(views[name])
    cache.ready(slot)
    assert {"gate", "up", "down"} <= set(slot.weights)
    x = torch.randn(2, 64)
    for role in ("gate", "up", "down"):
        assert isinstance(slot.weights[role], QuantMatrix)
    ref = assemble_views(views, "mxfp4", shapes)
    assert torch.equal(expert_forward(spec, slot.weights, x), expert_forward(spec, ref, x))
