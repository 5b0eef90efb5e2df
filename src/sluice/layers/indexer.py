"""The lightning indexer of DeepSeek sparse attention (DSA: DeepSeek-V3.2, GLM-5) and its key cache.

Per token the indexer keeps one key ``k = rope(LayerNorm(wk(x)))`` [D] (``index_head_dim``
floats: the whole per-position state it adds to a layer). A query at position p scores every
visible position j <= p::

    I[p, j] = sum_h w[p, h] * relu(q[p, h] . k[j] / sqrt(D)),   w[p] = weights_proj(x_p) / sqrt(Hi)

with ``q[p] = wq_b(q_resid_p)`` [Hi, D] (``q_resid``: the attention's normalised low-rank query,
``q_a_layernorm(q_a_proj(x))``), RoPE on the first ``qk_rope_head_dim`` dims of queries and keys
(rotate-half for DeepSeek-V3.2, interleaved pairs for GLM-5), and keeps the ``topk`` best. A query
that sees ``topk`` positions or fewer keeps them all (attention is then plain causal MLA).

Selection ties. transformers 5.24 takes ``torch.topk`` over a row of scores; which of several
equal scores at the k-th place it keeps is decided by that sort on that row. Sluice takes the
same ``torch.topk`` over each query's own visible positions, exactly the row transformers scores
when it decodes token by token, so ties resolve as in its decoding. transformers' one-pass
forward scores a longer row (the causally masked positions at the end), where an exact tie at
the k-th place may resolve otherwise: the tests' models are checked to have no such tie (the
k-th and (k+1)-th scores apart by far more than rounding), so both of its paths agree with Sluice.

Every product runs on the batch-invariant kernels and the selection of a query depends only on
its own row of scores, so a query selects the same positions whatever the chunk, the batch or
the speculative draft it is computed in.

Shape legend: T query tokens, L visible positions, Hi indexer heads, D ``index_head_dim``,
Dr ``qk_rope_head_dim``, K ``topk``.
"""

from __future__ import annotations

import torch

from ..quant import linear
from .pointwise import pointwise
from .rotary import apply_rotary

# Bound on the fp32 score block [L, Tb * Hi] computed at once while prefilling.
SCORE_BLOCK_BYTES = 32 << 20


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim of x [T, D] (fp32), with each row's two sums in one fixed order
    (the dense kernel's), so a row's result depends on nothing else."""
    d = x.shape[-1]
    ones = torch.ones(1, d)
    mean = linear(x, ones) / d  # [T, 1]
    c = x - mean
    var = linear(c * c, ones) / d
    return c * torch.rsqrt(var + eps) * weight + bias


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved-pair RoPE on the first ``cos.shape[-1]`` dims of x [T, H, D] (the layout MLA
    uses: rotated even elements then rotated odd ones), the rest unchanged."""
    from .mla import apply_rotary_interleaved

    d = cos.shape[-1]
    if d == x.shape[-1]:
        return apply_rotary_interleaved(x, cos, sin)
    return torch.cat([apply_rotary_interleaved(x[..., :d], cos, sin), x[..., d:]], dim=-1)


class IndexKeys:
    """``keys`` [max_ctx, D] fp32: the indexer's key of every position of one sequence.

    Allocated once with ``torch.empty`` (pages become resident as positions are written); the
    length lives in the model state, as for a KV cache, so truncating (rewind, prefix reuse,
    a rejected speculative draft) is free and a snapshot needs nothing."""

    def __init__(self, max_ctx: int, dim: int):
        self.keys = torch.empty(max_ctx, dim)

    @staticmethod
    def nbytes(max_ctx: int, dim: int) -> int:
        return 4 * max_ctx * dim

    def write(self, start: int, k: torch.Tensor) -> None:
        """k [T, D] for positions start .. start+T-1."""
        self.keys[start : start + k.shape[0]] = k


class PooledKeys(IndexKeys):
    """``IndexKeys`` of a ``PooledIndexer`` (``keys`` [max_ctx, 2 D]: key then pooling logits) and
    ``pools`` [max_ctx // P, D]: the key of every complete pool, computed once when a query first
    needs it (``PooledIndexer.pooled``) instead of from all positions at every step.

    ``done``: the pools of ``pools`` that hold the key of the positions now in ``keys``. A write
    at position ``start`` drops every pool from the one holding ``start`` on, so the cache stays
    truncatable for free: after a rewind (a rejected draft, prefix reuse, a restored snapshot) the
    next write, at the new length, drops the pools past the cut, and the pool it cut becomes
    incomplete and is computed again once complete. Every key write goes through ``write``."""

    def __init__(self, max_ctx: int, dim: int, pool: int):
        super().__init__(max_ctx, 2 * dim)
        self.pool = pool
        self.pools = torch.empty(max_ctx // pool, dim)
        self.done = 0

    @staticmethod
    def nbytes(max_ctx: int, dim: int, pool: int) -> int:  # type: ignore[override]
        return IndexKeys.nbytes(max_ctx, 2 * dim) + 4 * (max_ctx // pool) * dim

    def write(self, start: int, k: torch.Tensor) -> None:
        self.done = min(self.done, start // self.pool)
        super().write(start, k)


class LightningIndexer:
    """DSA's indexer: its projections, key norm and RoPE, and the per-query selection.

    Weights ``wq_b`` [Hi * D, q_lora_rank], ``wk`` [D, H] and ``weights_proj`` [Hi, H] may be
    tensors or format wrappers (used as stored, every call); ``k_norm`` weight and bias [D] are
    resident. ``interleave``: GLM-5's interleaved-pair RoPE, else DeepSeek-V3.2's rotate-half.
    """

    def __init__(self, *, wq_b, wk, weights_proj, k_norm_weight: torch.Tensor, k_norm_bias: torch.Tensor,
                 n_heads: int, head_dim: int, topk: int, interleave: bool, eps: float = 1e-6):
        self.wq_b, self.wk, self.weights_proj = wq_b, wk, weights_proj
        self.k_norm_weight, self.k_norm_bias = k_norm_weight.float(), k_norm_bias.float()
        self.n_heads, self.head_dim, self.topk = n_heads, head_dim, topk
        self.interleave, self.eps = interleave, eps
        self.scale = head_dim**-0.5
        self.key_dim = head_dim  # floats kept per position (``IndexKeys`` width)

    def new_keys(self, max_ctx: int) -> IndexKeys:
        return IndexKeys(max_ctx, self.key_dim)

    def keys_bytes(self, max_ctx: int) -> int:
        return IndexKeys.nbytes(max_ctx, self.key_dim)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return rope_interleaved(x, cos, sin) if self.interleave else apply_rotary(x, cos, sin)

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The keys [T, D] of the rows x [T, H] (cos/sin: each row's own)."""
        k = layer_norm(linear(x, self.wk), self.k_norm_weight, self.k_norm_bias, self.eps)
        return self._rope(k[:, None], cos, sin)[:, 0]

    def queries(self, q_resid: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(queries [T, Hi, D], head weights [T, Hi]) of the rows (q_resid [T, q_lora_rank], x [T, H])."""
        t = x.shape[0]
        q = self._rope(linear(q_resid, self.wq_b).view(t, self.n_heads, self.head_dim), cos, sin)
        return q, linear(x, self.weights_proj) * self.n_heads**-0.5

    def needs(self, start: int, t: int) -> bool:
        """Whether some of T queries from position ``start`` on sees more than ``topk`` positions."""
        return start + t > self.topk

    def scores(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """I[j] [L] of one query (q [Hi, D], w [Hi]) over keys [L, D]."""
        s = linear(keys, q).mul_(self.scale).relu_()  # [L, Hi]
        return linear(s, w[None])[:, 0]

    def select_cached(self, q: torch.Tensor, w: torch.Tensor, index: IndexKeys, start: int) -> list:
        """``select`` over the keys a layer's ``IndexKeys`` holds (positions 0 .. start + T - 1)."""
        return self.select(q, w, index.keys[: start + q.shape[0]], start)

    def select(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, start: int) -> list:
        """Per query (q [T, Hi, D], w [T, Hi], at positions start..; keys [start + T, D] of every
        visible position): None where it sees ``topk`` positions or fewer (it keeps them all), else
        the positions it keeps, ascending (a long tensor [K])."""
        t, hi, d = q.shape
        out: list = [None] * t
        first = max(0, self.topk - start)  # the first row that sees more than topk positions
        block = max(1, SCORE_BLOCK_BYTES // (4 * hi * (start + t)))
        for b0 in range(first, t, block):
            b1 = min(t, b0 + block)
            # s[j, (i, h)] = q[i, h] . k[j], one fixed-order dot per element whatever the block
            s = linear(keys[: start + b1], q[b0:b1].reshape(-1, d)).mul_(self.scale).relu_()
            for i in range(b0, b1):
                n = start + i + 1
                scores = linear(s[:n, (i - b0) * hi : (i - b0 + 1) * hi], w[i : i + 1])[:, 0]
                out[i] = scores.topk(self.topk).indices.sort().values
        return out


class PooledIndexer(LightningIndexer):
    """GLM-5.3-Flash's indexer (``index_kpool``): the lightning indexer scoring pools of ``pool``
    consecutive positions instead of single ones, without RoPE.

    Per position it keeps its key ``k`` = LayerNorm(wk(x)) and its pooling logits ``g`` =
    ``index_kpool_compress_gate`` x (D floats each: ``key_dim`` = 2 D). Pool m covers positions
    m P .. m P + P - 1; once complete its key is ``sum_j softmax_j(g_j + ape_j) * k_j`` per channel
    (``ape`` [P, D]: a learned bias per place in the pool). A query at position p sees the
    complete pools that end at or before p, scores them as ``LightningIndexer.scores`` scores
    positions, keeps the best ``topk / P`` (all of them when it sees that many or fewer), attends
    over their positions and always over the incomplete pool it is in (positions P floor((p+1)/P)
    .. p, the "tail"). As transformers 5.24 computes it (``Glm5NextTextIndexer``, sequences
    without padding: pools start at position 0). A layer's ``PooledKeys`` caches the complete pools'
    keys, so a decode step computes at most the pool it completes, not all of them (O(P), not O(L)).

    Selection ties: the same rule as ``LightningIndexer`` (``torch.topk`` over the pools the query
    sees; the tests' models are checked to have no exact tie at the boundary).
    """

    def __init__(self, *, compress_gate: torch.Tensor, ape: torch.Tensor, pool: int, **indexer):
        super().__init__(interleave=False, **indexer)
        if pool < 1 or self.topk % pool:
            raise ValueError(f"index_topk={self.topk} is not a multiple of the pool size {pool}")
        if tuple(ape.shape) != (pool, self.head_dim):
            raise ValueError(f"pool position bias of shape {list(ape.shape)} for pools of {pool} x {self.head_dim}")
        # [D, H] and [P, D]: possibly a stream buffer's views (refilled before the layer), used as given
        self.gate, self.ape = compress_gate, ape
        self.pool, self.pools_kept = pool, self.topk // pool
        self.key_dim = 2 * self.head_dim

    def _rope(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        return x  # no positional encoding (qk_rope_head_dim = 0)

    def keys(self, x: torch.Tensor, cos=None, sin=None) -> torch.Tensor:
        """[T, 2 D]: each row's key then its pooling logits."""
        k = layer_norm(linear(x, self.wk), self.k_norm_weight, self.k_norm_bias, self.eps)
        return torch.cat([k, linear(x, self.gate)], dim=-1)

    def new_keys(self, max_ctx: int) -> PooledKeys:
        return PooledKeys(max_ctx, self.head_dim, self.pool)

    def keys_bytes(self, max_ctx: int) -> int:
        return PooledKeys.nbytes(max_ctx, self.head_dim, self.pool)

    def needs(self, start: int, t: int) -> bool:
        return (start + t) // self.pool > self.pools_kept

    def select_cached(self, q: torch.Tensor, w: torch.Tensor, index: IndexKeys, start: int) -> list:
        if not isinstance(index, PooledKeys) or index.pool != self.pool or index.pools.shape[1] != self.head_dim:
            raise TypeError(f"a pooled indexer (pools of {self.pool} x {self.head_dim}) needs its own PooledKeys "
                            f"(new_keys), got {type(index).__name__}")
        return self.select(q, w, index, start)

    def pooled(self, index: PooledKeys, end: int) -> torch.Tensor:
        """[end // P, D] the keys of the complete pools of the first ``end`` positions of ``index``:
        those not yet cached computed from their own positions (``pool_keys``: a pool's key does not
        depend on the pools computed with it, so the cache holds the bits of a recomputation)."""
        p, m = self.pool, end // self.pool
        if index.done < m:
            index.pools[index.done : m] = self.pool_keys(index.keys[index.done * p : m * p])
            index.done = m
        return index.pools[:m]

    def pool_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """[M, D] the keys of the complete pools of keys [L, 2 D] (M = L // P), each from its own
        positions only (elementwise steps, sums over the pool in ascending order)."""
        from .hyper import sum_ascending

        d, p = self.head_dim, self.pool
        m = keys.shape[0] // p
        grouped = keys[: m * p].reshape(m, p, 2 * d)
        k, logits = grouped[..., :d], grouped[..., d:] + self.ape.float()
        e = pointwise(torch.exp, logits - logits.amax(dim=1, keepdim=True))
        prob = e / sum_ascending(e, 1).unsqueeze(1)
        return sum_ascending(prob * k, 1)

    def select(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor | PooledKeys, start: int) -> list:
        """As ``LightningIndexer.select`` over pools: per query None where it sees ``topk / P`` pools or
        fewer (every position it sees is kept), else its kept pools' positions and its tail, ascending.
        ``keys``: the layer's ``PooledKeys`` (complete pools' keys cached), or a tensor [start + T, 2 D]
        of every visible position's (all pools computed from it: the same bits, at O(L) a call)."""
        t, hi, d = q.shape
        p, kept = self.pool, self.pools_kept
        out: list = [None] * t
        first = next((i for i in range(t) if (start + i + 1) // p > kept), t)
        if first == t:
            return out
        if isinstance(keys, PooledKeys):
            pooled = self.pooled(keys, start + t)  # [M, D]
        else:
            pooled = self.pool_keys(keys[: start + t])
        offsets = torch.arange(p)
        block = max(1, SCORE_BLOCK_BYTES // (4 * hi * max(1, pooled.shape[0])))
        for b0 in range(first, t, block):
            b1 = min(t, b0 + block)
            s = linear(pooled, q[b0:b1].reshape(-1, d)).mul_(self.scale).relu_()  # [M, Tb * Hi]
            for i in range(b0, b1):
                n = (start + i + 1) // p  # the complete pools this query sees
                scores = linear(s[:n, (i - b0) * hi : (i - b0 + 1) * hi], w[i : i + 1])[:, 0]
                picked = scores.topk(kept).indices.sort().values
                tail = torch.arange(n * p, start + i + 1)
                out[i] = torch.cat([(picked[:, None] * p + offsets).reshape(-1), tail])
        return out
