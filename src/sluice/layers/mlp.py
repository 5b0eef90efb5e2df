"""Dense gated MLP (dense layers, shared experts) on spine weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import UnsupportedModelError
from ..quant import linear
from .pointwise import pointwise

ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def activation(name: str):
    try:
        fn = ACTIVATIONS[name]
    except KeyError:
        raise UnsupportedModelError(
            f"activation {name!r} is not supported (supported: {', '.join(ACTIVATIONS)})"
        ) from None
    return lambda x: pointwise(fn, x)  # each element as if computed alone (batch invariance)


class GatedMLP:
    """``down(act(gate(x)) * up(x))``, each projection with an optional bias (ERNIE-4.5's ``use_bias``);
    ``limit``: the gate clamped above and the up projection to [-limit, limit] first (DeepSeek-V4's
    shared experts, ``swiglu_limit``)."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, act: str,
                 biases: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None] = (None, None, None),
                 limit: float | None = None):
        self.gate, self.up, self.down = gate, up, down
        self.gate_bias, self.up_bias, self.down_bias = biases
        self.act = activation(act)
        self.limit = limit

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        g, u = linear(x, self.gate, self.gate_bias), linear(x, self.up, self.up_bias)
        if self.limit is not None:
            g, u = g.clamp(max=self.limit), u.clamp(-self.limit, self.limit)
        return linear(self.act(g) * u, self.down, self.down_bias)
