"""Block-FP8 linears of a family's checkpoint (``quantization_config`` with ``weight_block_size``):
the stored tensors of one linear module and the built linear, for ``declare.Model``'s
``linear_tensors`` / ``linear`` and for the expert tensor names."""

from __future__ import annotations

import torch

from ..errors import CheckpointError
from ..quant.fp8 import SCALE_SUFFIX, BlockFP8, not_converted, parse_quantization_config, scale_shape


class LinearFormat:
    """``block`` (bn, bk) from the config's ``quantization_config`` (None: plain dtypes); a module
    listed in ``modules_to_not_convert`` stays plain."""

    def __init__(self, quantization_config: dict | None):
        self.block = parse_quantization_config(quantization_config)
        self.quantization = quantization_config if self.block is not None else None

    def quantized(self, module: str) -> bool:
        """Whether linear ``module`` (its name without ``.weight``) is stored as block FP8."""
        return self.block is not None and not not_converted(self.quantization, module)

    def tensors(self, module: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """The stored tensors of one linear module: its weight, and its block scales if it is FP8."""
        out: dict[str, tuple[int, ...]] = {module + ".weight": tuple(shape)}
        if self.quantized(module):
            out[module + ".weight" + SCALE_SUFFIX] = scale_shape(tuple(shape), self.block)
        return out

    def linear(self, w, module: str):
        weight = w(module + ".weight")
        if self.quantized(module):
            return BlockFP8(weight, w(module + ".weight" + SCALE_SUFFIX), self.block, module + ".weight")
        if isinstance(weight, torch.Tensor) and weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise CheckpointError(
                f"tensor {module + '.weight'!r} is {weight.dtype}, but config.json declares no block-scaled "
                "quantization for it (quantization_config / modules_to_not_convert)")
        return weight
