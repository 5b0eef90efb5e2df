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

Both sides live in ``sluice.quant.assembly``, the one place that reads view names:
``assemble`` picks each layout's products once per read, ``ExpertWeights.canonical`` makes the
canonical copies and ``canonical_views`` plans them; this module adapts the plan to layouts.
"""

from __future__ import annotations

from ..quant.assembly import canonical_views
from .layout import ExpertLayout, View


def canonical_layout(layout: ExpertLayout, shapes: dict[str, tuple[int, int]] | None = None) -> ExpertLayout:
    """The views ``ExpertWeights.canonical`` returns, by name, dtype and shape (slot offsets are
    meaningless). Quantized matrices appear as one float32 view per role of its [n, k] from
    ``shapes`` (what ``convert.part_specs`` plans parts from), not as their parts."""
    views = canonical_views([(v.name, v.dtype, tuple(v.shape)) for v in layout.views], shapes)
    return ExpertLayout((), tuple(View(name, 0, dtype, shape) for name, dtype, shape in views), 0)
