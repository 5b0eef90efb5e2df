"""kernels/norm.c: RMSNorm and rotary embeddings in C, the same bits on every path.

RMSNorm's sum of squares has one order (lane i mod 32, kernels/norm.c): each instruction-set
level the host has, and the portable path (level 0), give the AVX2 level's bits, for a whole
batch and for its rows one at a time (batch invariance), with and without the fused residual
add (whose sum is torch's ``x + res`` bit for bit). Rotary equals torch's
``x * cos + rotate_half(x) * sin`` bit for bit on every level, signed zeros included.
"""

from __future__ import annotations

import pytest
import torch

import sluice  # noqa: F401
from conftest import at_level
from sluice import kernels
from sluice.layers import norm as norm_mod
from sluice.layers.norm import RMSNorm
from sluice.layers.rotary import apply_rotary, rotate_half

pytestmark = pytest.mark.skipif(not kernels.norm_available(), reason="C kernels not built on this machine")

# the portable path (0) and every level the host has; 1 (AVX2) is the reference
PATHS = [0] + kernels.isa_levels()


@pytest.mark.parametrize("d", [5, 33, 64, 67, 1024, 2056])
def test_rmsnorm_every_path_and_row_count(d):
    g = torch.Generator().manual_seed(d)
    x = torch.randn(9, d, generator=g) * 3
    res = torch.randn(9, d, generator=g)
    w = torch.randn(d, generator=g)
    ref = at_level(1, lambda: kernels.rmsnorm(x, w, 1e-6))
    ref_h, ref_add = at_level(1, lambda: kernels.rmsnorm(x, w, 1e-6, res))
    assert torch.equal(ref_h, x + res)
    for level in PATHS:
        name = kernels.ISA_LEVELS[level]
        assert torch.equal(at_level(level, lambda: kernels.rmsnorm(x, w, 1e-6)), ref), name
        rows = at_level(level, lambda: torch.cat([kernels.rmsnorm(x[i : i + 1], w, 1e-6) for i in range(9)]))
        assert torch.equal(rows, ref), (name, "one row at a time")
        h, y = at_level(level, lambda: kernels.rmsnorm(x, w, 1e-6, res))
        assert torch.equal(h, ref_h) and torch.equal(y, ref_add), name
        assert torch.equal(y, at_level(level, lambda: kernels.rmsnorm(x + res, w, 1e-6))), (name, "add then norm")
    # the formula: torch's, up to the order of the sum of squares
    want = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(ref, want, rtol=2e-6, atol=1e-6)


def test_rmsnorm_module_matches_torch_form(monkeypatch):
    """``RMSNorm`` uses the kernel on 2-D and 3-D inputs (per-head norms), and the torch form
    without it; ``add`` is the add then the norm."""
    g = torch.Generator().manual_seed(0)
    n = RMSNorm(torch.randn(64, generator=g).to(torch.bfloat16), 1e-5, offset=1.0)
    x = torch.randn(3, 4, 64, generator=g)
    r = torch.randn(3, 4, 64, generator=g)
    c = n(x)
    h, cr = n.add(x, r)
    assert c.shape == x.shape and torch.equal(h, x + r) and torch.equal(cr, n(x + r))
    assert torch.equal(c[1:2], n(x[1:2]))
    monkeypatch.setattr(kernels._lib, "norm", False)
    t = n(x)
    torch.testing.assert_close(c, t, rtol=2e-6, atol=1e-6)
    h2, t2 = n.add(x, r)
    assert torch.equal(h2, h) and torch.equal(t2, n(x + r))
    assert norm_mod.RMSNorm is RMSNorm


@pytest.mark.parametrize("t,h,dh,d", [(1, 16, 64, 64), (5, 4, 64, 32), (3, 2, 128, 100), (7, 3, 20, 6)])
def test_rope_equals_torch_form_every_path(t, h, dh, d):
    g = torch.Generator().manual_seed(dh + d)
    x = torch.randn(t, h, dh, generator=g)
    x[0, 0, :4] = torch.tensor([0.0, -0.0, 0.0, -0.0])
    cos, sin = torch.randn(t, d, generator=g), torch.randn(t, d, generator=g)
    cos[0, :4] = torch.tensor([-0.0, 0.0, 1.0, -1.0])
    c, s = cos[:, None, :], sin[:, None, :]
    rot, rest = x[..., :d], x[..., d:]
    want = torch.cat((rot * c + rotate_half(rot) * s, rest), dim=-1)
    for level in PATHS:
        got = at_level(level, lambda: apply_rotary(x, cos, sin))
        assert torch.equal(got, want), kernels.ISA_LEVELS[level]
        assert torch.equal(torch.signbit(got), torch.signbit(want)), (kernels.ISA_LEVELS[level], "signed zeros")
    # a strided input (MLA rotates a slice of its heads) gives the same bits
    wide = torch.cat([torch.randn(t, h, 8, generator=g), x], dim=-1)
    assert torch.equal(apply_rotary(wide[..., 8:], cos, sin), want)
