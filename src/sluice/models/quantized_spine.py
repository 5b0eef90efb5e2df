"""The int8 spine (``sluice convert --spine int8``): which spine matrices a container stores
in a weight format, how their parts are named and checked, and how they become weights.

The spine is what stays resident, so storing its large matrices as int8 (one fp32 scale per
output row, ``quant.int8``) frees about three quarters of their bytes for the expert cache.
It is lossy and opt-in, decided at convert time: the container holds the quantized bytes
(streamed buffers are never quantized at load), and the engine flags every result lossy.

In the container the format's ``weight`` part is stored under the tensor's own name and every
other part as ``"<name>.<part>"`` (int8: ``"<name>.scales"``), in the same per-layer group, so
a streamed layer reads them in its one group read. The layers multiply a ``QuantMatrix``
through ``quant.linear`` exactly where they multiplied the tensor, and the embedding looks up
dequantized rows (``quant.embed``).
"""

from __future__ import annotations

import math

from ..errors import CheckpointError
from ..quant import FORMATS, QuantMatrix
from .base import ModelDescription

SPINE_FORMATS = ("int8",)  # what --spine accepts besides "stored"


def quantizable(desc: ModelDescription) -> list[str]:
    """The spine matrices ``--spine int8`` stores quantized: every 2-D ``*proj*.weight``
    (attention, linear attention, shared experts and dense MLPs, all multiplied through
    ``quant.linear``), the embedding and the head. Norms, biases, sinks, routers and gates
    (their choices are the model's routing), convolution kernels and MLA's ``kv_b_proj``
    (its heads are used as views) stay as stored, as do weights stored in FP8 (already one
    byte per weight; the converter skips them). A family whose names follow no such rule lists
    its whole-matrix linears itself (``ModelDescription.spine_linears``)."""
    if desc.spine_linears is not None:
        return [n for n in desc.spine_linears if len(desc.spine.get(n, ())) == 2]
    out = []
    for name, shape in desc.spine.items():
        parts = name.split(".")
        if len(shape) != 2 or parts[-1] != "weight" or len(parts) < 2 or "kv_b_proj" in parts:
            continue
        module = parts[-2]
        if "proj" in module or module in ("embed_tokens", "lm_head"):
            out.append(name)
    return out


def part_names(name: str, fmt: str) -> dict[str, str]:
    """Part -> the container tensor holding it, for spine matrix ``name`` stored in ``fmt``."""
    return {part: name if part == "weight" else f"{name}.{part}" for part in FORMATS[fmt].parts(1, 1)}


def check(name: str, fmt: str, shape: tuple[int, ...], tensors: dict, where) -> None:
    """Refuse a quantized spine entry whose format, parts, dtypes or shapes are not what the
    model's ``shape`` [N, K] needs (``CheckpointError`` naming the tensor)."""
    if fmt not in SPINE_FORMATS:
        raise CheckpointError(f"{where}: spine tensor {name!r} is stored as {fmt!r}; Sluice reads spine matrices "
                              f"stored as {', '.join(SPINE_FORMATS)} (or unquantized)")
    if len(shape) != 2:
        raise CheckpointError(f"{where}: spine tensor {name!r} has {len(shape)} dimensions and cannot be stored as "
                              f"{fmt}")
    n, k = shape
    for part, (dtype, pshape) in FORMATS[fmt].parts(n, k).items():
        stored = part_names(name, fmt)[part]
        info = tensors.get(stored)
        if info is None:
            raise CheckpointError(f"{where}: spine tensor {name!r} ({fmt}) is missing its part {stored!r}")
        if info.torch_dtype != dtype or tuple(info.shape) != tuple(pshape):
            raise CheckpointError(
                f"{where}: spine tensor {stored!r} is {info.dtype} {list(info.shape)}, but {fmt} stores "
                f"{str(dtype).removeprefix('torch.')} {list(pshape)} for the model's [{n}, {k}] matrix")


def stored_names(names: list[str], quant: dict[str, str]) -> list[str]:
    """The container tensors that hold spine tensors ``names`` (each part of a quantized one)."""
    out = []
    for name in names:
        out.extend(part_names(name, quant[name]).values() if name in quant else [name])
    return out


def nbytes(name: str, quant: dict[str, str], tensors: dict) -> int:
    """Bytes spine tensor ``name`` takes as stored (all its parts)."""
    return sum(tensors[n].nbytes for n in stored_names([name], quant))


def numel(name: str, desc: ModelDescription) -> int:
    return math.prod(desc.spine[name])


def assemble(weights: dict, quant: dict[str, str], desc: ModelDescription) -> dict:
    """Replace the parts of each quantized spine matrix in ``weights`` (tensors by container
    name, resident or views into stream buffers) by one ``QuantMatrix`` under its name. Nothing
    is computed from the parts: views of a streamed layer see every refill."""
    out = dict(weights)
    for name, fmt in quant.items():
        if name not in out:
            continue
        names = part_names(name, fmt)
        n, k = desc.spine[name]
        out[name] = QuantMatrix(fmt, {part: out.pop(stored) if stored != name else out[name]
                                      for part, stored in names.items()}, n, k)
    return out


def quantize_rows(fmt: str, rows) -> dict:
    """The parts of rows [r, K] of a spine matrix (int8 quantizes each row on its own, so a
    matrix converts in bounded row blocks with the bytes of converting it whole). f32, bf16 and
    f16 rows are passed as stored: the C quantizer widens them itself (exactly, as ``.float()``)."""
    return FORMATS[fmt].quantize(rows)
