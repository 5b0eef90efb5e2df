"""One expert's feed-forward on fp32 activations, over weights in any stored format."""

from __future__ import annotations

import torch

from ..layers.mlp import activation
from ..quant import linear
from .spec import ExpertSpec


def expert_forward(spec: ExpertSpec, w: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """x: [n, H] fp32 -> [n, H] fp32."""
    if spec.variant == "swiglu":
        act = activation(spec.act)
        g = linear(x, w["gate"], w.get("gate_bias"))
        u = linear(x, w["up"], w.get("up_bias"))
        return linear(act(g) * u, w["down"], w.get("down_bias"))
    if spec.variant == "clamped_swiglu":
        g = linear(x, w["gate"], w.get("gate_bias")).clamp(max=spec.limit)
        u = linear(x, w["up"], w.get("up_bias")).clamp(-spec.limit, spec.limit)
        return linear((u + 1) * (g * torch.sigmoid(g * spec.alpha)), w["down"], w.get("down_bias"))
    raise ValueError(f"unknown expert variant {spec.variant!r}")
