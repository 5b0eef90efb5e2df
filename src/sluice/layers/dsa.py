"""DeepSeek sparse attention: Multi-head Latent Attention over the positions an indexer selects.

``SparseMLA`` is ``layers.mla.MLA`` whose queries that see more than ``topk`` positions attend
only over the ``topk`` ones the lightning indexer (``layers/indexer.py``) keeps for them; a
query that sees ``topk`` or fewer attends over all of them, as plain MLA. transformers 5.24
(DeepSeek-V3.2, GLM-5) computes the same thing as a full attention whose scores outside the
selection are masked to the dtype's minimum (their softmax weight is exactly 0); Sluice
gathers the selected latents instead, so a decode step costs O(topk) in attention (plus the
indexer's O(L) scoring over D-float keys) whatever the context length.

A layer with its own indexer keeps ``IndexedLatentCache``: the latent cache plus the indexer's
keys (R + Dr + D floats per position; a pooled indexer's 2 D, and D per complete pool); GLM-5's
``"shared"`` layers have no indexer and reuse the selection of the previous ``"full"`` layer for
the same rows (``SharedLatentCache``: a latent cache linked to that layer's state of the same
sequence, ``link``). Both truncate for free, as a KV cache: rewinding, prefix reuse and rejected
drafts need nothing (a pooled indexer's cached pools are dropped by the next write past the cut:
``PooledKeys``), and each sequence of a batch has its own.

With batch-invariant kernels every step of a query (its absorbed latent query, its scores and
selection, its attention over the gathered latents, its output) is computed on its own, so its
result is bit-identical whatever chunk, batch or speculative draft it is computed in.

Shape legend: T query tokens, L positions, H heads, R kv_lora_rank, Dr rope dim, K topk.
"""

from __future__ import annotations

import torch

from ..quant import linear
from .attention import attend
from .indexer import IndexKeys, LightningIndexer
from .mla import LATENT_BLOCK_BYTES, MLA, LatentCache


class IndexedLatentCache(LatentCache):
    """The latent cache of a layer with its own indexer, the indexer's keys (``indexer.new_keys``:
    ``IndexKeys``, or ``PooledKeys`` with the complete pools' keys), and the selection its last
    forward made (``selected``: (start, rows, per-row selections), read by shared layers)."""

    def __init__(self, max_ctx: int, rank: int, rope_dim: int, indexer: LightningIndexer):
        super().__init__(max_ctx, rank, rope_dim)
        self.index: IndexKeys = indexer.new_keys(max_ctx)
        self.selected: tuple[int, int, list] | None = None


class SharedLatentCache(LatentCache):
    """The latent cache of a layer that reuses layer ``source``'s selection (GLM-5's ``"shared"``
    indexer layers); ``link(states)`` points it at that layer's state of the same sequence."""

    def __init__(self, max_ctx: int, rank: int, rope_dim: int, source: int):
        super().__init__(max_ctx, rank, rope_dim)
        self.source_layer = source
        self.source: IndexedLatentCache | None = None

    def link(self, states: list) -> None:
        src = states[self.source_layer]
        if not isinstance(src, IndexedLatentCache):
            raise TypeError(f"layer {self.source_layer} keeps no indexer state to share")
        self.source = src

    def selection(self, start: int, rows: int) -> list:
        got = self.source.selected if self.source is not None else None
        if got is None or got[0] != start or got[1] != rows:
            raise RuntimeError(f"shared DSA layer: layer {self.source_layer} selected no positions for rows "
                               f"{start}..{start + rows - 1} in this forward")
        return got[2]


class SparseMLA(MLA):
    """MLA with DeepSeek sparse attention. ``indexer``: this layer's (``LightningIndexer``), or None
    with ``source``: the earlier layer whose selection it reuses. Always a low-rank query
    (``wq_a``/``wq_b``): the indexer reads its normalised latent."""

    def __init__(self, *, indexer: LightningIndexer | None = None, source: int | None = None, **mla):
        super().__init__(**mla)
        if (indexer is None) == (source is None):
            raise ValueError("SparseMLA needs either its own indexer or the layer whose selection it shares")
        if self.wq_a is None:
            raise ValueError("SparseMLA needs the low-rank query (q_a_proj + q_b_proj): the indexer reads it")
        self.indexer, self.source = indexer, source

    def new_cache(self, max_ctx: int) -> LatentCache:
        if self.indexer is None:
            return SharedLatentCache(max_ctx, self.rank, self.dr, self.source)
        return IndexedLatentCache(max_ctx, self.rank, self.dr, self.indexer)

    def cache_bytes(self, max_ctx: int) -> int:
        extra = self.indexer.keys_bytes(max_ctx) if self.indexer is not None else 0
        return super().cache_bytes(max_ctx) + extra

    def segments(self, x: torch.Tensor, segs: list, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rows of several sequences (first row, end row, start position, cache): projections and the
        indexer's keys and queries on all rows at once; selection and attention per sequence."""
        t = x.shape[0]
        q_resid = self.q_a_norm(linear(x, self.wq_a, self.bq_a))
        q = linear(q_resid, self.wq_b).view(t, self.h, self.dn + self.dr)
        q_nope, q_pe = q[..., : self.dn], self._rope(q[..., self.dn :], cos, sin)
        c = linear(x, self.wkv_a, self.bkv_a)
        kv = self.kv_a_norm(c[:, : self.rank])
        k_pe = self._rope(c[:, None, self.rank :], cos, sin)[:, 0]
        ix = self.indexer
        if ix is not None:
            keys = ix.keys(x, cos, sin)
            iq = iw = None
            if any(ix.needs(start, r1 - r0) for r0, r1, start, _ in segs):
                iq, iw = ix.queries(q_resid, x, cos, sin)
        outs = []
        for r0, r1, start, cache in segs:
            cache.write(start, kv[r0:r1], k_pe[r0:r1])
            n, end = r1 - r0, start + r1 - r0
            if ix is not None:
                cache.index.write(start, keys[r0:r1])
                sel = ix.select_cached(iq[r0:r1], iw[r0:r1], cache.index, start) if ix.needs(start, n) \
                    else [None] * n
                cache.selected = (start, n, sel)
            else:
                sel = cache.selection(start, n)
            if sel[-1] is None:  # every query sees topk positions or fewer: plain MLA
                if self.use_absorbed(n, end):
                    outs.append(self._absorbed(q_nope[r0:r1], q_pe[r0:r1], cache.ckv[:end], start))
                else:
                    outs.append(self._naive(q_nope[r0:r1], q_pe[r0:r1], cache.ckv[:end], start))
            else:
                outs.append(self._sparse(q_nope[r0:r1], q_pe[r0:r1], cache.ckv[:end], start, sel))
        o = outs[0] if len(outs) == 1 else torch.cat(outs)
        return linear(o.reshape(t, self.h * self.dv), self.wo, self.bo)

    def _sparse(self, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv: torch.Tensor, start: int, sel: list
                ) -> torch.Tensor:
        """The absorbed form, each query over its own positions: the first queries (``sel`` None: they
        see topk positions or fewer) causally over all they see, the others over their selection's
        gathered latents [K, R + Dr]. In blocks of queries, so the latent queries stay bounded."""
        t, r = q_nope.shape[0], self.rank
        out = torch.empty(t, self.h, self.dv)
        block = max(1, LATENT_BLOCK_BYTES // (4 * self.h * (2 * r + self.dr)))
        for b0 in range(0, t, block):
            b1 = min(t, b0 + block)
            q = self.latent_queries(q_nope[b0:b1], q_pe[b0:b1])  # [Tb, H, R + Dr]
            o_lat = torch.empty(b1 - b0, self.h, r)
            dense = sum(s is None for s in sel[b0:b1])  # a prefix of the block
            if dense:
                e = start + b0 + dense
                o_lat[:dense] = attend(q[:dense], ckv[None, :e], ckv[None, :e, :r], start + b0, self.scale)
            for i in range(b0 + dense, b1):
                picked = ckv[sel[i]]  # [K, R + Dr], ascending positions
                o_lat[i - b0] = attend(q[i - b0 : i - b0 + 1], picked[None], picked[None, :, :r], picked.shape[0] - 1,
                                       self.scale)[0]
            out[b0:b1] = self.latent_out(o_lat)
        return out
