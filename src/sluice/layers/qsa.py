"""QSA: gated attention over the token blocks a block indexer selects (Qwen3.8-Flash-Next).

On ``qwen4_exp``'s attention layers an indexer picks, for every query, which earlier tokens it
attends over (transformers 5.24: ``Qwen4ExpTextQSAIndexer``):

- one linear ``index_qk_proj`` gives per token ``Hi`` index query heads and one raw index key
  (``Di`` floats each); the queries get a per-head (1 + w) RMSNorm and RoPE at their position;
- the raw keys of the positions a query sees are cut into complete blocks of ``r`` =
  ``indexer_compress_ratio`` consecutive tokens; a block's key is the mean of its raw keys,
  normalised ((1 + w) RMSNorm) and rotated at the block's first position;
- a block's score is ``sum_h relu(q_h . k_block) / sqrt(Di)``; the ``budget / r`` best blocks
  are kept, with the tokens of the incomplete last block always;
- attention (``GatedAttention``: sigmoid output gate, per-head norms, partial RoPE) runs over
  the kept tokens only. A query that sees ``budget / r`` complete blocks or fewer keeps every
  token: plain causal attention.

transformers computes a full attention whose scores outside the selection are masked; Sluice
gathers the kept keys and values instead (the same softmax: masked scores weigh exactly 0).
Block keys depend only on the block, so the cache keeps them once computed (``QSACache``)
and a decode step costs the scoring of L / r block keys plus attention over ``budget`` +
``r - 1`` tokens. Every query's selection and attention are computed on their own, so its
result does not depend on the chunk, batch or draft it runs in.

Shape legend: T query tokens, L positions, Hq query heads, Hkv key/value heads, D head dim,
Hi index heads, Di index head dim, r block length, B blocks.
"""

from __future__ import annotations

import math

import torch

from ..quant import linear
from .attention import KVCache, attend
from .gated_attention import GatedAttention
from .norm import RMSNorm
from .pointwise import pointwise
from .rotary import apply_rotary


class QSACache(KVCache):
    """Keys and values, the indexer's raw keys [L, Di] and the block keys computed so far
    [L / r, Di] (``blocks``: how many are still valid; a forward from position p drops those
    that reach p, since what follows p may be rewritten)."""

    def __init__(self, n_kv: int, max_ctx: int, head_dim: int, index_dim: int, ratio: int):
        super().__init__(n_kv, max_ctx, head_dim)
        self.raw = torch.empty(max_ctx, index_dim)
        self.block_keys = torch.empty(max(1, max_ctx // ratio), index_dim)
        self.blocks = 0

    @staticmethod
    def nbytes(n_kv: int, max_ctx: int, head_dim: int, index_dim: int, ratio: int) -> int:
        return KVCache.nbytes(n_kv, max_ctx, head_dim) + 4 * index_dim * (max_ctx + max(1, max_ctx // ratio))


class QSAIndexer:
    """``qk`` [(Hi + 1) * Di, H] (``index_qk_proj``), ``q_norm`` / ``k_norm`` [Di] ((1 + w) RMSNorms),
    ``budget`` tokens in blocks of ``ratio``."""

    def __init__(self, *, qk, q_norm: torch.Tensor, k_norm: torch.Tensor, n_heads: int, head_dim: int,
                 budget: int, ratio: int, eps: float):
        self.qk, self.n_heads, self.head_dim = qk, n_heads, head_dim
        self.q_norm = RMSNorm(q_norm, eps, offset=1.0)
        self.k_norm = RMSNorm(k_norm, eps, offset=1.0)
        self.budget, self.ratio = budget, ratio
        self.top_blocks = budget // ratio

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rotated, normalised index queries [T, Hi, Di], raw index keys [T, Di])."""
        t, hi, d = x.shape[0], self.n_heads, self.head_dim
        qk = linear(x, self.qk)
        q = apply_rotary(self.q_norm(qk[:, : hi * d].reshape(t, hi, d).contiguous()), cos, sin)
        return q, qk[:, hi * d :].contiguous()

    def update_blocks(self, cache: QSACache, start: int, end: int, cos_of) -> int:
        """Make the block keys of positions 0..end-1 current (``cos_of(positions)`` -> cos, sin);
        returns the number of complete blocks."""
        r = self.ratio
        cache.blocks = min(cache.blocks, start // r)
        n = end // r
        if n > cache.blocks:
            b0 = cache.blocks
            raw = cache.raw[b0 * r : n * r].view(n - b0, r, -1)
            pooled = self.k_norm(raw.mean(dim=1))
            cos, sin = cos_of(torch.arange(b0, n) * r)
            cache.block_keys[b0:n] = apply_rotary(pooled.unsqueeze(1), cos, sin).squeeze(1)
            cache.blocks = n
        return n

    def select(self, q: torch.Tensor, cache: QSACache, position: int) -> torch.Tensor | None:
        """The positions query ``q`` [Hi, Di] at ``position`` attends over, ascending; None: all of
        0..position (no more complete blocks than the budget keeps)."""
        r = self.ratio
        n = (position + 1) // r
        if n <= self.top_blocks:
            return None
        scores = torch.matmul(q, cache.block_keys[:n].t()).t()  # [B, Hi]
        scores = torch.relu(scores).sum(dim=-1) / math.sqrt(self.head_dim)
        kept = scores.topk(self.top_blocks, dim=0).indices.sort().values
        tokens = (kept.unsqueeze(1) * r + torch.arange(r)).reshape(-1)
        return torch.cat([tokens, torch.arange(n * r, position + 1)])


class QSAAttention(GatedAttention):
    """``GatedAttention`` whose queries attend over their indexer's selection (module docstring)."""

    def __init__(self, *, indexer: QSAIndexer, rotary, **kw):
        super().__init__(norm_offset=1.0, **kw)
        self.indexer = indexer
        self.rotary = rotary  # cos/sin at any positions (the block keys' first positions)

    def new_cache(self, max_ctx: int) -> QSACache:
        return QSACache(self.n_kv, max_ctx, self.head_dim, self.indexer.head_dim, self.indexer.ratio)

    def cache_bytes(self, max_ctx: int) -> int:
        return QSACache.nbytes(self.n_kv, max_ctx, self.head_dim, self.indexer.head_dim, self.indexer.ratio)

    def attend_segments(self, q, k, v, segs, iq=None, raw=None) -> torch.Tensor:
        outs = []
        for r0, r1, start, cache in segs:
            keys, values, _ = cache.update(start, k[r0:r1], v[r0:r1])
            end = start + (r1 - r0)
            cache.raw[start:end] = raw[r0:r1]
            self.indexer.update_blocks(cache, start, end, self.rotary.cos_sin)
            rows = []
            for i in range(r1 - r0):
                pos = start + i
                sel = self.indexer.select(iq[r0 + i], cache, pos)
                if sel is None:
                    rows.append(attend(q[r0 + i : r0 + i + 1], keys[:, : pos + 1], values[:, : pos + 1], pos,
                                       self.scale))
                else:
                    rows.append(attend(q[r0 + i : r0 + i + 1], keys[:, sel], values[:, sel], sel.numel() - 1,
                                       self.scale))
            outs.append(torch.cat(rows) if len(rows) > 1 else rows[0])
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def segments(self, x: torch.Tensor, segs, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        qg = linear(x, self.wq, self.bq).view(t, self.n_heads, 2 * d)
        q, gate = qg[..., :d], qg[..., d:].reshape(t, -1)
        k = linear(x, self.wk, self.bk).view(t, self.n_kv, d)
        v = linear(x, self.wv, self.bv).view(t, self.n_kv, d)
        q = apply_rotary(self.q_norm(q.contiguous()), cos, sin)
        k = apply_rotary(self.k_norm(k), cos, sin)
        iq, raw = self.indexer.project(x, cos, sin)
        o = self.attend_segments(q, k, v, segs, iq, raw)
        return linear(o.reshape(t, -1) * pointwise(torch.sigmoid, gate), self.wo, self.bo)


__all__ = ["QSAAttention", "QSACache", "QSAIndexer"]
