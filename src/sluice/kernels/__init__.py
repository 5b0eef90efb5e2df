"""ctypes bindings to Sluice's C kernels, with torch fallbacks when they are not built.

``dense(x, w, bias)`` multiplies fp32 activations [T, K] by an f32/bf16/f16 weight [N, K]
without materialising an fp32 copy of the weight, using a persistent C thread pool;
``fp8_dense`` does the same for a block-scaled FP8 weight (``quant.fp8``), and
``dense_t(x, w, bias)`` does the same for an input-major weight [K, N] (``x @ w``).
``qmatmul`` / ``qdequant`` do the same for the quantized formats of ``sluice.quant``
(fused dequantize-and-multiply, and bounded row dequantization for batched prefill).
Callers check ``available()`` first; ``sluice.quant`` holds the torch fallbacks. Code outside
this package reaches these functions only through ``kernels.backend`` (``cpu``, the same
function objects; tests/test_backend.py checks it).
"""

from __future__ import annotations

import ctypes
import glob
import os

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
_WTYPE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _find_library() -> str | None:
    pkg = os.path.dirname(_HERE)
    for pattern in ("_kernels*.so", "_kernels*.pyd"):
        found = sorted(glob.glob(os.path.join(pkg, pattern)))
        if found:
            return found[0]
    return None


class _Lib:
    def __init__(self):
        self.lib = None
        self.qmatmul = None
        self.threads = 1
        self.error: str | None = None
        self.fp8 = False
        self.chain = False
        self.invariant = False
        self.norm = False
        path = _find_library()
        if path is None:
            self.error = "C kernels not built (no compiler at install time?): using torch fallbacks"
            return
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            self.error = f"cannot load C kernels ({e}): using torch fallbacks"
            return
        p, i = ctypes.c_void_p, ctypes.c_int
        lib.sk_dense.argtypes = [p, p, p, p, i, i, i, i, i]
        lib.sk_dense.restype = None
        lib.sk_dense_t.argtypes = [p, p, p, p, i, i, i, i, i]
        lib.sk_dense_t.restype = None
        self.chain = hasattr(lib, "sk_dense_chain")
        if self.chain:
            lib.sk_dense_chain.argtypes = [p, p, p, p, i, i, i, i, i]
            lib.sk_dense_chain.restype = None
            lib.sk_transpose_f32.argtypes = [p, p, i, i, ctypes.c_longlong, ctypes.c_longlong, i, i]
            lib.sk_transpose_f32.restype = None
        lib.sk_swiglu.argtypes = [p, p, p, p, p, p, i, i, i, ctypes.c_float, i]
        lib.sk_swiglu.restype = None
        self.invariant = hasattr(lib, "sk_attend")  # the batch-invariant kernels (attention, swiglu rows)
        if self.invariant:
            lib.sk_allow_avx512.argtypes = [i]
            lib.sk_allow_avx512.restype = i
            if hasattr(lib, "sk_set_isa_cap"):
                lib.sk_set_isa_cap.argtypes = [i]
                lib.sk_set_isa_cap.restype = i
            lib.sk_swiglu_rows.argtypes = [p, p, p, p, p, p, i, i, i, i, ctypes.c_float, i]
            lib.sk_swiglu_rows.restype = None
            lib.sk_attend.argtypes = [p, p, p, p, p, i, i, i, i, i, i, i, ctypes.c_float, p, i]
            lib.sk_attend.restype = None
            lib.sk_delta_rule.argtypes = [p, p, p, p, p, p, p, i, i, i, i, i, i]
            lib.sk_delta_rule.restype = None
        self.norm = hasattr(lib, "sk_rmsnorm")  # per-layer pointwise kernels (norm.c)
        if self.norm:
            lib.sk_rmsnorm.argtypes = [p, p, p, p, p, i, i, ctypes.c_float]
            lib.sk_rmsnorm.restype = None
            lib.sk_rope.argtypes = [p, p, p, p, i, i, i, i]
            lib.sk_rope.restype = None
        lib.sk_set_threads.argtypes = [i]
        lib.sk_set_threads.restype = i
        lib.sk_has_avx2.restype = i
        self.fp8 = hasattr(lib, "sk_fp8_dense")
        if self.fp8:
            lib.sk_fp8_dense.argtypes = [p, p, p, p, p, i, i, i, i, i, i, i]
            lib.sk_fp8_dense.restype = None
            lib.sk_fp8_dequant.argtypes = [p, p, p, i, i, i, i, i, i]
            lib.sk_fp8_dequant.restype = None
            for f in (lib.sk_fp8_heads, lib.sk_fp8_heads_t):
                f.argtypes = [p, p, p, p, i, i, i, i, i, i, i, i, i]
                f.restype = None
        lib.sk_qmatmul.argtypes = [i, i, p, p, p, p, p, i, i, i, i]
        lib.sk_qmatmul.restype = i
        lib.sk_qdequant.argtypes = [i, p, p, p, i, i, i, i]
        lib.sk_qdequant.restype = i
        lib.sk_q8_activations.argtypes = [p, i, i, i, p, p, p]
        lib.sk_q8_activations.restype = None
        lib.sk_set_schedule.argtypes = [i]
        lib.sk_set_schedule.restype = None
        lib.sk_bench_sum.argtypes = [p, ctypes.c_size_t, i]
        lib.sk_bench_sum.restype = ctypes.c_float
        self.lib = lib
        self.qmatmul = lib.sk_qmatmul
        self.set_threads(torch.get_num_threads())

    def set_threads(self, n: int) -> None:
        if self.lib is not None:
            self.threads = max(1, min(n, self.lib.sk_set_threads(n)))


_lib = _Lib()


def available() -> bool:
    return _lib.lib is not None


# Batch invariance (the default): every product runs on C kernels whose per-output summation
# order does not depend on the number of rows, so a token's logits are the same decoded alone,
# in a prefill chunk of any size, or next to other sequences. Off: the fastest paths (sgemm and
# torch attention for larger batches), whose bits change with the batch shape. Benchmarks only.
_batch_invariant = True


def batch_invariant() -> bool:
    """Whether the batch-invariant kernels are in use (on, and the C kernels are built)."""
    return _batch_invariant and _lib.lib is not None and _lib.invariant and _lib.chain


def allow_avx512(on: bool) -> bool:
    """Tests and benchmarks: let the tiled product use AVX-512 where the CPU has it (default),
    or keep it on AVX2 (the same bits); returns whether the CPU has AVX-512F."""
    return bool(_lib.lib.sk_allow_avx512(int(on))) if _lib.invariant else False


# Instruction-set levels the C kernels dispatch on at run time (kernels/sk.h). Every level gives
# the bits of the AVX2 level; tests run each level the host has against it.
ISA_LEVELS = {0: "portable", 1: "avx2", 2: "avx512", 3: "avx512-vnni"}
_isa_cap = max(ISA_LEVELS)


def isa_levels() -> list[int]:
    """The levels this host can run, from AVX2 up (empty without the C kernels or AVX2)."""
    if _lib.lib is None or not hasattr(_lib.lib, "sk_set_isa_cap"):
        return []
    host = _lib.lib.sk_set_isa_cap(-1)
    return list(range(1, host + 1))


def set_isa_cap(level: int) -> int:
    """Tests and benchmarks: use at most ``level`` (``ISA_LEVELS``); returns the previous cap."""
    global _isa_cap
    prev, _isa_cap = _isa_cap, int(level)
    if _lib.lib is not None and hasattr(_lib.lib, "sk_set_isa_cap"):
        _lib.lib.sk_set_isa_cap(_isa_cap)
    return prev


def set_batch_invariant(on: bool) -> bool:
    """Turn batch-invariant kernels on (default) or off (benchmarks); returns the previous setting."""
    global _batch_invariant
    prev, _batch_invariant = _batch_invariant, bool(on)
    return prev


def set_threads(n: int) -> None:
    _lib.set_threads(n)


def info() -> dict:
    avx512 = bool(_lib.lib.sk_allow_avx512(-1)) if available() and _lib.invariant else False
    levels = isa_levels()
    return {"available": available(), "avx2": bool(_lib.lib.sk_has_avx2()) if available() else False,
            "avx512": avx512 and bool(_lib.lib.sk_has_avx2()),
            "isa": ISA_LEVELS[min(levels[-1], _isa_cap)] if levels else ISA_LEVELS[0],
            "threads": _lib.threads, "error": _lib.error}


def dense(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] fp32 (contiguous) @ w [N, K]^T (+ bias fp32 [N]) -> [T, N] fp32."""
    t, k = x.shape
    n = w.shape[0]
    y = torch.empty(t, n, dtype=torch.float32)
    _lib.lib.sk_dense(x.data_ptr(), w.data_ptr(), bias.data_ptr() if bias is not None else None, y.data_ptr(),
                      t, n, k, _WTYPE[w.dtype], _lib.threads)
    return y


def fp8_available() -> bool:
    return _lib.lib is not None and _lib.fp8


def fp8_dense(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
              block: tuple[int, int], r0: int = 0, r1: int | None = None) -> torch.Tensor:
    """x [T, K] fp32 @ W[r0:r1]^T (+ bias fp32 [r1 - r0]) for a block-FP8 W: w float8_e4m3fn [N, K]
    (contiguous), scale fp32 [ceil(N / bn), ceil(K / bk)] (contiguous) -> [T, r1 - r0] fp32."""
    t, k = x.shape
    r1 = w.shape[0] if r1 is None else r1
    y = torch.empty(t, r1 - r0, dtype=torch.float32)
    _lib.lib.sk_fp8_dense(x.data_ptr(), w.data_ptr(), scale.data_ptr(), bias.data_ptr() if bias is not None else None,
                          y.data_ptr(), t, r1 - r0, k, r0, block[0], block[1], _lib.threads)
    return y
def fp8_dequant(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], r0: int, r1: int) -> torch.Tensor:
    """Rows r0..r1 of a block-FP8 W as fp32 [r1 - r0, K], bit-identical to ``w.float() * scale``."""
    k = w.shape[1]
    out = torch.empty(r1 - r0, k, dtype=torch.float32)
    _lib.lib.sk_fp8_dequant(w.data_ptr(), scale.data_ptr(), out.data_ptr(), r1 - r0, k, r0, block[0], block[1],
                            _lib.threads)
    return out


def fp8_heads(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], row0: int, stride: int,
              n: int) -> torch.Tensor:
    """Per-head ``x[t, h] @ W[row0 + h*stride : + n]^T`` for a block-FP8 W; x [T, H, K] contiguous -> [T, H, n]."""
    t, h, k = x.shape
    y = torch.empty(t, h, n, dtype=torch.float32)
    _lib.lib.sk_fp8_heads(x.data_ptr(), w.data_ptr(), scale.data_ptr(), y.data_ptr(), t, h, n, k, row0, stride,
                          block[0], block[1], _lib.threads)
    return y


def fp8_heads_t(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], row0: int,
                stride: int) -> torch.Tensor:
    """Per-head ``x[t, h] @ W[row0 + h*stride : + D]`` for a block-FP8 W [N, K]; x [T, H, D] contiguous -> [T, H, K]."""
    t, h, d = x.shape
    k = w.shape[1]
    y = torch.empty(t, h, k, dtype=torch.float32)
    _lib.lib.sk_fp8_heads_t(x.data_ptr(), w.data_ptr(), scale.data_ptr(), y.data_ptr(), t, h, d, k, row0, stride,
                            block[0], block[1], _lib.threads)
    return y


def dense_t(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] fp32 (contiguous) @ w [K, N] (contiguous, input-major) (+ bias fp32 [N]) -> [T, N] fp32."""
    t, k = x.shape
    n = w.shape[1]
    y = torch.empty(t, n, dtype=torch.float32)
    _lib.lib.sk_dense_t(x.data_ptr(), w.data_ptr(), bias.data_ptr() if bias is not None else None, y.data_ptr(),
                        t, n, k, _WTYPE[w.dtype], _lib.threads)
    return y


def chain_available() -> bool:
    return _lib.lib is not None and _lib.chain


def dense_chain(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] fp32 (contiguous) @ w [N, K]^T (+ bias fp32 [N]) -> [T, N] fp32, each output summed
    in ``dense_t``'s order (one fma chain over k ascending): bit-identical to ``dense_t(x, w.T)``."""
    t, k = x.shape
    n = w.shape[0]
    y = torch.empty(t, n, dtype=torch.float32)
    _lib.lib.sk_dense_chain(x.data_ptr(), w.data_ptr(), bias.data_ptr() if bias is not None else None,
                            y.data_ptr(), t, n, k, _WTYPE[w.dtype], _lib.threads)
    return y


def transpose_f32(w: torch.Tensor) -> torch.Tensor:
    """w [K, N] f32/bf16/f16 (any strides) -> its transpose [N, K] as a new contiguous fp32 tensor."""
    k, n = w.shape
    out = torch.empty(n, k, dtype=torch.float32)
    _lib.lib.sk_transpose_f32(w.data_ptr(), out.data_ptr(), k, n, w.stride(0), w.stride(1), _WTYPE[w.dtype],
                              _lib.threads)
    return out


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, scale: float) -> torch.Tensor:
    """One token through a SwiGLU expert in one call: ``scale * down(silu(gate x) * up x)``.

    x [1, H] fp32 contiguous; gate/up [I, H] and down [H, I] contiguous, one dtype -> [1, H]."""
    i, h = gate.shape
    scratch = torch.empty(2 * i, dtype=torch.float32)
    y = torch.empty(1, h, dtype=torch.float32)
    _lib.lib.sk_swiglu(x.data_ptr(), gate.data_ptr(), up.data_ptr(), down.data_ptr(), scratch.data_ptr(),
                       y.data_ptr(), h, i, _WTYPE[gate.dtype], scale, _lib.threads)
    return y


def swiglu_args(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> tuple:
    """What ``swiglu_many`` needs of one expert's gate/up [I, H] and down [H, I] (contiguous, one
    dtype): their addresses, H, I and the weight type, taken once (the tensors must stay alive
    and in place: views over an expert cache slot, assembled when its read completed)."""
    i, h = gate.shape
    return gate.data_ptr(), up.data_ptr(), down.data_ptr(), h, i, _WTYPE[gate.dtype]


def swiglu_many(x: torch.Tensor, experts: list[tuple], scales: list[float]) -> list[torch.Tensor]:
    """One token through several SwiGLU experts: ``swiglu(x, gate, up, down, scale)`` of each,
    bit-identical (the same C call), with the per-call wrapper work done once: ``experts`` holds
    ``swiglu_args`` of each; returns one [1, H] output per expert."""
    if not x.is_contiguous():
        x = x.contiguous()
    h = x.shape[1]
    scratch = torch.empty(2 * max(a[4] for a in experts), dtype=torch.float32)
    xp, sp = x.data_ptr(), scratch.data_ptr()
    call, threads, empty, f32 = _lib.lib.sk_swiglu, _lib.threads, torch.empty, torch.float32
    out = []
    for (g, u, d, hh, i, wt), scale in zip(experts, scales):
        if hh != h:
            raise ValueError(f"swiglu_many: an expert of hidden size {hh} for activations of {h}")
        y = empty(1, h, dtype=f32)
        call(xp, g, u, d, sp, y.data_ptr(), h, i, wt, scale, threads)
        out.append(y)
    return out


def qmatmul(fmt: int, act: int, x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, n: int,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    """Fused quantized GEMV: x [T, K] fp32 contiguous (K already padded to the format's block),
    weight parts ``w`` (codes) and ``s`` (scales / codebooks) -> [T, n] fp32."""
    t, k = x.shape
    y = torch.empty(t, n, dtype=torch.float32)
    rc = _lib.qmatmul(fmt, act, x.data_ptr(), w.data_ptr(), s.data_ptr(), None if bias is None else bias.data_ptr(),
                      y.data_ptr(), t, n, k, _lib.threads)
    if rc != 0:
        _fail(rc, f"format {fmt} with K={k} and activation mode {act}")
    return y


def qdequant(fmt: int, w: torch.Tensor, s: torch.Tensor, n0: int, n1: int, k: int,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows [n0, n1) of a quantized matrix as fp32 [n1 - n0, k] (bit-identical to the reference)."""
    if out is None:
        out = torch.empty(n1 - n0, k, dtype=torch.float32)
    rc = _lib.lib.sk_qdequant(fmt, w.data_ptr(), s.data_ptr(), out.data_ptr(), n0, n1, k, _lib.threads)
    if rc != 0:
        _fail(rc, f"format {fmt} with K={k}")
    return out


def _fail(rc: int, what: str):
    if rc == -2:
        raise MemoryError(f"C kernels: out of memory for scratch buffers ({what})")
    raise ValueError(f"C kernels do not support {what}")


def q8_activations(x: torch.Tensor, layout: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The int8 activations the ACT_Q8 kernels use: (xq int8 [T, K], xd fp32 [T, K/32], xs fp32 [T, K/32]).
    layout 0: natural order; 1: each block of 32 as [even | odd] elements; 2: pairs of blocks
    as [evens g | evens g+1 | odds g | odds g+1] (an odd last block as in 1)."""
    t, k = x.shape
    xq = torch.empty(t, k, dtype=torch.int8)
    xd = torch.empty(t, k // 32, dtype=torch.float32)
    xs = torch.empty(t, k // 32, dtype=torch.float32)
    _lib.lib.sk_q8_activations(x.data_ptr(), t, k, layout, xq.data_ptr(), xd.data_ptr(), xs.data_ptr())
    return xq, xd, xs


def set_schedule(dynamic: bool) -> None:
    """Benchmarks only: dynamic chunk claiming (default) or one fixed part per thread (the old pool)."""
    if available():
        _lib.lib.sk_set_schedule(int(dynamic))


def bench_sum(a: torch.Tensor) -> float:
    """Benchmarks only: sum of a contiguous fp32 tensor on the kernels' thread pool (read bandwidth)."""
    return _lib.lib.sk_bench_sum(a.data_ptr(), a.numel(), _lib.threads)


def swiglu_rows(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                scale: float) -> torch.Tensor:
    """``swiglu`` for T tokens: x [T, H] -> [T, H]; each row bit-identical to ``swiglu`` on it alone."""
    t = x.shape[0]
    i, h = gate.shape
    scratch = torch.empty(2 * t * i, dtype=torch.float32)
    y = torch.empty(t, h, dtype=torch.float32)
    _lib.lib.sk_swiglu_rows(x.data_ptr(), gate.data_ptr(), up.data_ptr(), down.data_ptr(), scratch.data_ptr(),
                            y.data_ptr(), t, h, i, _WTYPE[gate.dtype], scale, _lib.threads)
    return y


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, scale: float,
           window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention, one (query, head) at a time in a fixed order (batch-invariant).

    q [T, Hq, D], k [Hkv, >= L, D], v [Hkv, >= L, Dv] fp32 with a contiguous last dimension,
    L = q_start + T; sinks fp32 [Hq] or None -> [T, Hq, Dv]."""
    t, hq, d = q.shape
    hkv, dv = k.shape[0], v.shape[-1]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("attend: keys and values need a contiguous last dimension")
    out = torch.empty(t, hq, dv, dtype=torch.float32)
    strides = (ctypes.c_long * 8)(q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                  out.stride(0), out.stride(1))
    if sinks is not None:
        sinks = sinks.float().contiguous()
    _lib.lib.sk_attend(q.data_ptr(), k.data_ptr(), v.data_ptr(), None if sinks is None else sinks.data_ptr(),
                       out.data_ptr(), t, hq, hkv, d, dv, q_start, window or 0, scale, strides, _lib.threads)
    return out


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, beta: torch.Tensor,
               S: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule's recurrence over T tokens, token by token (batch-invariant).

    q, k [T, H, Dk]; v [T, H, Dv]; a = exp(g): [T, H] or [T, H, Dk]; beta [T, H]; S [H, Dk, Dv]
    or None (zeros), all fp32 -> (o [T, H, Dv], new S). S is not modified."""
    t, h, dk = k.shape
    dv = v.shape[-1]
    S = torch.zeros(h, dk, dv, dtype=torch.float32) if S is None else S.float().clone()
    q, k, v, a, beta = (x.float().contiguous() for x in (q, k, v, a, beta))
    o = torch.empty(t, h, dv, dtype=torch.float32)
    _lib.lib.sk_delta_rule(q.data_ptr(), k.data_ptr(), v.data_ptr(), a.data_ptr(), beta.data_ptr(), S.data_ptr(),
                           o.data_ptr(), t, h, dk, dv, int(a.dim() == 3), _lib.threads)
    return o, S


def norm_available() -> bool:
    """Whether ``rmsnorm`` and ``rope`` run in C (kernels/norm.c)."""
    return _lib.lib is not None and _lib.norm


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float, res: torch.Tensor | None = None):
    """RMSNorm over the last dimension in one fixed summation order (kernels/norm.c), the same for
    any number of rows and on every ISA level. x [..., D] fp32, w fp32 [D] contiguous.

    Returns ``w * x / sqrt(mean(x^2) + eps)``; with ``res`` (x's shape), ``(x + res, its norm)``."""
    d = x.shape[-1]
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.float32)
    rows = x.numel() // d if d else 0
    if res is None:
        _lib.lib.sk_rmsnorm(x.data_ptr(), None, None, w.data_ptr(), out.data_ptr(), rows, d, eps)
        return out
    res = res.contiguous()
    h = torch.empty(x.shape, dtype=torch.float32)
    _lib.lib.sk_rmsnorm(x.data_ptr(), res.data_ptr(), h.data_ptr(), w.data_ptr(), out.data_ptr(), rows, d, eps)
    return h, out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half form: x [T, H, Dh] fp32, cos/sin [T, d] fp32 (d <= Dh, even)
    -> [T, H, Dh]: the first d dims of each head rotated, the rest copied. Bit-identical to
    ``x * cos + rotate_half(x) * sin`` (``layers.rotary.apply_rotary``'s torch form)."""
    t, h, dh = x.shape
    d = cos.shape[-1]
    x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(t, h, dh, dtype=torch.float32)
    _lib.lib.sk_rope(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), t, h, dh, d)
    return out
