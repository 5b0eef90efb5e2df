"""DeepSeek-V4's KV compressors and the lightning indexer over their entries.

A compressor turns every ``m`` source positions into one compressed KV entry. Each position
contributes a projection ``kv = x @ wkv.T`` and a gate ``z = x @ wgate.T + ape[pos % m]``; an
entry is the per-channel softmax-over-slots of the gates applied to the kvs, RMS-normalised
(``norm``) and rotated (the trailing rope dims, at the window's first position ``w * m``):

- heavily compressed attention (HCA, ``overlap=False``, m = 128): entry ``w`` pools window ``w``'s
  m positions (kv and gate ``D`` wide);
- compressed sparse attention (CSA, ``overlap=True``, m = 4): projections are ``2D`` wide, two
  series: entry ``w`` pools window ``w-1``'s first halves (``Ca``) and window ``w``'s second halves
  (``Cb``), 2m slots (window 0 has only its m ``Cb`` slots).

Entry ``w`` depends only on positions below ``(w + 1) * m``, so once written it never changes.
A query at position p sees entries ``w < (p + 1) // m``. In a CSA layer the lightning indexer
(its own compressor at ``index_head_dim``, its own queries) scores every visible entry,
``sum_h w_h * relu(q_h . k) / sqrt(Di)``, and the query attends only to the ``index_topk`` best.

State, per compressor and sequence (``CompressorState``): the written entries (one per ``m``
positions), and the projections of the last positions (``raw``, a ``WindowKVCache`` of the
last ``m`` (HCA) or ``2m`` (CSA) positions before each forward plus a rejected draft's worth),
from which the pending window and the overlap are taken, so that rewinding to any position it
still holds costs nothing: entries past it are recomputed when their windows complete again.

Batch invariance: products through ``quant.linear`` (fixed order), exponentials through
``pointwise``, every softmax and sum over slots or heads written out in ascending order, each
query's top-k taken over its own visible entries with ties to the lower index. A row's bits do
not depend on how a prompt is cut into chunks.

Shape legend: T rows, m positions per entry, D entry dims, W projection width (D or 2D),
E entries, Hi indexer heads, Di indexer head dim, K index_topk.
"""

from __future__ import annotations

import torch

from ..quant import linear
from .attention import MAX_DRAFT, WindowKVCache
from .hyper import sum_ascending
from .norm import RMSNorm
from .pointwise import pointwise


def rope_trailing(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE on the trailing dims of each head (DeepSeek-V4): x [T, H, Dh]; cos/sin
    [T, d] as ``Rotary.cos_sin`` gives them (cat(freqs, freqs)): the last d dims of x are d/2
    pairs (2i, 2i+1) rotated by frequency i; the leading ``Dh - d`` dims pass unchanged.
    With ``-sin``: the inverse rotation."""
    d = cos.shape[-1]
    c = cos[:, None, : d // 2].repeat_interleave(2, dim=-1)
    s = sin[:, None, : d // 2].repeat_interleave(2, dim=-1)
    nope, rope = x[..., :-d], x[..., -d:]
    rotated = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat([nope, rope * c + rotated * s], dim=-1)


def pool(kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The per-channel softmax over slots of ``gate`` applied to ``kv``: [n, S, D] each -> [n, D]
    (max, exponentials, their sum and the weighted sum in ascending slot order)."""
    e = pointwise(torch.exp, gate - gate.amax(dim=1, keepdim=True))
    p = e / sum_ascending(e, 1).unsqueeze(1)
    return sum_ascending(kv * p, 1)


def rollback_for(span: int, positions: int | None) -> int:
    """The rollback that gives a ``WindowKVCache`` of ``span`` positions a buffer of ``positions``
    (every ring of a model the same size, so the declaration states them exactly); None: the
    default, ``MAX_DRAFT``."""
    return MAX_DRAFT if positions is None else positions // 2 - span + 1


class CompressorState:
    """One compressor's state for one sequence: ``entries`` [max_ctx // m, D] (those below
    ``length // m`` written) and ``raw`` (the last positions' projections and gates, in a buffer
    of ``positions`` positions at most: at least its natural ``positions(m, overlap)``)."""

    def __init__(self, max_ctx: int, m: int, width: int, dim: int, overlap: bool, positions: int | None = None):
        self.m = m
        span = (2 if overlap else 1) * m
        self.raw = WindowKVCache(1, max_ctx, width, span, v_dim=width, rollback=rollback_for(span, positions))
        self.entries = torch.empty(max_ctx // m, dim)

    @staticmethod
    def positions(m: int, overlap: bool, max_ctx: int | None = None) -> int:
        """Positions ``raw`` needs at least (the last ``m`` or ``2m`` and a rejected draft's, twice)."""
        return WindowKVCache.positions((2 if overlap else 1) * m, max_ctx)

    def tensor_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.raw.k, self.raw.v, self.entries))

    def restorable(self, n: int) -> int:
        return self.raw.restorable(n)

    def rewind(self, n: int) -> None:
        self.raw.rewind(n)


class Compressor:
    """One compressor's weights: ``wkv`` / ``wgate`` [W, H] and the gates' position bias ``ape``
    [m, W] (matrices: stream buffer views possibly, so used as given, inside each call), and the
    entries' RMSNorm weight ``norm`` [D] (1-D, converted once)."""

    def __init__(self, wkv: torch.Tensor, wgate: torch.Tensor, ape: torch.Tensor, norm: torch.Tensor, *, m: int,
                 dim: int, overlap: bool, eps: float):
        self.wkv, self.wgate, self.ape, self.m, self.dim, self.overlap = wkv, wgate, ape, m, dim, overlap
        self.norm = RMSNorm(norm, eps)
        self.width = (2 if overlap else 1) * dim

    def new_state(self, max_ctx: int, positions: int | None = None) -> CompressorState:
        return CompressorState(max_ctx, self.m, self.width, self.dim, self.overlap, positions)

    def state_bytes(self, max_ctx: int, positions: int) -> int:
        """Bytes of ``new_state(max_ctx, positions)``'s tensors: the last positions' projections and
        gates, and the entries."""
        return 4 * (2 * self.width * min(max_ctx, positions) + (max_ctx // self.m) * self.dim)

    def update(self, x: torch.Tensor, start: int, state: CompressorState, rotary) -> torch.Tensor:
        """Take rows x [T, H] at positions start..; write the entries of the windows they complete;
        return the entries [end // m, D] written so far (a view)."""
        t, m, d = x.shape[0], self.m, self.dim
        kv = linear(x, self.wkv)  # [T, W]
        gate = linear(x, self.wgate)
        rows_kv, rows_gate, q0 = state.raw.update(start, kv.unsqueeze(1), gate.unsqueeze(1))
        lo, end = start - q0, start + t  # rows_* [1, end - lo, W] hold positions lo..end-1
        w0, w1 = start // m, end // m  # the windows completed by this forward
        if w1 > w0:
            first = max(0, w0 - 1) if self.overlap else w0
            a, b = first * m - lo, w1 * m - lo
            n = w1 - first
            ape = self.ape.float()
            kvw = rows_kv[0, a:b].reshape(n, m, self.width)
            gw = rows_gate[0, a:b].reshape(n, m, self.width) + ape
            if self.overlap:
                out = []
                if w0 == 0:  # window 0: its second halves only
                    out.append(pool(kvw[:1, :, d:], gw[:1, :, d:]))
                if n > 1:  # window w: window w-1's first halves, then its own second halves
                    out.append(pool(torch.cat([kvw[:-1, :, :d], kvw[1:, :, d:]], dim=1),
                                    torch.cat([gw[:-1, :, :d], gw[1:, :, d:]], dim=1)))
                pooled = torch.cat(out) if len(out) > 1 else out[0]
            else:
                pooled = pool(kvw, gw)
            pos = torch.arange(w0, w1) * m
            cos, sin = rotary.cos_sin(pos)
            state.entries[w0:w1] = rope_trailing(self.norm(pooled).unsqueeze(1), cos, sin)[:, 0]
        return state.entries[:w1]


def visible(position: int, m: int) -> int:
    """How many entries a query at ``position`` may see."""
    return (position + 1) // m


class Indexer:
    """The lightning indexer of a CSA layer: its compressor (``Di`` wide, with overlap), its query
    projection ``wq_b`` [Hi * Di, q_lora_rank] (on the attention's low-rank query) and the head
    weights ``weights_proj`` [Hi, H] (on the layer input); keeps ``topk`` entries per query."""

    def __init__(self, compressor: Compressor, wq_b: torch.Tensor, weights_proj: torch.Tensor, *, heads: int,
                 dim: int, topk: int):
        self.compressor, self.wq_b, self.weights_proj = compressor, wq_b, weights_proj
        self.heads, self.dim, self.topk = heads, dim, topk
        self.softmax_scale = dim ** -0.5
        self.weights_scale = heads ** -0.5

    def scores(self, x: torch.Tensor, q_res: torch.Tensor, entries: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> torch.Tensor:
        """Index scores [T, E] of every row against every entry (masking is the caller's):
        ``sum_h (weights_proj(x)_h / sqrt(Hi)) * relu(q_h . k) / sqrt(Di)``, heads in ascending order."""
        t, e = x.shape[0], entries.shape[0]
        q = linear(q_res, self.wq_b).view(t, self.heads, self.dim)
        q = rope_trailing(q, cos, sin)
        w = linear(x, self.weights_proj) * self.weights_scale  # [T, Hi]
        if e == 0:
            return x.new_zeros(t, 0)
        dots = linear(q.reshape(t * self.heads, self.dim).contiguous(), entries).view(t, self.heads, e)
        r = dots.clamp(min=0) * self.softmax_scale
        return sum_ascending(r * w.unsqueeze(-1), 1)

    def select(self, scores: torch.Tensor, position: int, m: int) -> torch.Tensor:
        """The entries a query at ``position`` attends to: the ``topk`` best of its visible ones
        (ties: the lower index), in ascending index order."""
        n = visible(position, m)
        k = min(self.topk, n)
        if k == n:
            return torch.arange(n)
        order = torch.argsort(scores[:n], descending=True, stable=True)[:k]
        return order.sort().values


__all__ = ["Compressor", "CompressorState", "Indexer", "pool", "rollback_for", "rope_trailing", "visible"]
