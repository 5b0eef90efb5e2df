"""One expert's feed-forward on fp32 activations, over weights in any stored format.

Weights arrive assembled (``quant.assemble``, once when the expert's read completed): an
``ExpertWeights`` whose ``gate_up(x)`` and ``down(h)`` are the products for its layout and
format, and whose ``swiglu`` holds the matrices of the one-call C expert kernel when the format
has it. Compute asks nothing about view names or formats; it only applies the expert's
activation (``ExpertSpec.variant``).
"""

from __future__ import annotations

import torch

from ..kernels.backend import cpu
from ..layers.mlp import activation
from ..layers.pointwise import pointwise
from ..quant import ExpertWeights
from .spec import ExpertSpec


def _fused_ok(spec: ExpertSpec, w: ExpertWeights, x: torch.Tensor) -> bool:
    """Plain SwiGLU (silu) with the one-call kernel's weights (dense, one dtype, no biases); one
    token, or any number with batch-invariant kernels (then every row equals its one-token result)."""
    if x.shape[0] != 1 and not cpu.batch_invariant():
        return False
    return (w.swiglu is not None and spec.variant == "swiglu" and spec.act in ("silu", "swish")
            and cpu.available())


def expert_output(spec: ExpertSpec, w: ExpertWeights, x: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale * expert(x)``: one C call per expert when decoding a plain SwiGLU expert."""
    if _fused_ok(spec, w, x):
        g, u, d = w.swiglu
        if x.shape[0] == 1:
            return cpu.swiglu(x.contiguous(), g, u, d, scale)
        return cpu.swiglu_rows(x.contiguous(), g, u, d, scale)
    return expert_forward(spec, w, x) * scale


def expert_outputs(spec: ExpertSpec, weights: list[ExpertWeights], x: torch.Tensor,
                   scales: list[float]) -> list[torch.Tensor]:
    """``[expert_output(spec, w, x, s) for w, s in zip(weights, scales)]`` for one token (x [1, H]),
    bit-identical: the experts that take the one-call kernel go through ``cpu.swiglu_many``
    (the checks, the activations' address and the scratch once per layer, not per expert)."""
    if not (x.shape[0] == 1 and spec.variant == "swiglu" and spec.act in ("silu", "swish") and cpu.available()):
        return [expert_output(spec, w, x, s) for w, s in zip(weights, scales)]
    args = [w.swiglu_args for w in weights]
    if None not in args:
        return cpu.swiglu_many(x, args, scales)
    return [expert_output(spec, w, x, s) for w, s in zip(weights, scales)]


def expert_forward(spec: ExpertSpec, w: ExpertWeights, x: torch.Tensor) -> torch.Tensor:
    """x: [n, H] fp32 -> [n, H] fp32."""
    if cpu.batch_invariant() and _fused_ok(spec, w, x):  # rows equal to expert_output's (times 1.0)
        g, u, d = w.swiglu
        return cpu.swiglu_rows(x.contiguous(), g, u, d, 1.0)
    if spec.variant == "swiglu":
        act = activation(spec.act)
        g, u = w.gate_up(x)
        return w.down(act(g) * u)
    if spec.variant == "clamped_swiglu":
        # exactly transformers' GptOssExperts._apply_gate: gate clamped above, up clamped both
        # sides, glu = gate * sigmoid(gate * alpha), (up + 1) * glu
        g, u = w.gate_up(x)
        g = g.clamp(max=spec.limit)
        u = u.clamp(-spec.limit, spec.limit)
        return w.down((u + 1) * (g * pointwise(torch.sigmoid, g * spec.alpha)))
    if spec.variant == "clamped_silu":
        # transformers' DeepseekV4Experts._apply_gate: gate clamped above, up both sides, act(gate) * up
        g, u = w.gate_up(x)
        return w.down(activation(spec.act)(g.clamp(max=spec.limit)) * u.clamp(-spec.limit, spec.limit))
    raise ValueError(f"unknown expert variant {spec.variant!r}")
