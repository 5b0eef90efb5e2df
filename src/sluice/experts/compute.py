"""One expert's feed-forward on fp32 activations, over weights in any stored format.

Weights arrive as the views of a cache slot (quantized parts already assembled into
``QuantMatrix`` by the cache): canonical (``gate``/``up``/``down``, output-major) or a family's
fused on-disk layout (see ``fused.py``), recognised by the view names.
"""

from __future__ import annotations

import torch

from .. import kernels
from ..layers.mlp import activation
from ..layers.pointwise import pointwise
from ..quant import linear, linear_chain
from ..quant.dense import chain_rows
from .spec import ExpertSpec


def _gate_up(spec: ExpertSpec, w: dict, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if "gate_up_t" in w:  # [H, 2I] input-major, gate/up interleaved columns
        gu, b = w["gate_up_t"], w.get("gate_up_bias")
        if chain_rows(x.shape[0]):  # one call: each output's sum as apart
            y = linear_chain(x, gu, b, input_major=True)
            return y[:, 0::2], y[:, 1::2]
        return (linear_chain(x, gu[:, 0::2], None if b is None else b[0::2], input_major=True),
                linear_chain(x, gu[:, 1::2], None if b is None else b[1::2], input_major=True))
    if "gate_up" in w:  # [2I, H] output-major (quantized), gate/up interleaved rows
        gu = linear(x, w["gate_up"], w.get("gate_up_bias"))
        return gu[:, 0::2], gu[:, 1::2]
    if spec.input_major and isinstance(w["gate"], torch.Tensor):  # canonical records of such experts
        return linear_chain(x, w["gate"], w.get("gate_bias")), linear_chain(x, w["up"], w.get("up_bias"))
    return linear(x, w["gate"], w.get("gate_bias")), linear(x, w["up"], w.get("up_bias"))


def _down(spec: ExpertSpec, w: dict, h: torch.Tensor) -> torch.Tensor:
    h = h.contiguous()
    if "down_t" in w:
        d = w["down_t"]
        return linear_chain(h, d, w.get("down_bias"), input_major=True)
    if spec.input_major and isinstance(w["down"], torch.Tensor):
        return linear_chain(h, w["down"], w.get("down_bias"))
    return linear(h, w["down"], w.get("down_bias"))


_DENSE = (torch.float32, torch.bfloat16, torch.float16)


def _fused_ok(spec: ExpertSpec, w: dict, x: torch.Tensor) -> bool:
    """Plain SwiGLU (silu) over dense gate/up/down of one dtype, no biases; one token, or any
    number with batch-invariant kernels (then every row equals its one-token result)."""
    if x.shape[0] != 1 and not kernels.batch_invariant():
        return False
    if spec.variant != "swiglu" or spec.act not in ("silu", "swish") or len(w) != 3:
        return False
    g, u, d = w.get("gate"), w.get("up"), w.get("down")
    return (isinstance(g, torch.Tensor) and isinstance(u, torch.Tensor) and isinstance(d, torch.Tensor)
            and g.dtype in _DENSE and g.dtype == u.dtype == d.dtype
            and g.is_contiguous() and u.is_contiguous() and d.is_contiguous() and kernels.available())


def expert_output(spec: ExpertSpec, w: dict, x: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale * expert(x)``: one C call per expert when decoding a plain SwiGLU expert."""
    if _fused_ok(spec, w, x):
        if x.shape[0] == 1:
            return kernels.swiglu(x.contiguous(), w["gate"], w["up"], w["down"], scale)
        return kernels.swiglu_rows(x.contiguous(), w["gate"], w["up"], w["down"], scale)
    return expert_forward(spec, w, x) * scale


def expert_forward(spec: ExpertSpec, w: dict, x: torch.Tensor) -> torch.Tensor:
    """x: [n, H] fp32 -> [n, H] fp32."""
    if kernels.batch_invariant() and _fused_ok(spec, w, x):  # rows equal to expert_output's (times 1.0)
        return kernels.swiglu_rows(x.contiguous(), w["gate"], w["up"], w["down"], 1.0)
    if spec.variant == "swiglu":
        act = activation(spec.act)
        g, u = _gate_up(spec, w, x)
        return _down(spec, w, act(g) * u)
    if spec.variant == "clamped_swiglu":
        # exactly transformers' GptOssExperts._apply_gate: gate clamped above, up clamped both
        # sides, glu = gate * sigmoid(gate * alpha), (up + 1) * glu
        g, u = _gate_up(spec, w, x)
        g = g.clamp(max=spec.limit)
        u = u.clamp(-spec.limit, spec.limit)
        return _down(spec, w, (u + 1) * (g * pointwise(torch.sigmoid, g * spec.alpha)))
    raise ValueError(f"unknown expert variant {spec.variant!r}")
