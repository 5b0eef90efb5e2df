"""compressed-tensors checkpoints (``quantization_config.quant_method: "compressed-tensors"``): the
two schemes Sluice reads as stored, and which modules a config covers.

- ``format: pack-quantized``: 4-bit symmetric integer weights in groups of 32 with bf16 scales
  (``int4.py``: ``<module>.weight_packed``, ``<module>.weight_scale``; ``weight_shape`` restates
  the shape). Kimi K2-Thinking and K2.5/K2.6 ship their routed experts so.
- ``format: float-quantized``: FP8 e4m3 weights ``<module>.weight`` [N, K] with
  ``<module>.weight_scale``, one scale per output channel ([N, 1], ``strategy: channel``) or per
  block ([ceil(N / bn), ceil(K / bk)], ``strategy: block`` with ``block_structure: [bn, bk]``),
  as GLM-4.5-FP8, dots.llm1 FP8 and other llm-compressor checkpoints store them:

      W[n, k] = float(weight[n, k]) * weight_scale[n // bn, k // bk]   (a channel: bn = 1, bk = K)

  the exact product in fp32 (an e4m3 value times a bf16 or fp32 scale fits fp32), multiplied by
  ``fp8.BlockFP8``, whose block of a channel is one row spanning the row (``channel_block``).

Activation quantization is not applied: activations stay fp32 and the stored weights are
multiplied exactly, as for block FP8 (``fp8.py``). A dynamic ``input_activations`` scheme (e.g.
FP8 per token, ``dynamic: true``, computed at run time from the activations) is accepted on those
terms; static activation scales, output activations, KV-cache schemes, sparsity and transforms are
refused, as is every other value not listed here.

A config group covers the modules its ``targets`` name (``Linear``: every linear module;
``re:<pattern>``: names the pattern matches from their start, as compressed-tensors matches them;
any other entry: that exact module name), less the modules ``ignore`` names (same rules).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import UnsupportedModelError

PACKED = "pack-quantized"
FLOAT = "float-quantized"
METHOD = "compressed-tensors"
SCALE = "weight_scale"  # the float-quantized scales' tensor suffix after ``<module>.``

_INT4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32, "dynamic": False}
_FP8 = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}
_FP8_STRATEGIES = ("channel", "block")
_SCALE_DTYPES = {PACKED: (None, "bfloat16", "torch.bfloat16"),
                 FLOAT: (None, "bfloat16", "torch.bfloat16", "float32", "torch.float32", "float16", "torch.float16")}


@dataclass(frozen=True)
class Scheme:
    """One compressed-tensors config: its ``format``, the FP8 ``block`` (None: per channel or INT4),
    and the module names it covers (``covers``)."""

    format: str
    block: tuple[int, int] | None
    targets: tuple[str, ...]
    ignore: tuple[str, ...]
    dynamic_activations: bool = False  # an input_activations scheme computed at run time (not applied)

    def covers(self, module: str) -> bool:
        """Whether linear ``module`` (its checkpoint name, without ``.weight``) is stored quantized."""
        return any(_matches(t, module) for t in self.targets) and not any(_matches(t, module) for t in self.ignore)


def _matches(target: str, module: str) -> bool:
    if target == "Linear":  # the class name: every linear module (callers ask about linears only)
        return True
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == module


def channel_block(k: int) -> tuple[int, int]:
    """The block of per-channel scales of a matrix with ``k`` columns: one row spanning the row."""
    return (1, k)


def parse(raw: dict, where: str = "config.json") -> Scheme:
    """The scheme of a compressed-tensors ``quantization_config``, or a one-line
    ``UnsupportedModelError`` naming the first key Sluice does not read as stored."""

    def refuse(key: str, value, want: str):
        raise UnsupportedModelError(
            f"{where}: quantization_config.{key}={value!r} is not supported ({want}; Sluice reads compressed-tensors "
            "INT4 pack-quantized (group 32, symmetric) and FP8 float-quantized (per channel or block) weights)")

    fmt = raw.get("format")
    if fmt not in (PACKED, FLOAT):
        refuse("format", fmt, f"expected {PACKED!r} or {FLOAT!r}")
    status = raw.get("quantization_status", "compressed")
    if status != "compressed":
        refuse("quantization_status", status, "expected 'compressed': the weights must be stored quantized")
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if raw.get(key):
            refuse(key, raw[key], "expected null")
    groups = raw.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        refuse("config_groups", groups, "expected exactly one group")
    (gname, group), = groups.items()
    g = f"config_groups.{gname}"
    if not isinstance(group, dict):
        refuse(g, group, "expected an object")
    if group.get("format", fmt) != fmt:
        refuse(f"{g}.format", group.get("format"), f"expected {fmt!r}, the config's format")
    if group.get("output_activations") is not None:
        refuse(f"{g}.output_activations", group["output_activations"], "expected null")
    acts = group.get("input_activations")
    dynamic = False
    if acts is not None:
        if fmt == PACKED:
            refuse(f"{g}.input_activations", acts, "expected null: INT4 is weight-only")
        if not isinstance(acts, dict) or acts.get("dynamic") is not True:
            refuse(f"{g}.input_activations", acts, "expected null or a dynamic scheme: static activation scales "
                   "would be ignored")
        dynamic = True
    weights = group.get("weights")
    if not isinstance(weights, dict):
        refuse(f"{g}.weights", weights, "expected an object")
    want = _INT4 if fmt == PACKED else _FP8
    for key, value in want.items():
        got = weights.get(key, value if key == "dynamic" else None)
        if type(got) is not type(value) or got != value:
            refuse(f"{g}.weights.{key}", got, f"expected {value!r} for format {fmt!r}")
    block = None
    if fmt == FLOAT:
        strategy = weights.get("strategy")
        if strategy not in _FP8_STRATEGIES:
            refuse(f"{g}.weights.strategy", strategy, "expected 'channel' or 'block' for format 'float-quantized' "
                   "(per-tensor and group scales are not implemented)")
        if weights.get("group_size") is not None:
            refuse(f"{g}.weights.group_size", weights["group_size"], "expected null")
        bs = weights.get("block_structure")
        if strategy == "block":
            if (not isinstance(bs, list) or len(bs) != 2
                    or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in bs)):
                refuse(f"{g}.weights.block_structure", bs, "expected two positive integers such as [128, 128]")
            block = (bs[0], bs[1])
        elif bs is not None:
            refuse(f"{g}.weights.block_structure", bs, "expected null with strategy 'channel'")
    elif weights.get("block_structure") is not None:
        refuse(f"{g}.weights.block_structure", weights["block_structure"], "expected null")
    if weights.get("actorder") is not None:
        refuse(f"{g}.weights.actorder", weights["actorder"], "expected null: no reordering")
    if weights.get("scale_dtype") not in _SCALE_DTYPES[fmt]:
        refuse(f"{g}.weights.scale_dtype", weights["scale_dtype"], "expected a float dtype"
               if fmt == FLOAT else "expected bfloat16")
    targets = group.get("targets", ["Linear"])
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        refuse(f"{g}.targets", targets, "expected a list of module names")
    ignore = raw.get("ignore", [])
    if ignore is None:
        ignore = []
    if not isinstance(ignore, list) or not all(isinstance(t, str) for t in ignore):
        refuse("ignore", ignore, "expected a list of module names")
    for t in (*targets, *ignore):
        if t.startswith("re:"):
            try:
                re.compile(t[3:])
            except re.error as e:
                refuse("ignore" if t in ignore else f"{g}.targets", t, f"not a regular expression: {e}")
    return Scheme(fmt, block, tuple(targets), tuple(ignore), dynamic)


__all__ = ["FLOAT", "METHOD", "PACKED", "SCALE", "Scheme", "channel_block", "parse"]
