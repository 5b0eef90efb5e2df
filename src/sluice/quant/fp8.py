"""Block-scaled FP8 weights, as DeepSeek-V3 and Kimi K2 ship them.

A weight matrix W [N, K] is stored as ``weight`` (``float8_e4m3fn`` [N, K]) and
``weight_scale_inv`` (fp32 [ceil(N / bn), ceil(K / bk)]) for a block of ``(bn, bk)``
(``weight_block_size`` in the config, [128, 128] in practice):

    W[n, k] = float(weight[n, k]) * weight_scale_inv[n // bn, k // bk]

Edge blocks are partial (ceil semantics, as DeepSeek's reference ``weight_dequant`` does).
Weights stay FP8 in memory; ``BlockFP8.linear`` multiplies fp32 activations by W without
materialising it: the C kernel for a few tokens (per-block partial sums scaled once), or
dequantizing bounded row blocks to fp32 followed by sgemm for larger batches. Activations
are never quantized: results match the model run on the dequantized fp32 weights.

``quant.linear`` dispatches here through the wrapper type (any non-tensor weight offers
``.linear(x, bias)``); ``FP8Format`` registers "fp8" in ``formats.FORMATS`` like every other
format, so ``quant.assemble`` pairs an expert record's ``<role>`` and ``<role>_scale_inv`` views
into one ``BlockFP8`` through the registry; ``parse_quantization_config`` reads the
checkpoint's ``quantization_config``.
"""

from __future__ import annotations

import re

import torch

from ..kernels.backend import cpu
from ..errors import CheckpointError, UnsupportedModelError
from .formats import Format, register

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
SCALE_SUFFIX = "_scale_inv"  # expert record part holding a role's block scales: "gate" + "gate_scale_inv"
FORMAT = "fp8"  # expert format name (container records, ``sluice inspect``)

_CHUNK_ELEMS = 4 << 20  # bound on the fp32 temporary when dequantizing row blocks (16 MiB)
SMALL_BATCH = 8  # up to this many rows the fused C kernel beats dequantize + sgemm


def parse_quantization_config(raw: dict | None, where: str = "config.json") -> tuple[int, int] | None:
    """The (bn, bk) weight block of a block-FP8 ``quantization_config``; None when there is none.

    Anything this module does not implement is refused rather than misread.
    """
    if not raw:
        return None
    if not isinstance(raw, dict):
        raise UnsupportedModelError(f"{where}: quantization_config must be an object, got {raw!r}")
    method = raw.get("quant_method")
    if method != "fp8":
        raise UnsupportedModelError(
            f"{where}: quantization_config.quant_method={method!r} is not supported (Sluice reads block-scaled "
            "FP8 checkpoints, quant_method 'fp8'; dequantize other formats first)")
    fmt = raw.get("fmt", "e4m3")
    if fmt not in ("e4m3", "float8_e4m3fn"):  # DeepSeek-V3 / MiniMax-M2 name the same format
        raise UnsupportedModelError(f"{where}: quantization_config.fmt={fmt!r} is not supported (only e4m3)")
    scheme = raw.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise UnsupportedModelError(
            f"{where}: quantization_config.activation_scheme={scheme!r} is not supported (only 'dynamic': "
            "static activation scales would be ignored)")
    block = raw.get("weight_block_size")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise UnsupportedModelError(
            f"{where}: quantization_config.weight_block_size={block!r} is not supported (expected two positive "
            "integers such as [128, 128]; per-tensor FP8 scales are not implemented)")
    if raw.get("modules_to_convert"):
        raise UnsupportedModelError(f"{where}: quantization_config.modules_to_convert is not supported")
    return int(block[0]), int(block[1])


def not_converted(raw: dict | None, module: str) -> bool:
    """True if ``module`` (e.g. ``model.layers.3.self_attn.q_a_proj``) is listed in ``modules_to_not_convert``:
    an entry naming it or a module it is in (``self_attn``, ``model.layers.3``), or one transformers
    skips it for (a regex from the start up to a module boundary, or a suffix: ``gate`` skips
    ``mlp.shared_expert_gate``, as transformers' ``should_convert_module`` does)."""
    skip = (raw or {}).get("modules_to_not_convert") or []
    return any(s and (module == s or module.startswith(s + ".") or f".{s}." in f".{module}." or module.endswith(s)
                      or _boundary_match(s, module)) for s in skip if isinstance(s, str))


def _boundary_match(pattern: str, module: str) -> bool:
    try:
        return re.match(rf"(?:{pattern})(?:(?<=\.)|(?=\.|$))", module) is not None
    except re.error:
        return False


def scale_shape(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))


class BlockFP8:
    """An [N, K] weight as FP8 values plus per-block fp32 scales (see the module docstring)."""

    __slots__ = ("weight", "stored_scale", "block")

    def __init__(self, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], name: str = "weight"):
        if weight.dtype != FP8 or weight.dim() != 2:
            raise CheckpointError(
                f"{name}: expected a 2-D float8_e4m3fn weight next to its weight_scale_inv, got {weight.dtype} "
                f"{list(weight.shape)}")
        want = scale_shape(tuple(weight.shape), block)
        if tuple(scale_inv.shape) != want:
            raise CheckpointError(
                f"{name}: weight_scale_inv has shape {list(scale_inv.shape)} but a {list(weight.shape)} weight in "
                f"{block[0]}x{block[1]} blocks needs {list(want)}")
        if not scale_inv.dtype.is_floating_point:
            raise CheckpointError(f"{name}: weight_scale_inv has dtype {scale_inv.dtype}; expected floating-point "
                                  "block scales (f32, bf16, f16 or e8m0)")
        # both may be views into a spine stream buffer, refilled per forward: kept as given (a
        # streamed view is contiguous), the scales converted to fp32 per use (see spine.py)
        self.weight = weight if weight.is_contiguous() else weight.contiguous()
        self.stored_scale = scale_inv if scale_inv.is_contiguous() else scale_inv.contiguous()
        self.block = (int(block[0]), int(block[1]))

    @property
    def scale_inv(self) -> torch.Tensor:
        """The block scales in fp32 (an upcast per use when stored as bf16/f16/e8m0: 1/(bn*bk)
        of the weight's elements)."""
        s = self.stored_scale
        return s if s.dtype == torch.float32 else s.float()

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def nbytes(self) -> int:
        return self.weight.numel() + 4 * self.stored_scale.numel()

    def __repr__(self) -> str:
        return f"BlockFP8({list(self.weight.shape)}, block={list(self.block)})"

    def dequantize(self, r0: int = 0, r1: int | None = None) -> torch.Tensor:
        """Rows r0..r1 of W in fp32 (exactly ``float(w) * scale``, elementwise)."""
        r1 = self.weight.shape[0] if r1 is None else r1
        if cpu.fp8_available():
            return cpu.fp8_dequant(self.weight, self.scale_inv, self.block, r0, r1)
        bn, bk = self.block
        k = self.weight.shape[1]
        n = r1 - r0
        out = self.weight[r0:r1].float()
        if r0 % bn == 0 and n % bn == 0:  # whole row blocks: one scale per (row block, column block)
            s = self.scale_inv[r0 // bn : r1 // bn].repeat_interleave(bn, dim=0)
        else:
            s = self.scale_inv.index_select(0, torch.arange(r0, r1) // bn)
        full = k // bk
        if full:
            out[:, : full * bk].unflatten(1, (full, bk)).mul_(s[:, :full, None])
        if full * bk < k:
            out[:, full * bk :].mul_(s[:, full:])
        return out

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None, r0: int = 0,
               r1: int | None = None) -> torch.Tensor:
        """``x @ W[r0:r1].T (+ bias)`` in fp32; x [T, K] fp32."""
        r1 = self.weight.shape[0] if r1 is None else r1
        if bias is not None and bias.dtype != torch.float32:
            bias = bias.float()
        if cpu.fp8_available() and (cpu.batch_invariant() or (x.dim() == 2 and x.shape[0] <= SMALL_BATCH)):
            # batch-invariant: every output's sum in one order, whatever the number of rows
            lead = x.shape[:-1]
            y = cpu.fp8_dense(x.reshape(-1, x.shape[-1]).contiguous(), self.weight, self.scale_inv, bias,
                                  self.block, r0, r1)
            return y.reshape(*lead, y.shape[-1])
        n, k = r1 - r0, self.weight.shape[1]
        bn = self.block[0]
        rows = max(bn, (_CHUNK_ELEMS // max(k, 1)) // bn * bn)
        if rows >= n:
            out = torch.matmul(x, self.dequantize(r0, r1).t())
        else:
            out = torch.empty(x.shape[:-1] + (n,), dtype=torch.float32)
            for a in range(0, n, rows):
                b = min(n, a + rows)
                torch.matmul(x, self.dequantize(r0 + a, r0 + b).t(), out=out[..., a:b])
        if bias is not None:
            out += bias
        return out


    def heads(self, x: torch.Tensor, row0: int, stride: int, n: int) -> torch.Tensor:
        """Per-head products over row ranges: ``y[t, h] = x[t, h] @ W[row0 + h*stride : + n]^T``.

        x [T, H, K] fp32 -> [T, H, n] (MLA's absorbed output projection)."""
        if cpu.fp8_available():
            return cpu.fp8_heads(x.contiguous(), self.weight, self.scale_inv, self.block, row0, stride, n)
        return torch.stack([x[:, h] @ self.dequantize(row0 + h * stride, row0 + h * stride + n).t()
                            for h in range(x.shape[1])], dim=1)

    def heads_t(self, x: torch.Tensor, row0: int, stride: int) -> torch.Tensor:
        """Per-head products with row ranges as the inner dimension: ``y[t, h] = x[t, h] @ W[row0 + h*stride : + D]``.

        x [T, H, D] fp32 -> [T, H, K] (MLA's absorbed query)."""
        if cpu.fp8_available():
            return cpu.fp8_heads_t(x.contiguous(), self.weight, self.scale_inv, self.block, row0, stride)
        d = x.shape[2]
        return torch.stack([x[:, h] @ self.dequantize(row0 + h * stride, row0 + h * stride + d)
                            for h in range(x.shape[1])], dim=1)


def quantize(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [N, K] -> (float8_e4m3fn [N, K], fp32 scale_inv [ceil(N/bn), ceil(K/bk)]), amax-scaled per block."""
    w = w.float()
    n, k = w.shape
    bn, bk = block
    sn, sk = scale_shape((n, k), block)
    pad = torch.zeros(sn * bn, sk * bk)
    pad[:n, :k] = w
    blocks = pad.view(sn, bn, sk, bk)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(sn * bn, sk * bk)[:n, :k].contiguous(), scale.contiguous()


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The fp32 matrix a stored (weight, scale_inv) pair stands for."""
    return BlockFP8(weight, scale_inv, block).dequantize()


class FP8Format(Format):
    """Block-scaled FP8 as a registered format: parts ``weight`` (e4m3 [N, K]) and ``scale_inv``
    (fp32 [ceil(N / bn), ceil(K / bk)]). An expert record names them ``<role>`` and
    ``<role>_scale_inv`` (as the checkpoints do); the weight block is the model's
    (``quantization_config.weight_block_size``), given to ``bind`` by the record; ``parts``,
    ``quantize`` and the reference use ``weight_block`` ([128, 128], DeepSeek-V3's)."""

    name = FORMAT
    lossy = True
    bits_per_weight = 8.0 + 32.0 / (128 * 128)
    block = 1  # no padding along K (edge blocks are partial)
    weight_block = (128, 128)

    def parts(self, n: int, k: int):
        return {"weight": (FP8, (n, k)), "scale_inv": (torch.float32, scale_shape((n, k), self.weight_block))}

    def record_parts(self, role: str) -> dict[str, str]:
        return {"weight": role, "scale_inv": role + SCALE_SUFFIX}

    def bind(self, parts, n, k, exact=False, block=None, name=""):
        if block is None:
            raise CheckpointError(f"{name or 'expert'}: FP8 weights without a weight block (config.json's "
                                  "quantization_config.weight_block_size) to read their scales with")
        return BlockFP8(parts["weight"], parts["scale_inv"], block, name)

    def quantize(self, w: torch.Tensor, seed: int = 0) -> dict[str, torch.Tensor]:
        q, s = quantize(w, self.weight_block)
        return {"weight": q, "scale_inv": s}

    def dequantize_rows(self, parts, n, k, r0, r1):
        return BlockFP8(parts["weight"], parts["scale_inv"], self.weight_block).dequantize(r0, r1)

    def matmul(self, x, parts, n, k, bias=None, exact=False):
        return BlockFP8(parts["weight"], parts["scale_inv"], self.weight_block).linear(x.float(), bias)


FP8_FORMAT = register(FP8Format())


def matrix_rows(w, r0: int, r1: int) -> torch.Tensor:
    """Rows r0..r1 of a weight (tensor or ``BlockFP8``) as fp32; a view when it already is fp32."""
    if isinstance(w, BlockFP8):
        return w.dequantize(r0, r1)
    return w[r0:r1] if w.dtype == torch.float32 else w[r0:r1].float()


def nbytes(w) -> int:
    return w.nbytes if isinstance(w, BlockFP8) else w.numel() * w.element_size()


__all__ = ["BlockFP8", "FORMAT", "FP8Format", "SCALE_SUFFIX", "dequantize", "matrix_rows", "not_converted",
           "parse_quantization_config", "quantize", "scale_shape"]
