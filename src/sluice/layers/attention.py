"""Grouped-query attention with a preallocated KV cache.

Shape legend: T query tokens, L key positions, Hq query heads, Hkv key/value heads,
R = Hq / Hkv, D head dim (queries and keys), Dv value head dim (D unless a family sets it).
"""

from __future__ import annotations

import torch

from ..kernels.backend import cpu
from ..quant import linear
from .norm import RMSNorm
from .rotary import apply_rotary, apply_rotary_pairs

# Bound on the fp32 score block [Hq, Tq, L] materialised at once during prefill.
SCORE_BLOCK_BYTES = 64 << 20


# The longest speculative draft (``speculative.NgramDrafter`` never proposes more): a
# sliding-window cache keeps this many positions beyond its window, so that rejecting a draft
# rolls it back without recomputing anything.
MAX_DRAFT = 12


class KVCache:
    """Keys and values of one attention layer for up to ``max_ctx`` positions (fp32).

    Allocated once with ``torch.empty``: pages become resident as positions are written.
    The sequence length lives in the model state, not here; truncating is free.
    """

    def __init__(self, n_kv: int, max_ctx: int, k_dim: int, v_dim: int | None = None):
        self.k = torch.empty(n_kv, max_ctx, k_dim)
        self.v = torch.empty(n_kv, max_ctx, v_dim or k_dim)

    @staticmethod
    def nbytes(n_kv: int, max_ctx: int, k_dim: int, v_dim: int | None = None) -> int:
        return 4 * n_kv * max_ctx * (k_dim + (v_dim or k_dim))

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [T, Hkv, D] for positions start .. start+T-1."""
        t = k.shape[0]
        self.k[:, start : start + t] = k.transpose(0, 1)
        self.v[:, start : start + t] = v.transpose(0, 1)

    def update(self, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Write positions start.. and return the keys [Hkv, L, D] and values the new queries
        attend over, with the first query's index among those keys (here: all, from 0)."""
        self.write(start, k, v)
        end = start + k.shape[0]
        return self.k[:, :end], self.v[:, :end], start


class WindowKVCache:
    """Keys and values of a sliding-window layer: only the positions it may still need.

    A query at position p sees keys p-W+1..p (W the window). The cache keeps the last
    ``keep = W - 1 + MAX_DRAFT`` positions before each forward (what the next queries see,
    plus a rejected speculative draft's worth to roll back) in a buffer of ``2 * keep``
    positions (at most ``max_ctx``): new positions are written in place while they fit, then
    the kept positions move to the front (one copy per ``keep`` tokens). Keys stay contiguous,
    so attention reads them as a slice, in the order a full cache has them: the C kernel
    visits the same keys in the same order, and the logits are bit-identical.

    Positions before ``base`` are gone: ``restorable(n)`` is ``n`` while n's window is still
    held, else 0 (the state is rewound to nothing and the caller prefills again).
    """

    def __init__(self, n_kv: int, max_ctx: int, k_dim: int, window: int, v_dim: int | None = None,
                 rollback: int = MAX_DRAFT):
        self.window = window
        self.keep = window - 1 + rollback
        self.cap = self.positions(window, max_ctx, rollback)
        self.k = torch.empty(n_kv, self.cap, k_dim)
        self.v = torch.empty(n_kv, self.cap, v_dim or k_dim)
        self.base = 0  # position of buffer slot 0
        self.end = 0  # positions base..end-1 are held

    @staticmethod
    def positions(window: int, max_ctx: int | None = None, rollback: int = MAX_DRAFT) -> int:
        """Positions the buffer holds for a context of ``max_ctx`` (None: any length)."""
        cap = max(1, 2 * (window - 1 + rollback))
        return cap if max_ctx is None else min(max_ctx, cap)

    def restorable(self, n: int) -> int:
        """The largest length <= n this cache can continue from: n if keys n-W+1..n-1 are held."""
        n = min(n, self.end)
        return n if self.base == 0 or n - self.window + 1 >= self.base else 0

    def rewind(self, n: int) -> None:
        self.end = n
        if n == 0:
            self.base = 0

    def update(self, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Write positions start..start+T-1 (k, v [T, Hkv, D]); returns the keys and values the
        queries attend over (from the first position the first query sees) and the first
        query's index among them."""
        t = k.shape[0]
        end = start + t
        if start > self.end or (self.base > 0 and start - self.window + 1 < self.base):
            raise RuntimeError(f"sliding-window cache holds positions {self.base}..{self.end - 1}, "
                               f"cannot continue at {start}")
        lo = max(0, start - self.window + 1)  # the first key the first query sees
        if end - self.base > self.cap:  # no room: keep the last `keep` positions before start
            base = max(self.base, start - self.keep)
            if base > self.base:
                n = start - base
                a = base - self.base
                self.k[:, :n] = self.k[:, a : a + n].clone()
                if self.v is not self.k:  # (a cache whose values are its keys moves them once)
                    self.v[:, :n] = self.v[:, a : a + n].clone()
                self.base = base
        self.end = end
        if end - self.base <= self.cap:
            o = start - self.base
            self.k[:, o : o + t] = k.transpose(0, 1)
            if self.v is not self.k:
                self.v[:, o : o + t] = v.transpose(0, 1)
            return self.k[:, lo - self.base : end - self.base], self.v[:, lo - self.base : end - self.base], start - lo
        # a chunk longer than the free room: attend over a joined copy, keep its last positions
        keys = torch.cat([self.k[:, lo - self.base : start - self.base], k.transpose(0, 1)], dim=1)
        if self.v is self.k:
            values = keys
        else:
            values = torch.cat([self.v[:, lo - self.base : start - self.base], v.transpose(0, 1)], dim=1)
        n = min(self.cap, end - lo)
        self.k[:, :n] = keys[:, -n:]
        if self.v is not self.k:
            self.v[:, :n] = values[:, -n:]
        self.base = end - n
        return keys, values, start - lo


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_start: int,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of queries at positions q_start.. over keys 0..L-1.

    q: [T, Hq, D]; k: [Hkv, L, D]; v: [Hkv, L, Dv]; sinks: [Hq] extra softmax logits.
    Returns [T, Hq, Dv]. With batch-invariant kernels (the default) one C call computes each
    (query, head) in a fixed order; otherwise torch, in query blocks so scores stay bounded.
    """
    if cpu.batch_invariant():
        return cpu.attend(q, k, v, q_start, scale, window, sinks)
    t, hq, d = q.shape
    hkv, n_keys, _ = k.shape
    r = hq // hkv
    out = torch.empty(t, hq, v.shape[-1])
    block = max(1, SCORE_BLOCK_BYTES // (4 * hq * max(n_keys, 1)))
    for b0 in range(0, t, block):
        b1 = min(t, b0 + block)
        end = q_start + b1  # keys this block may see
        qb = q[b0:b1].reshape(b1 - b0, hkv, r, d).permute(1, 2, 0, 3)  # [Hkv, R, Tb, D]
        scores = torch.matmul(qb, k[:, :end].transpose(1, 2).unsqueeze(1)) * scale  # [Hkv, R, Tb, Lb]
        qpos = torch.arange(q_start + b0, q_start + b1)[:, None]
        kpos = torch.arange(end)[None, :]
        masked = kpos > qpos
        if window is not None:
            masked = masked | (kpos <= qpos - window)
        scores.masked_fill_(masked, float("-inf"))
        if sinks is not None:
            sink = sinks.float().reshape(hkv, r, 1, 1).expand(hkv, r, b1 - b0, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        ob = torch.matmul(probs, v[:, :end].unsqueeze(1))  # [Hkv, R, Tb, Dv]
        out[b0:b1] = ob.permute(2, 0, 1, 3).reshape(b1 - b0, hq, -1)
    return out


class Attention:
    """Standard GQA self-attention: projections, optional q/k norms, RoPE, KV cache.

    ``qk_norm``: None; ``"head"`` (RMSNorm over each head, Qwen3); ``"full"`` (RMSNorm over
    the whole projection before splitting heads, OLMoE). ``v_head_dim``: the value heads'
    width when it differs from ``head_dim`` (the output projection reads Hq x Dv);
    ``v_scale``: a constant the values are multiplied by before they are cached (MiMo-V2-Flash).
    ``rope``: ``"half"`` (rotate-half, the first ``d`` dims) or ``"pairs"`` (GPT-J pairs over the
    whole head, ERNIE-4.5). ``norm_after_rope``: the per-head norms apply to the rotated q/k
    (Hunyuan) instead of before RoPE.
    """

    def __init__(
        self,
        *,
        wq: torch.Tensor,
        wk: torch.Tensor,
        wv: torch.Tensor,
        wo: torch.Tensor,
        n_heads: int,
        n_kv: int,
        head_dim: int,
        bq: torch.Tensor | None = None,
        bk: torch.Tensor | None = None,
        bv: torch.Tensor | None = None,
        bo: torch.Tensor | None = None,
        qk_norm: str | None = None,
        q_norm: torch.Tensor | None = None,
        k_norm: torch.Tensor | None = None,
        norm_eps: float = 1e-6,
        clip_qkv: float | None = None,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
        scale: float | None = None,
        v_head_dim: int | None = None,
        v_scale: float | None = None,
        rope: str = "half",
        norm_after_rope: bool = False,
    ):
        self.wq, self.wk, self.wv, self.wo = wq, wk, wv, wo
        self.bq, self.bk, self.bv, self.bo = bq, bk, bv, bo
        self.n_heads, self.n_kv, self.head_dim = n_heads, n_kv, head_dim
        self.qk_norm = qk_norm
        self.norm_after_rope = norm_after_rope
        self.q_norm = RMSNorm(q_norm, norm_eps) if q_norm is not None else None
        self.k_norm = RMSNorm(k_norm, norm_eps) if k_norm is not None else None
        self.clip_qkv = clip_qkv
        self.window = window
        self.sinks = sinks.float() if sinks is not None else None
        self.scale = scale if scale is not None else head_dim**-0.5
        self.v_head_dim = v_head_dim or head_dim
        self.v_scale = v_scale
        if rope not in ("half", "pairs"):
            raise ValueError(f"unknown RoPE layout {rope!r}")
        self.rotate = apply_rotary_pairs if rope == "pairs" else apply_rotary

    def new_cache(self, max_ctx: int) -> KVCache | WindowKVCache:
        if self.window is not None:
            return WindowKVCache(self.n_kv, max_ctx, self.head_dim, self.window, v_dim=self.v_head_dim)
        return KVCache(self.n_kv, max_ctx, self.head_dim, self.v_head_dim)

    def cache_bytes(self, max_ctx: int) -> int:
        if self.window is not None:
            max_ctx = WindowKVCache.positions(self.window, max_ctx)
        return KVCache.nbytes(self.n_kv, max_ctx, self.head_dim, self.v_head_dim)

    def __call__(self, x: torch.Tensor, start: int, cache: KVCache, cos: torch.Tensor,
                 sin: torch.Tensor) -> torch.Tensor:
        return self.segments(x, [(0, x.shape[0], start, cache)], cos, sin)

    def segments(self, x: torch.Tensor, segs: list[tuple[int, int, int, KVCache]], cos: torch.Tensor,
                 sin: torch.Tensor) -> torch.Tensor:
        """Rows of several sequences: ``segs`` holds (first row, end row, start position, cache) of
        each; cos/sin [T, d] are each row's own. Projections run on all rows at once, attention
        per sequence over its own cache."""
        t = x.shape[0]
        q = linear(x, self.wq, self.bq)
        k = linear(x, self.wk, self.bk)
        v = linear(x, self.wv, self.bv)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            c = self.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        q = q.view(t, self.n_heads, self.head_dim)
        k = k.view(t, self.n_kv, self.head_dim)
        v = v.view(t, self.n_kv, self.v_head_dim)
        if self.v_scale is not None:
            v = v * self.v_scale
        if self.qk_norm == "head" and not self.norm_after_rope:
            q, k = self.q_norm(q), self.k_norm(k)
        q = self.rotate(q, cos, sin)
        k = self.rotate(k, cos, sin)
        if self.qk_norm == "head" and self.norm_after_rope:
            q, k = self.q_norm(q), self.k_norm(k)
        o = self.attend_segments(q, k, v, segs)
        return linear(o.reshape(t, -1), self.wo, self.bo)

    def attend_segments(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segs) -> torch.Tensor:
        """Write each sequence's keys and values to its cache and attend over it: [T, Hq, Dv]."""
        outs = []
        for r0, r1, start, cache in segs:
            keys, values, q0 = cache.update(start, k[r0:r1], v[r0:r1])
            outs.append(attend(q[r0:r1], keys, values, q0, self.scale, self.window, self.sinks))
        return outs[0] if len(outs) == 1 else torch.cat(outs)
