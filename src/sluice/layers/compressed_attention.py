"""DeepSeek-V4 attention: shared-KV multi-query attention over a sliding window, plus (per
layer kind) compressed entries of the whole past.

- queries: low-rank (``wq_a`` -> RMSNorm ``q_norm`` -> ``wq_b``), each head RMS-normalised
  without a weight, RoPE on the trailing dims;
- one key/value head (``wkv`` -> RMSNorm ``kv_norm`` -> RoPE): the same vector is the key and the
  value, so the cache holds it once;
- a sliding window of ``window`` positions (the query's own included) and learned per-head
  sinks in the softmax;
- ``kind``: ``"sliding"`` (the window only), ``"hca"`` (the window plus every compressed entry the
  query may see) or ``"csa"`` (the window plus the ``index_topk`` entries the lightning indexer
  picks), see ``layers.compressor``;
- the output's rope dims rotated back by the query's position (the values carried their keys'
  rotation), then the grouped low-rank output projection: the heads in ``groups`` groups, each
  projected by its own rows of ``wo_a``, then ``wo_b`` over all groups (``wo_a`` a tensor, or a
  ``BlockFP8`` as the published FP8 checkpoints store it, multiplied by its row ranges).

Attention proper runs in the C kernel (``attend``, batch-invariant). A sliding-only layer
attends all its queries in one call; a compressed layer one call per query, over that query's
own key set (its window, then its entries in ascending order), so what a query sees never
depends on the rows beside it.

Shape legend: T rows, Hq heads, D head dim, d rope dims, G output groups, R ``o_lora_rank``.
"""

from __future__ import annotations

import torch

from ..quant import linear
from ..quant.fp8 import BlockFP8
from .attention import MAX_DRAFT, WindowKVCache, attend
from .compressor import Compressor, CompressorState, Indexer, rollback_for, rope_trailing, visible
from .norm import RMSNorm

KINDS = ("sliding", "hca", "csa")


class SharedWindowCache(WindowKVCache):
    """A ``WindowKVCache`` whose values are its keys (one tensor: K = V; the cache writes and
    moves it once)."""

    def __init__(self, max_ctx: int, dim: int, window: int, rollback: int = MAX_DRAFT):
        super().__init__(1, max_ctx, dim, window, v_dim=1, rollback=rollback)
        self.v = self.k


class CompressedState:
    """One V4 attention layer's state for one sequence: the window cache, and the compressor's and
    indexer's states (None where the layer kind has none). It returns to any position all of them
    still hold (``restorable``), else to 0, as a sliding-window cache does."""

    def __init__(self, window: SharedWindowCache, comp: CompressorState | None, index: CompressorState | None):
        self.window, self.comp, self.index = window, comp, index

    def _parts(self) -> list:
        return [p for p in (self.window, self.comp, self.index) if p is not None]

    def restorable(self, n: int) -> int:
        return min(p.restorable(n) for p in self._parts())

    def rewind(self, n: int) -> None:
        for p in self._parts():
            p.rewind(n)

    def tensor_bytes(self) -> int:
        """Bytes of the state's tensors (what a sequence's slot holds for this layer)."""
        w = self.window.k.numel() * 4
        return w + sum(p.tensor_bytes() for p in (self.comp, self.index) if p is not None)


class CompressedAttention:
    """One V4 attention layer (see the module docstring). ``rotary``: the layer's RoPE table (the
    "compress" one in compressed layers), for the compressed entries' positions. ``positions``:
    the buffer of every ring of its state (the window, the compressors' last projections), at
    least each one's natural size (None: each its natural size)."""

    def __init__(self, *, wq_a, q_norm, wq_b, wkv, kv_norm, wo_a, wo_b, sinks, n_heads: int, head_dim: int,
                 window: int, groups: int, eps: float, kind: str = "sliding", compressor: Compressor | None = None,
                 indexer: Indexer | None = None, rotary=None, positions: int | None = None):
        if kind not in KINDS:
            raise ValueError(f"unknown V4 attention kind {kind!r}")
        if (kind != "sliding") != (compressor is not None) or (kind == "csa") != (indexer is not None):
            raise ValueError(f"a {kind} layer needs {'a compressor' if kind != 'sliding' else 'no compressor'}"
                             f"{' and an indexer' if kind == 'csa' else ''}")
        self.wq_a, self.wq_b, self.wkv, self.wo_a, self.wo_b = wq_a, wq_b, wkv, wo_a, wo_b
        self.q_norm, self.kv_norm = RMSNorm(q_norm, eps), RMSNorm(kv_norm, eps)
        self.head_norm = RMSNorm(torch.ones(head_dim), eps)  # per head, unweighted
        self.sinks = sinks.float()
        self.n_heads, self.head_dim, self.window, self.groups = n_heads, head_dim, window, groups
        self.scale = head_dim ** -0.5
        self.kind, self.compressor, self.indexer, self.rotary = kind, compressor, indexer, rotary
        self.positions = positions

    def _compressors(self) -> list[Compressor]:
        return [c for c in (self.compressor, self.indexer.compressor if self.indexer else None) if c is not None]

    def new_cache(self, max_ctx: int) -> CompressedState:
        comp = self.compressor.new_state(max_ctx, self.positions) if self.compressor is not None else None
        index = self.indexer.compressor.new_state(max_ctx, self.positions) if self.indexer is not None else None
        window = SharedWindowCache(max_ctx, self.head_dim, self.window, rollback_for(self.window, self.positions))
        return CompressedState(window, comp, index)

    def cache_bytes(self, max_ctx: int) -> int:
        """Bytes of ``new_cache(max_ctx)``'s tensors."""
        total = 4 * self.head_dim * min(max_ctx, self.positions or WindowKVCache.positions(self.window))
        for c in self._compressors():
            total += c.state_bytes(max_ctx, self.positions or CompressorState.positions(c.m, c.overlap))
        return total

    def __call__(self, x: torch.Tensor, start: int, state: CompressedState, cos, sin) -> torch.Tensor:
        return self.segments(x, [(0, x.shape[0], start, state)], cos, sin)

    def segments(self, x: torch.Tensor, segs: list[tuple[int, int, int, CompressedState]], cos: torch.Tensor,
                 sin: torch.Tensor) -> torch.Tensor:
        """Rows of several sequences (``segs``: first row, end row, start position, state); cos/sin
        [T, d] each row's own. Projections on all rows at once, attention per sequence."""
        t, hq, d = x.shape[0], self.n_heads, self.head_dim
        q_res = self.q_norm(linear(x, self.wq_a))  # [T, q_lora_rank]
        q = self.head_norm(linear(q_res, self.wq_b).view(t, hq, d))
        q = rope_trailing(q, cos, sin)
        kv = rope_trailing(self.kv_norm(linear(x, self.wkv)).unsqueeze(1), cos, sin)  # [T, 1, D]
        outs = []
        for r0, r1, start, state in segs:
            outs.append(self._attend(x[r0:r1], q_res[r0:r1], q[r0:r1], kv[r0:r1], start, state, cos[r0:r1],
                                     sin[r0:r1]))
        o = outs[0] if len(outs) == 1 else torch.cat(outs)  # [T, Hq, D]
        o = rope_trailing(o, cos, -sin)  # undo the values' rotation at the query's position
        g = self.groups
        per = self.wo_a.shape[0] // g
        grouped = o.reshape(t, g, -1)
        wo_a = self.wo_a
        if isinstance(wo_a, BlockFP8):  # stored FP8 (as published): by row ranges, never dequantized whole
            low = torch.cat([wo_a.linear(grouped[:, i].contiguous(), r0=i * per, r1=(i + 1) * per) for i in range(g)],
                            dim=-1)
        else:
            low = torch.cat([linear(grouped[:, i].contiguous(), wo_a[i * per:(i + 1) * per]) for i in range(g)],
                            dim=-1)  # [T, G * R]
        return linear(low, self.wo_b)

    def _attend(self, x, q_res, q, kv, start: int, state: CompressedState, cos, sin) -> torch.Tensor:
        keys, _, q0 = state.window.update(start, kv, kv)  # [1, L, D] from position start - q0
        if self.kind == "sliding":
            return attend(q, keys, keys, q0, self.scale, self.window, self.sinks)
        entries = self.compressor.update(x, start, state.comp, self.rotary)  # [E, D]
        scores = None
        if self.indexer is not None:
            index_entries = self.indexer.compressor.update(x, start, state.index, self.rotary)
            scores = self.indexer.scores(x, q_res, index_entries, cos, sin)  # [T, E]
        lo, m = start - q0, self.compressor.m
        out = []
        for i in range(q.shape[0]):
            p = start + i
            win = keys[:, max(lo, p - self.window + 1) - lo : p + 1 - lo]
            if scores is None:
                chosen = entries[: visible(p, m)]
            else:
                chosen = entries[self.indexer.select(scores[i], p, m)]
            ks = torch.cat([win, chosen.unsqueeze(0)], dim=1) if chosen.shape[0] else win
            out.append(attend(q[i:i + 1], ks, ks, ks.shape[1] - 1, self.scale, None, self.sinks))
        return torch.cat(out)


__all__ = ["CompressedAttention", "CompressedState", "KINDS", "SharedWindowCache"]
