"""Per-layer n-gram embeddings (PLE, Qwen3.8-Flash-Next): token-keyed table rows gated into the streams.

A PLE layer (transformers 5.24: ``Qwen4ExpTextNGramEmbedding`` and ``Qwen4ExpTextPLELayer``)
looks up, for every token, one row per n-gram head in a large table, by a hash of the token
and the tokens before it:

- the history of a token at position p is p-1, p-2, ... up to ``ngram_size - 1`` back; it
  stops at an end-of-sequence token (EOS) and at the start: every shift past that is the EOS
  id (segments separated by EOS do not see each other);
- for n = 2 .. ``ngram_size`` the n-gram id is ``xor_{s<n} (tok[p-s] * mult[s])`` (int64, no
  overflow: the multipliers are below 2^63 / vocab), and head j of that order takes row
  ``id % size_j + offset_j`` (distinct primes per head; ``NGramHash``);
- the rows of all heads, concatenated (E = heads x d floats), give a key per stream
  (``key_proj``, grouped (1 + w) RMSNorm) and one value (``value_proj``); the gate of stream
  k is ``<norm(key)_k, norm(h)_k> / sqrt(H)``, taken through ``sign(g) sqrt(max(|g|, 1e-6))``
  and a sigmoid; the gated value, once more normalised, goes through a causal depthwise
  convolution (kernel K, dilation ``ngram_size``) and SiLU; the layer adds gated value plus
  convolution to the streams.

The rows come from a ``rows.RowStore`` (resident or read by row from the checkpoint): the
layer is handed them (``PLELayer.__call__(h, rows, ...)``) and never reads a table itself.
Its state per sequence is a ``LinearState`` whose ``conv`` is the convolution window
[C, (K-1) * dilation] and whose ``rec`` is the last ``ngram_size - 1`` token ids (EOS at the
start): snapshots, rewinds and prefix reuse work as for a linear-attention layer.

Shape legend: T rows, n streams, H hidden, E embedding width, C = n * H channels.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..quant import linear
from .gated_delta import LinearState
from .gated_residual import GroupedNorm
from .pointwise import pointwise

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_LAYER_PRIME = 10007


def _splitmix64(v: int) -> int:
    v = (v + _GAMMA) & _MASK64
    v = ((v ^ (v >> 30)) * _M1) & _MASK64
    v = ((v ^ (v >> 27)) * _M2) & _MASK64
    return (v ^ (v >> 31)) & _MASK64


def multipliers(vocab: int, ngram: int, ple_index: int, seed: int) -> list[int]:
    """The odd per-shift hash multipliers of the ``ple_index``-th PLE layer (below 2^63 / vocab)."""
    half = max(1, ((1 << 63) - 1) // max(vocab, 1) // 2)
    base = seed + _LAYER_PRIME * ple_index
    return [2 * (_splitmix64((base + _GAMMA * (i + 1)) & _MASK64) % half) + 1 for i in range(ngram)]


def _is_prime(v: int) -> bool:
    if v < 2:
        return False
    if v % 2 == 0:
        return v == 2
    return all(v % d for d in range(3, math.isqrt(v) + 1, 2))


def head_sizes(base: int, first: int, count: int) -> list[int]:
    """The prime table sizes of heads ``first .. first + count - 1`` (head i: the (i+1)-th prime
    at or above ``base``), counting heads over all PLE layers."""
    out, p, found = [], base - 1, 0
    while len(out) < count:
        p += 1
        while not _is_prime(p):
            p += 1
        if found >= first:
            out.append(p)
        found += 1
    return out


class NGramHash:
    """Row ids of one PLE layer's table: ``ngram`` the largest order, ``heads`` per order, the
    ``ple_index``-th PLE layer; ``sizes`` / ``offsets`` per head; ``rows`` the table's rows
    (the total rounded up to ``divisor``)."""

    def __init__(self, *, vocab: int, ngram: int, heads: int, base: int, divisor: int, seed: int, ple_index: int,
                 eos: int):
        self.ngram, self.heads, self.eos = ngram, heads, int(eos)
        n_heads = (ngram - 1) * heads
        self.sizes = head_sizes(base, ple_index * n_heads, n_heads)
        self.offsets = [sum(self.sizes[:i]) for i in range(n_heads)]
        self.rows = -(-sum(self.sizes) // divisor) * divisor
        self.mult = multipliers(vocab, ngram, ple_index, seed)
        self._sizes = torch.tensor(self.sizes, dtype=torch.long)
        self._offsets = torch.tensor(self.offsets, dtype=torch.long)

    def shifted(self, context: list[int], tokens: list[int]) -> torch.Tensor:
        """[ngram, T]: row s holds each token's s-th predecessor (EOS past an EOS or the start);
        ``context``: the ``ngram - 1`` tokens before ``tokens`` (EOS-padded)."""
        hist = list(context) + list(tokens)
        c, eos = len(context), self.eos
        out = torch.empty(self.ngram, len(tokens), dtype=torch.long)
        for j in range(len(tokens)):
            i = c + j
            out[0, j] = hist[i]
            cut = False
            for s in range(1, self.ngram):
                cut = cut or hist[i - s] == eos
                out[s, j] = eos if cut else hist[i - s]
        return out

    def row_ids(self, context: list[int], tokens: list[int]) -> torch.Tensor:
        """[T, (ngram - 1) * heads] table rows of ``tokens`` after ``context``."""
        sh = self.shifted(context, tokens)
        mixed = sh[0] * self.mult[0]
        blocks = []
        for n in range(2, self.ngram + 1):
            mixed = torch.bitwise_xor(mixed, sh[n - 1] * self.mult[n - 1])
            lo = (n - 2) * self.heads
            sizes, offs = self._sizes[lo : lo + self.heads], self._offsets[lo : lo + self.heads]
            blocks.append(torch.remainder(mixed.unsqueeze(-1), sizes) + offs)
        return torch.cat(blocks, dim=-1)


class PLELayer:
    """One PLE block (module docstring): ``key`` [C, E], ``value`` [H, E], norms [C] ((1 + w),
    grouped by stream), ``conv`` [C, 1, K] with dilation ``dilation``."""

    def __init__(self, *, key, value, norm_key, norm_query, norm_conv, conv: torch.Tensor, n: int, hidden: int,
                 dilation: int, eps: float, hasher: NGramHash, table: str):
        self.key, self.value, self.conv = key, value, conv
        self.norm_key, self.norm_query, self.norm_conv = (GroupedNorm(w, n, hidden, eps)
                                                          for w in (norm_key, norm_query, norm_conv))
        self.n, self.hidden, self.dilation = n, hidden, dilation
        self.kernel = conv.shape[-1]
        self.window = (self.kernel - 1) * dilation
        self.hasher, self.table = hasher, table

    @staticmethod
    def nbytes(channels: int, kernel: int, dilation: int, ngram: int) -> int:
        """One sequence's state: the convolution window and the token context."""
        return 4 * channels * (kernel - 1) * dilation + 8 * (ngram - 1)

    def new_state(self) -> LinearState:
        return LinearState()

    def context(self, state: LinearState) -> list[int]:
        return [self.hasher.eos] * (self.hasher.ngram - 1) if state.rec is None else state.rec.tolist()

    def _conv(self, x: torch.Tensor, window: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal depthwise convolution with dilation, then SiLU: x [T, C] -> ([T, C], new window)."""
        t, c = x.shape
        w = self.conv.float().reshape(c, -1)
        if window is None:
            window = x.new_zeros(c, self.window)
        xp = torch.cat([window, x.t()], dim=1)  # [C, window + T]
        y = xp[:, 0:t] * w[:, 0:1]
        for i in range(1, self.kernel):
            o = i * self.dilation
            y = y + xp[:, o : o + t] * w[:, i : i + 1]
        return pointwise(F.silu, y.t().contiguous()), xp[:, xp.shape[1] - self.window:].clone()

    def __call__(self, h: torch.Tensor, emb: torch.Tensor, segs, tokens: torch.Tensor) -> torch.Tensor:
        """What the layer adds to streams ``h`` [T, C]: ``emb`` [T, E] the rows of every token,
        ``segs`` (first row, end row, start, state) per sequence, ``tokens`` [T] the step's ids."""
        t, n, hd = h.shape[0], self.n, self.hidden
        key = self.norm_key(linear(emb, self.key)).view(t, n, hd)
        value = linear(emb, self.value)
        query = self.norm_query(h).view(t, n, hd)
        gate = (key * query).sum(dim=-1, keepdim=True) / math.sqrt(hd)
        gate = pointwise(torch.sqrt, gate.abs().clamp_min(1e-6)) * gate.sign()
        gated = (pointwise(torch.sigmoid, gate) * value.unsqueeze(1)).view(t, n * hd)
        normed = self.norm_conv(gated)
        out = []
        for r0, r1, start, state in segs:
            state.check(start)
            y, window = self._conv(normed[r0:r1], state.conv)
            ctx = self.context(state) + tokens[r0:r1].tolist()
            state.advance(start, window, torch.tensor(ctx[-(self.hasher.ngram - 1):], dtype=torch.long), r1 - r0)
            out.append(y)
        return gated + (out[0] if len(out) == 1 else torch.cat(out))


__all__ = ["NGramHash", "PLELayer", "head_sizes", "multipliers"]
