"""fp32 activations x {f32, bf16, f16} weights, fp32 results.

The plain-dtype path under every format: it knows no format. A weight that is not a tensor
(``formats.QuantMatrix``, ``fp8.BlockFP8``) multiplies itself through its ``.linear(x, bias)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.backend import cpu

_CHUNK_ELEMS = 4 << 20  # bound on the fp32 temporary when upcasting a weight (16 MiB)
SMALL_BATCH = 8  # f32 weights: up to this many rows the C kernel; beyond, sgemm is as fast or faster
# bf16/f16 weights: the C kernel reads them as stored, sgemm needs an fp32 copy first. Measured
# on a 3584 x 1024 bf16 matrix (2 kernel threads): T=16 1.9 vs 2.8 ms, T=32 3.4 vs 3.6 ms (sgemm
# at 2 threads), T=48 5.5 vs 5.9 ms; warm prefill of the 3 GB benchmark model 41 -> see docs.
HALF_SMALL_BATCH = 32
# input-major families (``linear_chain``): up to this many rows the fma-chain kernels, beyond it
# sgemm on an fp32 copy (measured on 1024 x 1024 bf16, 1 thread: T=16 2.8 vs 3.0 ms, T=64 8.9 vs 4.0)
CHAIN_BATCH = 16


def chain_rows(t: int) -> bool:
    """Whether ``t`` rows go through the fma-chain kernels (``linear_chain``'s C path)."""
    return cpu.batch_invariant() or (t <= CHAIN_BATCH and cpu.chain_available())


def _rows(kernel, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A batch-invariant C kernel on x's rows (any leading shape)."""
    lead = x.shape[:-1]
    y = kernel(x.reshape(-1, x.shape[-1]).float().contiguous(), weight, bias)
    return y.reshape(*lead, y.shape[-1])


def embed(weight, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of an embedding table as fp32 [T, H]: a tensor's rows upcast, or a
    ``QuantMatrix``'s rows dequantized (an int8 spine's embedding)."""
    if isinstance(weight, torch.Tensor):
        return weight[ids].float()
    return weight.rows(ids)


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` in fp32. x: [T, K] fp32, weight: [N, K] f32/bf16/f16 tensor, or a
    ``QuantMatrix`` / ``BlockFP8`` (anything with ``.linear(x, bias)``).

    With batch-invariant kernels (the default, ``cpu.batch_invariant()``) every batch goes
    through the C kernel: each output's summation order is fixed, whatever the number of rows,
    the weight's alignment or the thread count (sgemm and BLAS GEMV depend on all three).
    Otherwise small batches go through the C kernel and larger ones use sgemm, upcasting
    half-precision weights in bounded row chunks (16 MiB at most). A ``QuantMatrix`` does the
    same with its format's kernels; another wrapper (``quant.fp8.BlockFP8``) multiplies itself.
    """
    if not isinstance(weight, torch.Tensor):
        return weight.linear(x, bias)
    if bias is not None and bias.dtype != torch.float32:  # e.g. bf16 biases next to f32 weights
        bias = bias.float()
    if cpu.batch_invariant():
        return _rows(cpu.dense, x, weight.contiguous(), bias)
    limit = SMALL_BATCH if weight.dtype == torch.float32 else HALF_SMALL_BATCH
    if x.dim() == 2 and x.shape[0] <= limit and cpu.available() and weight.is_contiguous():
        b = bias.float() if bias is not None and bias.dtype != torch.float32 else bias
        return cpu.dense(x.contiguous(), weight, b)
    if weight.dtype == torch.float32:
        return F.linear(x, weight, bias)
    n, k = weight.shape
    rows = max(1, _CHUNK_ELEMS // max(k, 1))
    if rows >= n:
        return F.linear(x, weight.float(), None if bias is None else bias.float())
    out = torch.empty(x.shape[:-1] + (n,), dtype=torch.float32)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        torch.matmul(x, weight[r0:r1].float().t(), out=out[..., r0:r1])
    if bias is not None:
        out += bias.float()
    return out


def linear_t(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight (+ bias)`` in fp32 for an input-major weight [K, N] (GPT-OSS experts on disk).

    Small batches use the input-major C kernel (one fused multiply-add chain per output, in
    ascending k: independent of batch size, alignment and thread count). Larger batches use
    sgemm, upcasting half-precision weights in bounded column chunks (16 MiB at most).
    """
    if bias is not None and bias.dtype != torch.float32:
        bias = bias.float()
    if cpu.batch_invariant():
        return _rows(cpu.dense_t, x, weight.contiguous(), bias)
    if x.dim() == 2 and x.shape[0] <= SMALL_BATCH and cpu.available() and weight.is_contiguous():
        return cpu.dense_t(x.contiguous(), weight, bias)
    if weight.dtype == torch.float32:
        out = x @ weight
    else:
        k, n = weight.shape
        cols = max(1, _CHUNK_ELEMS // max(k, 1))
        if cols >= n:
            out = x @ weight.float()
        else:
            out = torch.empty(x.shape[:-1] + (n,), dtype=torch.float32)
            for c0 in range(0, n, cols):
                c1 = min(n, c0 + cols)
                torch.matmul(x, weight[:, c0:c1].float(), out=out[..., c0:c1])
    if bias is not None:
        out += bias
    return out


def linear_chain(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 input_major: bool = False) -> torch.Tensor:
    """``x @ W (+ bias)`` summed in one order whichever way W is stored: ``weight`` is W [K, N]
    (``input_major``, e.g. a strided view into a fused GPT-OSS slice) or W.T [N, K] (canonical).

    Every batch with batch-invariant kernels (the default), else batches up to ``CHAIN_BATCH`` rows
    go through the C kernels: each output is one fused multiply-add chain over k in ascending
    order (``cpu.dense_t`` on input-major, ``cpu.dense_chain`` on output-major weights:
    the same bits, whatever the batch, tiling or thread count). Larger batches, or no C kernels:
    sgemm on a fresh fp32 input-major copy of W in bounded column blocks (from output-major
    weights: made by a tiled C transpose), the same call for both layouts (sgemm on W and on
    W.T gives other bits, and input-major B measured 2x faster at T=64). So a family whose checkpoints store experts
    input-major gives the same logits from its Hugging Face directory and from a container.
    """
    if bias is not None and bias.dtype != torch.float32:
        bias = bias.float()
    if cpu.batch_invariant():
        return _rows(cpu.dense_t if input_major else cpu.dense_chain, x, weight.contiguous(), bias)
    if x.dim() == 2 and x.shape[0] <= CHAIN_BATCH and weight.is_contiguous() and cpu.chain_available():
        kernel = cpu.dense_t if input_major else cpu.dense_chain
        return kernel(x.contiguous(), weight, bias)
    n = weight.shape[1] if input_major else weight.shape[0]
    k = weight.shape[0] if input_major else weight.shape[1]
    cols = max(1, _CHUNK_ELEMS // max(k, 1))
    out = torch.empty(x.shape[:-1] + (n,), dtype=torch.float32)
    for c0 in range(0, n, cols):
        c1 = min(n, c0 + cols)
        if input_major:  # W's columns as they are (a strided gather for a fused slice), upcast
            block = torch.empty((k, c1 - c0), dtype=torch.float32)
            block.copy_(weight[:, c0:c1])
        elif cpu.chain_available():  # W.T's rows, transposed by the C kernel (torch's is slow)
            block = cpu.transpose_f32(weight[c0:c1])
        else:
            block = torch.empty((k, c1 - c0), dtype=torch.float32)
            block.copy_(weight[c0:c1].t())
        torch.matmul(x, block, out=out[..., c0:c1])
    if bias is not None:
        out += bias
    return out
