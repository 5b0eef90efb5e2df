"""Expert and spine weight formats and their matrix kernels.

Quant knows no architecture. A *format* describes how one [N, K] weight matrix is stored
(its parts, e.g. ``weight`` or ``blocks`` + ``scales``) and multiplies fp32 activations by
it without materialising a full-precision copy. ``linear`` is the entry point for plain
dtypes (f32 / bf16 / f16 weights with fp32 activations and fp32 accumulation).
"""

from .dense import linear, linear_t

__all__ = ["linear", "linear_t"]
