"""``sluice convert`` at speed: spine tensors streamed in bounded pieces (same bytes as whole
reads), and the C q4, mxfp4 and int8 quantizers (same bytes as their torch fallbacks, the
documented algorithms, on every instruction set the CPU has)."""

from __future__ import annotations

import hashlib
import json
import zlib

import pytest
import torch

import sluice.convert as conv
from sluice import kernels
from sluice.checkpoint import Checkpoint
from sluice.convert import convert
from sluice.quant import FORMATS, mxfp4, q4
from sluice.quant import cquant

needs_c = pytest.mark.skipif(not kernels.available(), reason="C kernels not built on this machine")


def _digests(box) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(box.iterdir()) if p.suffix == ".bin"}


def test_spine_streamed_in_bounded_pieces_is_byte_identical(model_dir, tmp_path, monkeypatch):
    src = model_dir("qwen3_moe")
    whole = convert(src, tmp_path / "whole.sluice", experts="bf16", progress=False)
    # expected spine.bin built independently from whole-tensor reads at the manifest's offsets
    manifest = json.loads((whole / "manifest.json").read_text())
    spine = (whole / "spine.bin").read_bytes()
    ck = Checkpoint(src)
    expect = bytearray(len(spine))
    for name, t in manifest["spine"]["tensors"].items():
        raw = ck.read(name).reshape(-1).view(torch.uint8).numpy().tobytes()
        expect[t["offset"] : t["offset"] + len(raw)] = raw
    ck.close()
    assert bytes(expect) == spine  # every byte between tensors is zero padding
    for g, (start, length, crc) in manifest["spine"]["groups"].items():
        assert zlib.crc32(spine[start : start + length]) == crc, g

    # pieces far smaller than the tensors (and not a multiple of their sizes): same files, and no
    # spine tensor is ever read whole
    biggest = max(ck.info(n).nbytes for n in manifest["spine"]["tensors"])
    monkeypatch.setattr(conv, "SPINE_CHUNK", 4096 * 3)
    assert biggest > 4 * conv.SPINE_CHUNK
    reads = []
    real_read = Checkpoint.read
    monkeypatch.setattr(Checkpoint, "read",
                        lambda self, name, out=None: reads.append(name) or real_read(self, name, out))
    pieces = convert(src, tmp_path / "pieces.sluice", experts="bf16", progress=False)
    assert not set(reads) & set(manifest["spine"]["tensors"])
    assert _digests(pieces) == _digests(whole)


def _q4_reference(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The q4 scale search written plainly (per-candidate levels kept), sums by torch's own order."""
    r, kp = w.shape
    wg = w.reshape(r, kp // 32, 32)
    m = wg.gather(-1, wg.abs().argmax(-1, keepdim=True))
    best = None
    for c in torch.linspace(-9.0, -6.5, 17).tolist():
        d = m / c
        q = torch.where(d != 0, (wg / torch.where(d != 0, d, 1.0)).round(), 0.0).clamp(-8, 7)
        qq = (q * q).sum(-1, keepdim=True)
        d = torch.where(qq > 0, (wg * q).sum(-1, keepdim=True) / qq.clamp_min(1e-30), 0.0)
        d = d.clamp(-65504, 65504).half().float()
        q = torch.where(d != 0, (wg / torch.where(d != 0, d, 1.0)).round(), 0.0).clamp(-8, 7)
        e = ((q * d - wg) ** 2).sum(-1, keepdim=True)
        if best is None:
            best = (e, q, d)
        else:
            better = e < best[0]
            best = (torch.where(better, e, best[0]), torch.where(better, q, best[1]), torch.where(better, d, best[2]))
    return q4.pack_nibbles(best[1] + 8), best[2].squeeze(-1).half()


def _matrix(rows: int, k: int, seed: int) -> torch.Tensor:
    w = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))
    w[0, :32] = 0.0  # an all-zero group
    w[1, :32] = 1e-44  # subnormal: the first scale underflows to 0
    w[2] *= 1e-30
    w[3, :32] = torch.tensor([0.5, -0.5, 1.5, 2.5] * 8)  # ties for round-half-even
    w[4] *= 1e6  # scales clamp at the f16 maximum
    return w


@needs_c
@pytest.mark.parametrize("shape", [(5, 32), (37, 96), (130, 256), (300, 1024)])
def test_q4_c_quantizer_equals_its_torch_fallback(shape, monkeypatch):
    w = _matrix(*shape, seed=shape[0])
    with_c = FORMATS["q4"].quantize(w)
    assert cquant._load() is not None
    monkeypatch.setattr(cquant, "_lib", False)  # as on a machine without the C kernels
    fallback = FORMATS["q4"].quantize(w)
    assert torch.equal(with_c["blocks"], fallback["blocks"])
    assert torch.equal(with_c["scales"].view(torch.int16), fallback["scales"].view(torch.int16))


def test_q4_matches_the_plain_algorithm_except_near_ties():
    """Only the order of the group sums differs from the plain form (a fixed tree instead of torch's
    SIMD order), so a group can differ only where two candidates' errors tie to within rounding."""
    w = _matrix(256, 1024, seed=7)
    got = FORMATS["q4"].quantize(w)
    ref_blocks, ref_scales = _q4_reference(w)
    differ = (got["blocks"] != ref_blocks).any(-1) | (got["scales"].view(torch.int16) != ref_scales.view(torch.int16))
    assert int(differ.sum()) <= differ.numel() // 1000
    err_got = (FORMATS["q4"].dequantize(got, *w.shape)[5:] - w[5:]).norm() / w[5:].norm()
    ref = {"blocks": ref_blocks, "scales": ref_scales}
    err_ref = (FORMATS["q4"].dequantize(ref, *w.shape)[5:] - w[5:]).norm() / w[5:].norm()
    assert abs(float(err_got) - float(err_ref)) < 1e-5


def test_q4_threads_do_not_change_bytes(monkeypatch):
    w = _matrix(200, 512, seed=3)
    monkeypatch.setattr(cquant, "threads", lambda: 1)
    one = FORMATS["q4"].quantize(w)
    monkeypatch.setattr(cquant, "threads", lambda: 3)
    three = FORMATS["q4"].quantize(w)
    assert torch.equal(one["blocks"], three["blocks"]) and torch.equal(one["scales"], three["scales"])


def _mx_matrix(rows: int, k: int, seed: int) -> torch.Tensor:
    """Random rows, then edge cases: zeros, subnormals, ties, huge values, every E2M1 value exactly,
    infs and NaNs (defined, not refused: see quant/mxfp4.py)."""
    w = _matrix(rows, k, seed)
    w[3, :32] *= 2.0**-3  # the tie pattern at the block's own scale: x.25 / x.75 boundaries
    w[5, :32] = torch.tensor(mxfp4.FP4_VALUES * 2) * 2.0**-127  # representable at the smallest scale (subnormals)
    w[6, :32] = torch.tensor(mxfp4.FP4_VALUES * 2) * 2.0**100
    w[7, :32] = 3.4e38  # the largest exponent: 4 * 2^(253 - 127) overflows, so 252 stays
    w[8, :32] = -0.0
    w[9, 3] = float("inf")
    w[10, 5] = float("nan")
    w[11, 0] = -float("inf")
    w[12, :32] = float("nan")
    w[13, :32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0] * 4) * torch.tensor([1.0, -1.0] * 16)
    return w


def _isa_levels():
    best = cquant.isa() if kernels.available() else None
    return [] if best is None else list(range(best + 1))


@pytest.fixture
def isa_level(request):
    yield cquant.isa(request.param)
    cquant.isa(99)  # back to the CPU's best


@needs_c
@pytest.mark.parametrize("isa_level", _isa_levels(), indirect=True)
@pytest.mark.parametrize("shape", [(16, 32), (37, 96), (130, 544), (64, 4096)])
def test_mxfp4_c_quantizer_equals_its_torch_fallback(shape, isa_level, monkeypatch):
    w = _mx_matrix(*shape, seed=shape[0])
    with_c = FORMATS["mxfp4"].quantize(w)
    monkeypatch.setattr(cquant, "_lib", False)
    fallback = FORMATS["mxfp4"].quantize(w)
    assert torch.equal(with_c["blocks"], fallback["blocks"]) and torch.equal(with_c["scales"], fallback["scales"])


@needs_c
@pytest.mark.parametrize("isa_level", _isa_levels(), indirect=True)
def test_q4_every_instruction_set_gives_the_same_bytes(isa_level, monkeypatch):
    w = _matrix(70, 800, seed=11)
    with_c = FORMATS["q4"].quantize(w)
    monkeypatch.setattr(cquant, "_lib", False)
    fallback = FORMATS["q4"].quantize(w)
    assert torch.equal(with_c["blocks"], fallback["blocks"])
    assert torch.equal(with_c["scales"].view(torch.int16), fallback["scales"].view(torch.int16))


@needs_c
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["q4", "mxfp4", "int8"])
def test_c_quantizers_widen_and_pad_in_c(name, dtype, monkeypatch):
    """bf16/f16 rows are read as stored (widened exactly in C) and a K that is not a multiple of 32
    is padded with zeros in C: the same bytes as widening and padding in torch first."""
    w = _mx_matrix(40, 200, seed=4).clamp(-6e4, 6e4).to(dtype)  # 200: the last group is 8 wide
    direct = FORMATS[name].quantize(w)
    monkeypatch.setattr(cquant, "_lib", False)
    fallback = FORMATS[name].quantize(w.float())
    for part in direct:
        assert torch.equal(direct[part].view(torch.uint8), fallback[part].view(torch.uint8)), part


def test_mxfp4_edge_cases_are_defined():
    fmt = FORMATS["mxfp4"]
    w = _mx_matrix(16, 32, seed=1)
    q = fmt.quantize(w)
    s = q["scales"][:, 0].tolist()
    assert s[0] == 0 and s[8] == 0  # zeros (and -0.0): exponent 0, codes 0
    assert q["blocks"][0].eq(0).all() and q["blocks"][8].eq(0).all()
    assert s[7] == 252  # floor(log2(3.4e38)) - 2 + 127: one more would overflow to inf
    assert s[9] == 124 and s[12] == 0  # inf: torch's frexp exponent 0; NaN: 0
    back = fmt.dequantize(q, 16, 32)
    assert torch.equal(back[5], w[5]) and torch.equal(back[6], w[6])  # representable: exact
    codes = q4.unpack_nibbles(q["blocks"][13]).reshape(-1)  # ties to the even code, signs kept
    assert codes[:8].tolist() == [0, 8 | 2, 2, 8 | 4, 4, 8 | 6, 6, 8 | 7]


def _mxfp4_reference(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The mxfp4 quantizer as before the C one (errors summed in torch's own order)."""
    r, kp = w.shape
    wg = w.reshape(r, kp // 32, 32)
    amax = wg.abs().amax(-1, keepdim=True)
    _, ex = torch.frexp(amax)
    biased = torch.where(amax > 0, ex - 3 + 127, torch.zeros_like(ex)).clamp(0, 254)
    best = None
    for extra in (0, 1):
        s = (biased + extra).clamp(0, 254)
        scale = mxfp4.e8m0_half(s) * 2
        codes = mxfp4.e2m1_codes(wg / scale)
        err = ((mxfp4._LUT[codes.long()] * scale - wg) ** 2).sum(-1, keepdim=True)
        if best is None:
            best = (err, codes, s)
        else:
            better = err < best[0]
            best = (torch.where(better, err, best[0]), torch.where(better, codes, best[1]),
                    torch.where(better, s, best[2]))
    return q4.pack_nibbles(best[1]), best[2].squeeze(-1).to(torch.uint8)


def test_mxfp4_matches_the_plain_algorithm_except_near_ties():
    w = _matrix(256, 1024, seed=9)
    got = FORMATS["mxfp4"].quantize(w)
    ref_blocks, ref_scales = _mxfp4_reference(w)
    differ = (got["blocks"] != ref_blocks).any(-1) | (got["scales"] != ref_scales)
    assert int(differ.sum()) <= differ.numel() // 1000


def _int8_reference(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 clipping search written plainly (each ratio's integers kept), as before the speed-up."""
    amax = w.abs().amax(1, keepdim=True)
    best = None
    for ratio in (1.0, 0.98, 0.96, 0.94, 0.92, 0.9, 0.88, 0.85, 0.82, 0.8):
        s = amax * ratio / 127.0
        q = (w / torch.where(s > 0, s, torch.ones_like(s))).round().clamp(-127, 127)
        err = ((q * s - w) ** 2).sum(1, keepdim=True)
        if best is None:
            best = (err, q, s)
        else:
            better = err < best[0]
            best = (torch.where(better, err, best[0]), torch.where(better, q, best[1]), torch.where(better, s, best[2]))
    return best[1].to(torch.int8), best[2].reshape(-1)


def test_int8_bytes_unchanged_by_the_speed_up():
    """The C quantizer (or the torch fallback) sums each row's error in a fixed order, the plain form
    in torch's SIMD order: they can differ only where two ratios tie to within rounding (none of
    125k N(0, 0.02) rows did, f32 and bf16, K 768 / 2048 / 5000), so these rows are the same."""
    w = _matrix(64, 1000, seed=5)
    w[6, :3] = float("inf")
    w[7, 9] = float("nan")
    got = FORMATS["int8"].quantize(w)
    ref_q, ref_s = _int8_reference(w)
    assert torch.equal(got["weight"][:, :1000], ref_q)
    assert torch.equal(got["scales"].view(torch.int32), ref_s.view(torch.int32))


def _int8_matrix(rows: int, k: int, seed: int) -> torch.Tensor:
    """Random rows, then edge cases: zeros, -0.0, rounding ties, a scale that underflows to 0,
    huge values (the squared errors overflow to inf), infs and NaNs (defined: see quant/int8.py)."""
    w = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))
    w[0] = 0.0
    w[1] *= 1e-40  # subnormals
    w[2] *= 1e6
    w[4] = -0.0
    w[5] = torch.arange(k) % 255 - 127.5  # halves
    w[6] = torch.arange(k) % 255 - 127.0  # integers with amax 127 (scale 1.0 at ratio 1), then ties
    ties = torch.tensor([0.5, 1.5, 2.5, -1.5])[: max(0, k - 1)]
    w[6, k - len(ties) :] = ties
    w[7] = 1e-45  # amax / 127 underflows to 0: divided by 1
    w[8] *= 3.0e38 / w[8].abs().max()  # errors overflow to inf for every ratio: the first wins
    w[9, : min(k, 3)] = float("inf")
    w[10, k // 2] = float("nan")
    w[11, 0] = -float("inf")
    w[12] = float("nan")
    w[13, -1] = float("inf")
    w[13, 0] = float("nan")
    return w


def _same_int8(a: dict, b: dict) -> bool:
    return torch.equal(a["weight"], b["weight"]) and torch.equal(a["scales"].view(torch.int32),
                                                                 b["scales"].view(torch.int32))


@needs_c
@pytest.mark.parametrize("isa_level", _isa_levels(), indirect=True)
@pytest.mark.parametrize("shape", [(16, 1), (16, 31), (37, 96), (130, 544), (24, 4100)])
def test_int8_c_quantizer_equals_its_torch_fallback(shape, isa_level, monkeypatch):
    w = _int8_matrix(*shape, seed=shape[0] + shape[1])
    with_c = FORMATS["int8"].quantize(w)
    monkeypatch.setattr(cquant, "_lib", False)
    assert _same_int8(with_c, FORMATS["int8"].quantize(w))


def test_int8_edge_cases_are_defined():
    fmt = FORMATS["int8"]
    w = _int8_matrix(16, 64, seed=2)
    q = fmt.quantize(w)
    s, bits = q["scales"], q["scales"].view(torch.int32)
    assert s[0] == 0 and s[7] == 0 and q["weight"][[0, 4, 7]].eq(0).all()  # zeros, -0.0, underflow: 0
    assert bits[8] == (w[8].abs().max() * 1.0 / 127.0).view(torch.int32)  # inf errors: the first ratio
    assert s[9] == float("inf") and s[11] == float("inf") and q["weight"][[9, 11]].eq(0).all()
    assert int(bits[10]) == int(bits[12]) == int(bits[13]) == 0x7FC00000  # NaN: the canonical NaN
    assert q["weight"][12].eq(0).all()  # a NaN level is 0; a NaN row keeps round(w / 1) elsewhere
    assert torch.equal(q["weight"][10, :5], w[10, :5].round().clamp(-127, 127).to(torch.int8))
    assert s[6] == 1.0 and q["weight"][6, -4:].tolist() == [0, 2, 2, -2]  # ties to even
    back = fmt.dequantize(q, 16, 64)
    assert back[[10, 12, 13]].isnan().all()  # non-finite rows stay visibly broken


@needs_c
def test_int8_threads_do_not_change_bytes(monkeypatch):
    w = _int8_matrix(200, 512, seed=3)
    monkeypatch.setattr(cquant, "threads", lambda: 1)
    one = FORMATS["int8"].quantize(w)
    monkeypatch.setattr(cquant, "threads", lambda: 3)
    assert _same_int8(one, FORMATS["int8"].quantize(w))


# ---------------------------------------------------------------------------- rvq3 in C -----


@needs_c
@pytest.mark.parametrize("isa_level", _isa_levels(), indirect=True)
def test_rvq3_c_quantizer_same_bytes_on_every_instruction_set(isa_level):
    w = torch.randn(96, 520, generator=torch.Generator().manual_seed(2))  # 520: padded to 528
    got = FORMATS["rvq3"].quantize(w, seed=3)
    cquant.isa(99)
    best = FORMATS["rvq3"].quantize(w, seed=3)
    assert torch.equal(got["codes"], best["codes"]) and torch.equal(got["codebooks"], best["codebooks"])
    err = (FORMATS["rvq3"].dequantize(got, 96, 520) - w).norm() / w.norm()
    assert err < 0.2


@needs_c
def test_rvq3_c_quantizer_sampled_and_edge_cases():
    fmt = FORMATS["rvq3"]
    small = type(fmt)(sample=2000)  # 5120 subvectors: k-means fits a sample, all are assigned
    w = torch.randn(80, 512, generator=torch.Generator().manual_seed(4))
    q = small.quantize(w)
    assert (small.dequantize(q, 80, 512) - w).norm() / w.norm() < 0.25
    assert torch.equal(q["codes"], small.quantize(w)["codes"])  # deterministic
    # fewer subvectors than centroids: each is its own centroid (exact up to f16), the rest zeros
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(5))
    q = fmt.quantize(w)
    assert (fmt.dequantize(q, 4, 64) - w).abs().max() < 1e-2
    # all zeros, and all subvectors equal: no division by zero, exact
    for w in (torch.zeros(32, 64), torch.ones(32, 64)):
        q = fmt.quantize(w)
        assert torch.equal(fmt.dequantize(q, 32, 64), w)


@needs_c
def test_rvq3_parallel_matrices_give_the_same_container(model_dir, tmp_path, monkeypatch):
    """convert quantizes an expert's three matrices on several threads: the same bytes as one at a time."""
    src = model_dir("qwen3_moe")
    par = convert(src, tmp_path / "par.sluice", experts="rvq3", progress=False)
    monkeypatch.setattr(FORMATS["rvq3"], "threads_per_matrix", 0)
    seq = convert(src, tmp_path / "seq.sluice", experts="rvq3", progress=False)
    assert _digests(par) == _digests(seq)


def test_rvq3_torch_fallback_still_quantizes(monkeypatch):
    monkeypatch.setattr(cquant, "_lib", False)
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(6))
    q = FORMATS["rvq3"].quantize(w, seed=1)
    assert (FORMATS["rvq3"].dequantize(q, 64, 256) - w).norm() / w.norm() < 0.2
    assert torch.equal(q["codes"], FORMATS["rvq3"].quantize(w, seed=1)["codes"])
