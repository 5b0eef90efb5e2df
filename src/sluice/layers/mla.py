"""Multi-head Latent Attention (DeepSeek-V2/V3, Kimi K2) with a compressed latent cache.

Per token: ``c = kv_a_proj_with_mqa(x)`` splits into a latent ``kv`` [R] (RMS-normalised)
and one shared rope key ``k_pe`` [Dr]; ``kv_b_proj`` [H * (Dn + Dv), R] expands the latent
into each head's no-rope key [Dn] and value [Dv]. Queries come from ``q_proj`` or the
low-rank ``q_b(norm(q_a(x)))`` and split into no-rope [Dn] and rope [Dr] parts.

The cache holds only ``[kv | k_pe]`` per position (R + Dr floats per layer, e.g. 576 for
DeepSeek-V3 instead of 2 * 128 * 192 for full K/V); truncating it is free.

Two exact-in-real-arithmetic ways to attend (they differ by fp32 rounding only):

- *naive*: expand K/V of every cached position with ``kv_b_proj``, then ordinary attention.
  Cheapest for a prefill that starts from an empty cache.
- *absorbed*: fold ``kv_b_proj`` into the query and the output: ``q_lat = q_nope @ W_uk[h]``
  [R] per head, attend over the latent cache as multi-query attention with one key/value
  head of dim R + Dr / R, then ``o = o_lat @ W_uv[h]^T``. Each step costs O(R) per cached
  position instead of expanding all of them: the decode path.

``MLA`` picks the cheaper one per call (``absorb=None``), bounded in memory either way; with
batch-invariant kernels (the default) it always absorbs (unless told otherwise) and computes
each head's products with the C kernels, so a token's output does not depend on the chunk.

Shape legend: T query tokens, L cached positions, H heads, R kv_lora_rank, Dn/Dr/Dv the
no-rope, rope and value head dims.
"""

from __future__ import annotations

import torch

from ..kernels.backend import cpu
from ..quant import linear, linear_t
from ..quant.fp8 import BlockFP8, matrix_rows
from .attention import attend
from .norm import RMSNorm
from .rotary import apply_rotary

# Bounds on transient fp32 tensors: expanded K/V (naive), fp32 rows of kv_b_proj that are
# not stored in fp32 (absorbed), per-block query latents (absorbed).
EXPAND_BYTES = 32 << 20
WEIGHT_BLOCK_BYTES = 16 << 20
LATENT_BLOCK_BYTES = 32 << 20
FUSED_TOKENS = 8  # up to this many queries, an FP8 kv_b_proj is used in place (fused per-head kernels)


class LatentCache:
    """``ckv`` [max_ctx, R + Dr] fp32: the normalised latent then the rotated rope key, per position.

    Allocated once with ``torch.empty`` (pages become resident as positions are written);
    the length lives in the model state, so truncating is free, as for ``KVCache``.
    """

    def __init__(self, max_ctx: int, rank: int, rope_dim: int):
        self.rank = rank
        self.ckv = torch.empty(max_ctx, rank + rope_dim)

    @staticmethod
    def nbytes(max_ctx: int, rank: int, rope_dim: int) -> int:
        return 4 * max_ctx * (rank + rope_dim)

    def write(self, start: int, kv: torch.Tensor, k_pe: torch.Tensor) -> None:
        """kv [T, R], k_pe [T, Dr] for positions start .. start+T-1."""
        t = kv.shape[0]
        self.ckv[start : start + t, : self.rank] = kv
        self.ckv[start : start + t, self.rank :] = k_pe


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs (x0, x1), (x2, x3), ...: the output holds the rotated even
    elements then the rotated odd ones (the layout transformers' ``rope_interleave`` gives;
    queries and keys share it, so dot products are those of the pairwise rotation).

    x [T, H, D]; cos/sin [T, D] as ``Rotary.cos_sin`` returns them (cat(freqs, freqs)).
    """
    d = x.shape[-1]
    c, s = cos[:, None, : d // 2], sin[:, None, : d // 2]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


class MLA:
    """Multi-head Latent Attention. Weights may be tensors or format wrappers (``quant.fp8``).

    ``absorb``: None picks per call; True/False force the absorbed/naive form (tests, bench).
    """

    def __init__(
        self,
        *,
        wkv_a,
        kv_a_norm: torch.Tensor,
        wkv_b,
        wo,
        n_heads: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        scale: float,
        wq=None,
        wq_a=None,
        q_a_norm: torch.Tensor | None = None,
        wq_b=None,
        bq_a: torch.Tensor | None = None,
        bkv_a: torch.Tensor | None = None,
        bo: torch.Tensor | None = None,
        interleave: bool = True,
        norm_eps: float = 1e-6,
        absorb: bool | None = None,
    ):
        if (wq is None) == (wq_a is None):
            raise ValueError("MLA needs either q_proj or q_a_proj + q_b_proj")
        self.wq, self.wq_a, self.wq_b, self.bq_a = wq, wq_a, wq_b, bq_a
        self.q_a_norm = RMSNorm(q_a_norm, norm_eps) if q_a_norm is not None else None
        self.wkv_a, self.bkv_a, self.wkv_b, self.wo, self.bo = wkv_a, bkv_a, wkv_b, wo, bo
        self.kv_a_norm = RMSNorm(kv_a_norm, norm_eps)
        self.h, self.rank = n_heads, kv_lora_rank
        self.dn, self.dr, self.dv = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.scale = scale
        self.interleave = interleave
        self.absorb = absorb
        self._w_heads = None
        if isinstance(wkv_b, torch.Tensor) and wkv_b.dtype == torch.float32:
            self._w_heads = wkv_b.view(self.h, self.dn + self.dv, self.rank)  # a view: no copy

    def new_cache(self, max_ctx: int) -> LatentCache:
        return LatentCache(max_ctx, self.rank, self.dr)

    def cache_bytes(self, max_ctx: int) -> int:
        return LatentCache.nbytes(max_ctx, self.rank, self.dr)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.dr == 0:  # no rope sub-head (GLM-5.3-Flash): nothing to rotate
            return x
        return apply_rotary_interleaved(x, cos, sin) if self.interleave else apply_rotary(x, cos, sin)

    def use_absorbed(self, t: int, end: int) -> bool:
        """Whether a call with ``t`` queries over ``end`` positions runs absorbed (cost model)."""
        if self.absorb is not None:
            return self.absorb
        if cpu.batch_invariant():  # one way for every chunk size (the decode one)
            return True
        h, r, dn, dr, dv = self.h, self.rank, self.dn, self.dr, self.dv
        if 4 * end * h * (dn + dr + dv) > EXPAND_BYTES:
            return True
        naive = end * r * h * (dn + dv) + t * end * h * (dn + dr + dv)
        absorbed = t * h * r * (dn + dv) + t * end * h * (2 * r + dr)
        return absorbed < naive

    def __call__(self, x: torch.Tensor, start: int, cache: LatentCache, cos: torch.Tensor,
                 sin: torch.Tensor) -> torch.Tensor:
        return self.segments(x, [(0, x.shape[0], start, cache)], cos, sin)

    def segments(self, x: torch.Tensor, segs: list[tuple[int, int, int, LatentCache]], cos: torch.Tensor,
                 sin: torch.Tensor) -> torch.Tensor:
        """Rows of several sequences (first row, end row, start position, cache): projections on all
        rows at once, attention per sequence over its own latent cache."""
        t = x.shape[0]
        if self.wq is not None:
            q = linear(x, self.wq)
        else:
            q = linear(self.q_a_norm(linear(x, self.wq_a, self.bq_a)), self.wq_b)
        q = q.view(t, self.h, self.dn + self.dr)
        q_nope, q_pe = q[..., : self.dn], self._rope(q[..., self.dn :], cos, sin)
        c = linear(x, self.wkv_a, self.bkv_a)
        kv = self.kv_a_norm(c[:, : self.rank])
        k_pe = self._rope(c[:, None, self.rank :], cos, sin)[:, 0]
        outs = []
        for r0, r1, start, cache in segs:
            cache.write(start, kv[r0:r1], k_pe[r0:r1])
            end = start + r1 - r0
            if self.use_absorbed(r1 - r0, end):
                outs.append(self._absorbed(q_nope[r0:r1], q_pe[r0:r1], cache.ckv[:end], start))
            else:
                outs.append(self._naive(q_nope[r0:r1], q_pe[r0:r1], cache.ckv[:end], start))
        o = outs[0] if len(outs) == 1 else torch.cat(outs)
        return linear(o.reshape(t, self.h * self.dv), self.wo, self.bo)

    # -- naive: expand K/V --------------------------------------------------------------------

    def _naive(self, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv: torch.Tensor, start: int) -> torch.Tensor:
        n = ckv.shape[0]
        h, dn, dr = self.h, self.dn, self.dr
        kvb = linear(ckv[:, : self.rank], self.wkv_b).view(n, h, dn + self.dv)  # [L, H, Dn + Dv]
        k = torch.empty(h, n, dn + dr)
        k[..., :dn] = kvb[..., :dn].transpose(0, 1)
        k[..., dn:] = ckv[None, :, self.rank :]
        v = kvb[..., dn:].transpose(0, 1)  # [H, L, Dv]
        q = torch.cat([q_nope, q_pe], dim=-1)  # [T, H, Dn + Dr]
        return attend(q, k, v, start, self.scale)

    # -- absorbed: attend over the latent -------------------------------------------------------

    def _head_blocks(self):
        """(h0, h1, W [h1 - h0, Dn + Dv, R] fp32) over the heads, in bounded blocks."""
        if self._w_heads is not None:
            yield 0, self.h, self._w_heads
            return
        per_head = self.dn + self.dv
        step = max(1, WEIGHT_BLOCK_BYTES // (4 * per_head * self.rank))
        for h0 in range(0, self.h, step):
            h1 = min(self.h, h0 + step)
            w = matrix_rows(self.wkv_b, h0 * per_head, h1 * per_head)
            yield h0, h1, w.view(h1 - h0, per_head, self.rank)

    def _absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv: torch.Tensor, start: int) -> torch.Tensor:
        """Heads are independent given the shared latent: each block of heads (one fp32 block of
        kv_b_proj rows when it is not stored in fp32) absorbs, attends and projects out in turn.
        A few tokens over an FP8 kv_b_proj use fused per-head kernels instead (no fp32 copy)."""
        t = q_nope.shape[0]
        if self._fused(t) or cpu.batch_invariant():
            return self._absorbed_rows(q_nope, q_pe, ckv, start)
        r, dn = self.rank, self.dn
        out = torch.empty(t, self.h, self.dv)
        for h0, h1, w in self._head_blocks():
            hb = h1 - h0
            block = max(1, LATENT_BLOCK_BYTES // (4 * hb * (2 * r + self.dr)))
            for b0 in range(0, t, block):
                b1 = min(t, b0 + block)
                q = torch.empty(b1 - b0, hb, r + self.dr)  # [Tb, Hb, R + Dr]: latent query then rope query
                # q_lat[t, h] = q_nope[t, h] @ W_uk[h]  ([Dn] x [Dn, R])
                q[..., :r] = torch.matmul(q_nope[b0:b1, h0:h1].transpose(0, 1), w[:, :dn]).transpose(0, 1)
                q[..., r:] = q_pe[b0:b1, h0:h1]
                o_lat = attend(q, ckv[None], ckv[None, :, :r], start + b0, self.scale)  # [Tb, Hb, R]
                # o[t, h] = o_lat[t, h] @ W_uv[h]^T  ([R] x [R, Dv])
                o = torch.matmul(o_lat.transpose(0, 1), w[:, dn:].transpose(1, 2))
                out[b0:b1, h0:h1] = o.transpose(0, 1)
        return out

    def _absorbed_rows(self, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv: torch.Tensor, start: int) -> torch.Tensor:
        """The absorbed form on batch-invariant kernels or fused FP8 kernels: per head, ``q_nope @ W_uk[h]``
        (input-major [Dn, R]) and ``o_lat @ W_uv[h]^T`` (output-major [Dv, R]), each row on its own."""
        q = self.latent_queries(q_nope, q_pe)
        o_lat = attend(q, ckv[None], ckv[None, :, : self.rank], start, self.scale)  # [T, H, R]
        return self.latent_out(o_lat)

    def _fused(self, t: int) -> bool:
        return isinstance(self.wkv_b, BlockFP8) and (t <= FUSED_TOKENS or cpu.batch_invariant())

    def latent_queries(self, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
        """The absorbed queries [T, H, R + Dr]: ``q_nope[t, h] @ W_uk[h]`` then the rope query. Fused
        per-head kernels over an FP8 kv_b_proj, per-head rows on batch-invariant kernels, else one
        product per block of heads (each row's result independent of the other rows on the first two)."""
        t, r, dn = q_nope.shape[0], self.rank, self.dn
        q = torch.empty(t, self.h, r + self.dr)
        q[..., r:] = q_pe
        if self._fused(t):
            q[..., :r] = self.wkv_b.heads_t(q_nope, 0, self.dn + self.dv)
            return q
        invariant = cpu.batch_invariant()
        for h0, h1, w in self._head_blocks():
            if invariant:
                for h in range(h0, h1):
                    q[:, h, :r] = linear_t(q_nope[:, h], w[h - h0, :dn])
            else:
                q[:, h0:h1, :r] = torch.matmul(q_nope[:, h0:h1].transpose(0, 1), w[:, :dn]).transpose(0, 1)
        return q

    def latent_out(self, o_lat: torch.Tensor) -> torch.Tensor:
        """Each head's value output [T, H, Dv] from its latent output [T, H, R]: ``o_lat[t, h] @ W_uv[h]^T``
        (the same three ways as ``latent_queries``)."""
        t, dn = o_lat.shape[0], self.dn
        if self._fused(t):
            return self.wkv_b.heads(o_lat, dn, dn + self.dv, self.dv)
        out = torch.empty(t, self.h, self.dv)
        invariant = cpu.batch_invariant()
        for h0, h1, w in self._head_blocks():
            if invariant:
                for h in range(h0, h1):
                    out[:, h] = linear(o_lat[:, h], w[h - h0, dn:])
            else:
                out[:, h0:h1] = torch.matmul(o_lat[:, h0:h1].transpose(0, 1), w[:, dn:].transpose(1, 2)).transpose(0, 1)
        return out
