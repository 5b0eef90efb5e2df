"""Expert and spine weight formats and their matrix kernels.

Quant knows no architecture. A *format* describes how one [N, K] weight matrix is stored
(its parts, e.g. ``weight`` or ``blocks`` + ``scales``) and multiplies fp32 activations by
it without materialising a full-precision copy. ``linear`` is the entry point: plain dtypes
(f32 / bf16 / f16 weights), ``QuantMatrix`` (int8, q4, mxfp4, fp4, rvq3, int4) and ``fp8.BlockFP8`` alike,
with fp32 activations and fp32 results. See ``formats`` for the interface and
docs/quantization.md. ``assemble`` is the one place an expert record's bytes become weights.
"""

from . import fp4, fp8, int4, int8, mxfp4, q4, rvq3  # noqa: F401  (register the formats)
from .assembly import ExpertWeights, assemble, assemble_views, record_views
from .dense import embed, linear, linear_chain, linear_t
from .formats import (FORMATS, Format, QuantMatrix, activations, fake_quantize_activations, record_layout,
                      set_activations)

__all__ = ["FORMATS", "ExpertWeights", "Format", "QuantMatrix", "activations", "assemble", "assemble_views", "embed",
           "fake_quantize_activations", "linear", "linear_chain", "linear_t", "record_layout", "record_views",
           "set_activations"]
