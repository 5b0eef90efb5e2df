"""Attention with a sigmoid output gate (Qwen3-Next full-attention layers).

``q_proj`` yields, per head, the query and a gate of the same width; the attention output
is multiplied by ``sigmoid(gate)`` before ``o_proj``. q/k norms are per head and may use the
(1 + weight) form.
"""

from __future__ import annotations

import torch

from ..quant import linear
from .attention import Attention
from .norm import RMSNorm
from .pointwise import pointwise
from .rotary import apply_rotary


class GatedAttention(Attention):
    def __init__(self, *, norm_offset: float = 0.0, **kw):
        super().__init__(qk_norm="head", **kw)
        eps = self.q_norm.eps
        self.q_norm = RMSNorm(kw["q_norm"], eps, offset=norm_offset)
        self.k_norm = RMSNorm(kw["k_norm"], eps, offset=norm_offset)

    def segments(self, x: torch.Tensor, segs, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        qg = linear(x, self.wq, self.bq).view(t, self.n_heads, 2 * d)
        q, gate = qg[..., :d], qg[..., d:].reshape(t, -1)
        k = linear(x, self.wk, self.bk).view(t, self.n_kv, d)
        v = linear(x, self.wv, self.bv).view(t, self.n_kv, d)
        q = apply_rotary(self.q_norm(q), cos, sin)
        k = apply_rotary(self.k_norm(k), cos, sin)
        o = self.attend_segments(q, k, v, segs)
        return linear(o.reshape(t, -1) * pointwise(torch.sigmoid, gate), self.wo, self.bo)
