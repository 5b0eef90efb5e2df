"""Fused expert layouts as checkpoints store them, and their canonical form.

Canonical expert views (what ``sluice convert`` writes and most families stream) are
``gate`` [I, H], ``up`` [I, H], ``down`` [H, I] (output-major, ``y = x @ W.T``) plus optional
``gate_bias`` / ``up_bias`` [I] and ``down_bias`` [H].

GPT-OSS stores each expert as a slice of fused [E, ...] tensors, input-major (``y = x @ W``):

- ``gate_up_t`` [H, 2I]: gate and up interleaved along the last dim (column 2j is gate j,
  column 2j+1 is up j), with ``gate_up_bias`` [2I] interleaved the same way;
- ``down_t`` [I, H] with ``down_bias`` [H].

Streaming from the Hugging Face directory computes on that layout directly (the
input-major kernel, then the outputs are de-interleaved); the container stores the
canonical form, de-interleaved and transposed once at convert time.
"""

from __future__ import annotations

import torch

from .layout import ExpertLayout, View

FUSED_INPUT_MAJOR = ("gate_up_t", "down_t")


def is_fused(names) -> bool:
    return "gate_up_t" in names


def canonical_weights(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Canonical views of one expert's weights (copies for a fused layout, else ``w`` itself)."""
    if not is_fused(w):
        return w
    gu = w["gate_up_t"]
    out = {
        "gate": gu[:, 0::2].t().contiguous(),
        "up": gu[:, 1::2].t().contiguous(),
        "down": w["down_t"].t().contiguous(),
    }
    if "gate_up_bias" in w:
        out["gate_bias"] = w["gate_up_bias"][0::2].contiguous()
        out["up_bias"] = w["gate_up_bias"][1::2].contiguous()
    for name, t in w.items():
        if name not in ("gate_up_t", "down_t", "gate_up_bias"):
            out[name] = t
    return out


def canonical_layout(layout: ExpertLayout) -> ExpertLayout:
    """The names, dtypes and shapes ``canonical_weights`` returns (slot offsets are meaningless)."""
    by_name = {v.name: v for v in layout.views}
    if not is_fused(by_name):
        return layout
    gu, down = by_name["gate_up_t"], by_name["down_t"]
    h, i2 = gu.shape
    views = [View("gate", 0, gu.dtype, (i2 // 2, h)), View("up", 0, gu.dtype, (i2 // 2, h)),
             View("down", 0, down.dtype, tuple(reversed(down.shape)))]
    if "gate_up_bias" in by_name:
        b = by_name["gate_up_bias"]
        views += [View("gate_bias", 0, b.dtype, (b.shape[0] // 2,)), View("up_bias", 0, b.dtype, (b.shape[0] // 2,))]
    views += [v for v in layout.views if v.name not in ("gate_up_t", "down_t", "gate_up_bias")]
    return ExpertLayout((), tuple(views), 0)
