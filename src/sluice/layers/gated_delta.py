"""Gated delta-rule linear attention: Gated DeltaNet (Qwen3-Next) and Kimi Delta Attention.

Both layers keep, per sequence, a short causal-convolution window and a recurrent state
``S`` [H, Dk, Dv] updated by the gated delta rule::

    S_t = diag(a_t) S_{t-1} + k_t u_t^T,    u_t = beta_t (v_t - (diag(a_t) S_{t-1})^T k_t)
    o_t = S_t^T q_t

with ``a_t = exp(g_t)``: one decay per head (Gated DeltaNet, g [H, T]) or one per key
channel (KDA, g [H, T, Dk]). With batch-invariant kernels (the default) every forward runs
that recurrence token by token in C (``cpu.delta_rule``), so a prefill chunk of any size
gives the bits of decoding; otherwise a forward of one token uses the recurrence and a longer
one the equivalent chunked form (a unit-triangular solve per chunk, then one state update per
chunk). The two agree to fp32 rounding.

State tensors are never updated in place: every forward builds new ones, so a snapshot of
a layer state is a pair of references (see ``LinearState``).

Weights of two or more dimensions (the projections, the conv kernels, KDA's 4-D ``A_log``)
may be views into a spine stream buffer that is refilled before every forward (see
``spine.py``): the layers keep them as given and derive from them (fp32 conv kernels,
``-exp(A_log)``) inside each call. Only 1-D tensors, always resident, are converted once.

Shape legend: T tokens, H heads (value heads), Dk key head dim, Dv value head dim,
C convolution channels, K convolution kernel width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.backend import cpu
from ..quant import linear
from .mlp import activation
from .pointwise import pointwise

# Snapshots each recurrent layer keeps besides its current state (the most recent marks).
SNAPSHOTS = 2
# Chunk length of the chunked delta rule (as transformers uses) ...
CHUNK = 64
# ... reduced for per-channel decays so the pairwise decay block [H, c, c, Dk] stays bounded.
DECAY_BLOCK_BYTES = 16 << 20


class LinearState:
    """One linear-attention layer's state for one sequence, with snapshots.

    ``conv`` [C, K-1] holds the last K-1 convolution inputs, ``rec`` [H, Dk, Dv] the
    recurrent state; both None at position 0 (zeros). ``pos`` is the number of positions
    the state has absorbed. ``mark(n)`` keeps a reference to the current pair (position
    ``n``); the ``SNAPSHOTS`` most recent marks are kept. Position 0 and the current
    position are always restorable; ``rewind`` drops snapshots past the target, since
    what follows may differ from then on.
    """

    def __init__(self, keep: int = SNAPSHOTS):
        self.keep = keep
        self.pos = 0
        self.conv: torch.Tensor | None = None
        self.rec: torch.Tensor | None = None
        self.snaps: dict[int, tuple[torch.Tensor | None, torch.Tensor | None]] = {}

    @staticmethod
    def nbytes(channels: int, kernel: int, heads: int, dk: int, dv: int) -> int:
        """Bytes of one state (conv window + recurrent state), fp32."""
        return 4 * (channels * max(kernel - 1, 0) + heads * dk * dv)

    def restorable(self, n: int) -> int:
        if n >= self.pos:
            return self.pos
        return max([0] + [p for p in self.snaps if p <= n])

    def rewind(self, n: int) -> None:
        if n != self.pos:
            if n == 0:
                self.conv, self.rec = None, None
            elif n in self.snaps:
                self.conv, self.rec = self.snaps[n]
            else:
                raise ValueError(f"linear-attention state cannot return to position {n} (no snapshot)")
            self.pos = n
        self.snaps = {p: s for p, s in self.snaps.items() if p <= n}

    def mark(self, n: int) -> None:
        if n != self.pos or n == 0 or self.keep <= 0:
            return  # position 0 is always restorable; a state not at n has nothing to keep
        self.snaps.pop(n, None)
        self.snaps[n] = (self.conv, self.rec)
        while len(self.snaps) > self.keep:
            del self.snaps[next(iter(self.snaps))]

    def save(self) -> tuple:
        return self.pos, self.conv, self.rec, dict(self.snaps)

    def restore(self, saved: tuple) -> None:
        self.pos, self.conv, self.rec, snaps = saved
        self.snaps = dict(snaps)

    def advance(self, start: int, conv: torch.Tensor, rec: torch.Tensor, t: int) -> None:
        self.conv, self.rec, self.pos = conv, rec, start + t

    def check(self, start: int) -> None:
        if start != self.pos:
            raise RuntimeError(f"linear-attention state is at position {self.pos}, forward starts at {start} "
                               "(rewind the state first)")


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def causal_conv(x: torch.Tensor, window: torch.Tensor | None, weight: torch.Tensor, act
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution then activation. x [T, C]; window [C, K-1] or None (zeros);
    weight [C, K] fp32. Returns (y [T, C], new window [C, K-1])."""
    t, c = x.shape
    k = weight.shape[1]
    if window is None:
        window = x.new_zeros(c, k - 1)
    xp = torch.cat([window, x.t()], dim=1)  # [C, K-1+T]
    y = xp[:, 0:t] * weight[:, 0:1]  # K shifted multiply-adds (cheaper than a depthwise conv1d call)
    for i in range(1, k):
        y = y + xp[:, i : i + t] * weight[:, i : i + 1]
    return act(y.t().contiguous()), xp[:, xp.shape[1] - (k - 1):].clone()


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, act) -> torch.Tensor:
    """``weight * rmsnorm(x) * act(gate)`` over the last dim (fp32)."""
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x * pointwise(act, gate)


def delta_rule_step(q, k, v, g, beta, S):
    """One token. q, k [H, Dk]; v [H, Dv]; g [H] or [H, Dk]; beta [H]; S [H, Dk, Dv] or None."""
    h, dk = k.shape
    if S is None:
        S = k.new_zeros(h, dk, v.shape[-1])
    a = pointwise(torch.exp, g)
    S = S * (a[:, None, None] if a.dim() == 1 else a[:, :, None])
    kv = torch.matmul(k[:, None, :], S)[:, 0]  # S^T k: [H, Dv]
    u = (v - kv) * beta[:, None]
    S = S + k[:, :, None] * u[:, None, :]
    o = torch.matmul(q[:, None, :], S)[:, 0]
    return o, S


def _chunk_len(h: int, dk: int, per_channel: bool) -> int:
    if not per_channel:
        return CHUNK
    c = CHUNK
    while c > 8 and 4 * h * c * c * dk > DECAY_BLOCK_BYTES:
        c //= 2
    return c


def delta_rule_chunked(q, k, v, g, beta, S, chunk: int | None = None):
    """Chunked form over T tokens. q, k [H, T, Dk]; v [H, T, Dv]; g [H, T] or [H, T, Dk];
    beta [H, T]; S [H, Dk, Dv] or None. Returns (o [H, T, Dv], S)."""
    h, t, dk = k.shape
    dv = v.shape[-1]
    per_channel = g.dim() == 3
    c_len = chunk or _chunk_len(h, dk, per_channel)
    if S is None:
        S = k.new_zeros(h, dk, dv)
    out = torch.empty(h, t, dv, dtype=v.dtype)
    for c0 in range(0, t, c_len):
        c1 = min(t, c0 + c_len)
        n = c1 - c0
        qc, kc, vc, bc = q[:, c0:c1], k[:, c0:c1], v[:, c0:c1], beta[:, c0:c1]
        G = g[:, c0:c1].cumsum(1)  # log of the decay from the chunk start: [H, n] or [H, n, Dk]
        upper = torch.ones(n, n, dtype=torch.bool).triu(1)
        if per_channel:
            # [H, n(t), n(j), Dk]: exp(G_t - G_j) (zero above the diagonal) times k_j, one block in place
            kd = (G[:, :, None, :] - G[:, None, :, :]).masked_fill_(upper[None, :, :, None], float("-inf"))
            kd = kd.exp_().mul_(kc[:, None, :, :])
            kk = torch.matmul(kd, kc[:, :, :, None])[..., 0]  # sum_d k_t,d k_j,d exp(G_t,d - G_j,d)
            qk = torch.matmul(kd, qc[:, :, :, None])[..., 0]
            del kd
            eG = G.exp()  # [H, n, Dk]
            g_end = G[:, -1]  # [H, Dk]
            k_end = kc * (g_end[:, None, :] - G).exp()
            s_decay = g_end.exp()[:, :, None]
        else:
            diff = (G[:, :, None] - G[:, None, :]).masked_fill(upper, float("-inf"))
            decay = diff.exp_()  # [H, n, n]
            kk = torch.matmul(kc, kc.transpose(1, 2)) * decay
            qk = torch.matmul(qc, kc.transpose(1, 2)) * decay
            eG = G.exp()[:, :, None]
            g_end = G[:, -1]
            k_end = kc * (g_end[:, None] - G).exp()[:, :, None]
            s_decay = g_end.exp()[:, None, None]
        # (I + A) U = beta v - beta (exp(G) k) S, A[t, j] = beta_t k_t.decay.k_j for j < t
        a = (kk * bc[:, :, None]).tril(-1)
        rhs = torch.cat([vc * bc[:, :, None], kc * eG * bc[:, :, None]], dim=-1)  # [H, n, Dv + Dk]
        w = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)
        u = w[..., :dv] - torch.matmul(w[..., dv:], S)  # [H, n, Dv]
        out[:, c0:c1] = torch.matmul(qc * eG, S) + torch.matmul(qk, u)
        S = S * s_decay + torch.matmul(k_end.transpose(1, 2), u)
    return out, S


def delta_rule(q, k, v, g, beta, S):
    """Recurrent form for one token, chunked form otherwise. Same shapes as ``delta_rule_chunked``.

    With batch-invariant kernels (the default) every token takes the recurrent step, on inputs
    laid out as a lone token's, so a prefill chunk of any size gives the bits of token-by-token
    decoding (the chunked form is another summation order: it agrees to fp32 rounding only)."""
    if cpu.batch_invariant() and q.dtype == torch.float32:
        # the C recurrence: the same arithmetic per token whatever T is
        a = pointwise(torch.exp, g)
        o, S = cpu.delta_rule(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), a.transpose(0, 1),
                                  beta.t(), S)
        return o.transpose(0, 1), S
    if cpu.batch_invariant():
        outs = []
        for i in range(k.shape[1]):
            o, S = delta_rule_step(q[:, i].contiguous(), k[:, i].contiguous(), v[:, i].contiguous(),
                                   g[:, i].contiguous(), beta[:, i].contiguous(), S)
            outs.append(o)
        return torch.stack(outs, dim=1), S
    if k.shape[1] == 1:
        o, S = delta_rule_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], S)
        return o[:, None], S
    return delta_rule_chunked(q, k, v, g, beta, S)


class _LinearAttention:
    """What Gated DeltaNet and KDA share: conv window, state bookkeeping, output."""

    act = None

    def new_cache(self, max_ctx: int) -> LinearState:
        return LinearState()

    def conv_weight(self) -> torch.Tensor:
        """The depthwise conv kernel over the concatenated q/k/v channels, fp32 [C, K]."""
        raise NotImplementedError

    def __call__(self, x: torch.Tensor, start: int, state: LinearState, cos=None, sin=None) -> torch.Tensor:
        return self.segments(x, [(0, x.shape[0], start, state)])

    def _mix(self, qkv: torch.Tensor, segs) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Causal conv + activation over the concatenated q/k/v [T, C], each sequence's rows from its
        own window; (y, each sequence's new window)."""
        weight = self.conv_weight()
        ys, windows = [], []
        for r0, r1, start, state in segs:
            state.check(start)
            y, window = causal_conv(qkv[r0:r1], state.conv, weight, self.act)
            ys.append(y)
            windows.append(window)
        return (ys[0] if len(ys) == 1 else torch.cat(ys)), windows

    @staticmethod
    def _recur(q, k, v, g, beta, segs, windows) -> torch.Tensor:
        """The delta rule per sequence from its own state ([T, H, ...] inputs); advances the states.
        Returns o [T, H, Dv]."""
        outs = []
        for (r0, r1, start, state), window in zip(segs, windows):
            o, rec = delta_rule(q[r0:r1].transpose(0, 1), k[r0:r1].transpose(0, 1), v[r0:r1].transpose(0, 1),
                                g[r0:r1].transpose(0, 1), beta[r0:r1].t(), state.rec)
            state.advance(start, window, rec, r1 - r0)
            outs.append(o.transpose(0, 1))
        return outs[0] if len(outs) == 1 else torch.cat(outs)


class GatedDeltaNet(_LinearAttention):
    """Qwen3-Next linear attention: fused q/k/v/z and b/a projections grouped per key head,
    causal conv over q/k/v, GQA-style key heads (each serves H / Hk value heads), scalar
    decay per head ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``,
    gated RMSNorm with SiLU(z), output projection."""

    def __init__(self, *, w_qkvz, w_ba, conv_weight, a_log, dt_bias, norm_weight, w_out,
                 n_k: int, n_v: int, dk: int, dv: int, act: str, eps: float, gate: str = "silu"):
        self.w_qkvz, self.w_ba, self.w_out = w_qkvz, w_ba, w_out
        # the output gate's activation: SiLU (Qwen3-Next, Qwen3.5) or sigmoid (Qwen4-Exp's output_gate_type)
        self.gate_fn = torch.sigmoid if gate == "sigmoid" else F.silu
        self.conv = conv_weight  # [C, 1, K], possibly streamed: used as stored
        self.neg_a = -a_log.float().exp()  # a_log is 1-D [H]: resident
        self.dt_bias = dt_bias.float()
        self.norm_weight = norm_weight.float()
        self.n_k, self.n_v, self.dk, self.dv = n_k, n_v, dk, dv
        self.act = activation(act)
        self.eps = eps

    def conv_weight(self) -> torch.Tensor:
        w = self.conv
        return w.float().reshape(w.shape[0], -1)  # a view for fp32 weights, an upcast per call otherwise

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q/k/v concatenated [T, C], z [T, H, Dv], b [T, H], a [T, H]) from the fused projections,
        whose rows are grouped per key head: each group's q, k, v, z (and b, a) together."""
        t = x.shape[0]
        nk, r, dk, dv = self.n_k, self.n_v // self.n_k, self.dk, self.dv
        qkvz = linear(x, self.w_qkvz).view(t, nk, 2 * dk + 2 * r * dv)
        q, k, v, z = torch.split(qkvz, [dk, dk, r * dv, r * dv], dim=-1)
        ba = linear(x, self.w_ba).view(t, nk, 2 * r)
        b, a = ba[..., :r].reshape(t, self.n_v), ba[..., r:].reshape(t, self.n_v)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return mixed, z.reshape(t, self.n_v, dv), b, a

    def segments(self, x: torch.Tensor, segs: list[tuple[int, int, int, LinearState]], cos=None, sin=None
                 ) -> torch.Tensor:
        """Rows of several sequences (first row, end row, start position, state): projections on all
        rows at once, the conv window and the recurrence per sequence on its own state."""
        t = x.shape[0]
        nk, r, dk, dv = self.n_k, self.n_v // self.n_k, self.dk, self.dv
        mixed, z, b, a = self._project(x)
        mixed, windows = self._mix(mixed, segs)
        kd = nk * dk
        q = mixed[:, :kd].view(t, nk, dk)
        k = mixed[:, kd : 2 * kd].view(t, nk, dk)
        v = mixed[:, 2 * kd :].view(t, self.n_v, dv)
        if r > 1:
            q, k = q.repeat_interleave(r, dim=1), k.repeat_interleave(r, dim=1)
        q = l2norm(q) * dk**-0.5
        k = l2norm(k)
        beta = pointwise(torch.sigmoid, b)
        g = self.neg_a * pointwise(F.softplus, a + self.dt_bias)
        o = self._recur(q, k, v, g, beta, segs, windows)
        o = gated_rms_norm(o, z, self.norm_weight, self.eps, self.gate_fn)
        return linear(o.reshape(t, -1), self.w_out)


class SplitGatedDeltaNet(GatedDeltaNet):
    """Qwen3.5's Gated DeltaNet: the same layer with one projection each for q/k/v (rows: every
    key head's q, then every k, then every value head's v: the conv's channel order), z [H*Dv],
    b [H] and a [H] (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``)."""

    def __init__(self, *, w_qkv, w_z, w_b, w_a, conv_weight, a_log, dt_bias, norm_weight, w_out,
                 n_k: int, n_v: int, dk: int, dv: int, act: str, eps: float, gate: str = "silu"):
        super().__init__(w_qkvz=None, w_ba=None, conv_weight=conv_weight, a_log=a_log, dt_bias=dt_bias,
                         norm_weight=norm_weight, w_out=w_out, n_k=n_k, n_v=n_v, dk=dk, dv=dv, act=act, eps=eps,
                         gate=gate)
        self.w_qkv, self.w_z, self.w_b, self.w_a = w_qkv, w_z, w_b, w_a

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        t = x.shape[0]
        return (linear(x, self.w_qkv), linear(x, self.w_z).view(t, self.n_v, self.dv), linear(x, self.w_b),
                linear(x, self.w_a))


class KimiDeltaAttention(_LinearAttention):
    """Kimi Delta Attention: separate q/k/v projections with their own causal convs,
    per-channel decay ``g = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias)``, or with
    ``lower_bound`` (GLM-5.3-Flash's bounded forget gate, ``linear_lower_bound``)
    ``g = lower_bound * sigmoid(exp(A_log) * (f_b(f_a(x)) + dt_bias))``, ``beta = sigmoid(b(x))``,
    gated RMSNorm with sigmoid(g_b(g_a(x))), output projection. ``A_log`` has one value per head
    ([H], or Kimi's [1, 1, H, 1])."""

    def __init__(self, *, wq, wk, wv, q_conv, k_conv, v_conv, f_a, f_b, a_log, dt_bias, w_b, g_a, g_b, norm_weight,
                 w_out, n_heads: int, head_dim: int, act: str, eps: float, lower_bound: float | None = None):
        self.wq, self.wk, self.wv, self.w_out = wq, wk, wv, w_out
        self.convs = (q_conv, k_conv, v_conv)  # each [C, 1, K], possibly streamed: used as stored
        self.f_a, self.f_b, self.w_b, self.g_a, self.g_b = f_a, f_b, w_b, g_a, g_b
        self.a_log = a_log  # [1, 1, H, 1], possibly streamed: -exp(A_log) is taken per call
        self.dt_bias = dt_bias.float().reshape(n_heads, head_dim)
        self.norm_weight = norm_weight.float()
        self.n_heads, self.head_dim = n_heads, head_dim
        self.act = activation(act)
        self.eps = eps
        self.lower_bound = lower_bound

    def conv_weight(self) -> torch.Tensor:
        w = torch.cat(self.convs, dim=0)
        return w.float().reshape(w.shape[0], -1)

    def segments(self, x: torch.Tensor, segs: list[tuple[int, int, int, LinearState]], cos=None, sin=None
                 ) -> torch.Tensor:
        t = x.shape[0]
        h, d = self.n_heads, self.head_dim
        mixed = torch.cat([linear(x, self.wq), linear(x, self.wk), linear(x, self.wv)], dim=-1)
        mixed, windows = self._mix(mixed, segs)
        mixed = mixed.view(t, 3, h, d)
        q = l2norm(mixed[:, 0]) * d**-0.5
        k = l2norm(mixed[:, 1])
        v = mixed[:, 2]
        f = linear(linear(x, self.f_a), self.f_b).view(t, h, d) + self.dt_bias
        rate = self.a_log.float().exp().reshape(h, 1)
        if self.lower_bound is None:
            g = -rate * pointwise(F.softplus, f)  # [T, H, D]
        else:
            g = self.lower_bound * pointwise(torch.sigmoid, rate * f)
        beta = pointwise(torch.sigmoid, linear(x, self.w_b))  # [T, H]
        o = self._recur(q, k, v, g, beta, segs, windows)
        gate = linear(linear(x, self.g_a), self.g_b).view(t, h, d)
        o = gated_rms_norm(o, gate, self.norm_weight, self.eps, torch.sigmoid)
        return linear(o.reshape(t, -1), self.w_out)
