"""Fused expert layouts as checkpoints store them, and their canonical form.

Canonical expert views (what ``sluice convert`` writes and most families stream) are
``gate`` [I, H], ``up`` [I, H], ``down`` [H, I] (output-major, ``y = x @ W.T``), or their
quantized parts ``"<role>.<part>"``, plus optional ``gate_bias`` / ``up_bias`` [I] and
``down_bias`` [H].

GPT-OSS stores each expert as a slice of fused [E, ...] tensors:

- plain dtypes, input-major (``y = x @ W``): ``gate_up_t`` [H, 2I] with gate and up
  interleaved along the last dim (column 2j is gate j, column 2j+1 is up j) and
  ``gate_up_bias`` [2I] interleaved the same way; ``down_t`` [I, H] and ``down_bias`` [H];
- MXFP4, output-major: ``gate_up.<part>`` for the [2I, H] matrix whose rows interleave gate
  and up (row 2j gate j, row 2j+1 up j), and canonical ``down.<part>`` [H, I].

Streaming from the Hugging Face directory computes on those layouts directly (one product
for gate and up, then the outputs are de-interleaved); the container stores the canonical
form, de-interleaved (and transposed) once at convert time. Quantized parts are split by
rows, which never touches a quantization block, so they are copied bit for bit.
"""

from __future__ import annotations

import torch

from .layout import ExpertLayout, View

ROLE_SHAPES = ("gate", "up", "down")


def is_fused(names) -> bool:
    return "gate_up_t" in names or any(n.startswith("gate_up.") for n in names) or "gate_up" in names


def _parts(names, role: str) -> list[str]:
    return sorted(n.split(".", 1)[1] for n in names if n.startswith(role + "."))


def canonical_weights(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Canonical views of one expert's slot views (copies for a fused layout, else ``w`` itself)."""
    if not is_fused(w):
        return w
    out: dict[str, torch.Tensor] = {}
    if "gate_up_t" in w:
        gu = w["gate_up_t"]
        out["gate"] = gu[:, 0::2].t().contiguous()
        out["up"] = gu[:, 1::2].t().contiguous()
        out["down"] = w["down_t"].t().contiguous()
    else:  # quantized: split the rows of every part
        for part in _parts(w, "gate_up"):
            t = w[f"gate_up.{part}"]
            out[f"gate.{part}"] = t[0::2].contiguous()
            out[f"up.{part}"] = t[1::2].contiguous()
    if "gate_up_bias" in w:
        out["gate_bias"] = w["gate_up_bias"][0::2].contiguous()
        out["up_bias"] = w["gate_up_bias"][1::2].contiguous()
    for name, t in w.items():
        if name not in ("gate_up_t", "down_t", "gate_up_bias") and not name.startswith("gate_up."):
            out[name] = t
    return out


def canonical_layout(layout: ExpertLayout, shapes: dict[str, tuple[int, int]] | None = None) -> ExpertLayout:
    """The views ``canonical_weights`` returns, by name, dtype and shape (slot offsets are
    meaningless). Quantized matrices appear as one float32 view per role of its [n, k] from
    ``shapes`` (what ``convert.part_specs`` plans parts from), not as their parts."""
    by_name = {v.name: v for v in layout.views}
    quantized = any("." in n for n in by_name)
    if not is_fused(by_name) and not quantized:
        return layout
    views: list[View] = []
    if "gate_up_t" in by_name:
        gu, down = by_name["gate_up_t"], by_name["down_t"]
        h, i2 = gu.shape
        views += [View("gate", 0, gu.dtype, (i2 // 2, h)), View("up", 0, gu.dtype, (i2 // 2, h)),
                  View("down", 0, down.dtype, tuple(reversed(down.shape)))]
    elif quantized:
        if shapes is None:
            raise ValueError("canonical_layout of quantized experts needs the roles' [n, k] shapes")
        views += [View(role, 0, torch.float32, tuple(shapes[role])) for role in ROLE_SHAPES]
    if "gate_up_bias" in by_name:
        b = by_name["gate_up_bias"]
        views += [View("gate_bias", 0, b.dtype, (b.shape[0] // 2,)), View("up_bias", 0, b.dtype, (b.shape[0] // 2,))]
    views += [v for v in layout.views
              if v.name not in ("gate_up_t", "down_t", "gate_up_bias") and "." not in v.name]
    return ExpertLayout((), tuple(views), 0)
