"""What of a model differs from its source checkpoint's weights (lossy), and what does not.

Lossy means the weights computed with are not the source checkpoint's: a container whose experts
``sluice convert --experts`` quantized (int8, q4, mxfp4, rvq3) or narrowed (f32 to bf16/f16, bf16
to f16), a spine stored as int8 (``--spine int8``), and the lossy routing switches. A checkpoint's
own quantized experts (block-scaled FP8, MXFP4, compressed-tensors INT4, DeepSeek-V4 FP4) read as
stored, or copied bit for bit into a container, are the model's weights: not lossy. Widening (bf16
or f16 to f32) is exact.
"""

from __future__ import annotations

QUANTIZED = ("int8", "q4", "mxfp4", "rvq3", "fp8", "int4", "fp4")
FLOAT_BITS = {"f32": 32, "bf16": 16, "f16": 16}


def expert_loss(fmt: str, source_dtype: str | None) -> str | None:
    """How a container's experts stored as ``fmt`` differ from its source's (``source_dtype``, as its
    manifest records it; None: not recorded), or None when they are the source's weights."""
    if fmt == source_dtype:
        return None  # as stored in the source (its own FP8 / MXFP4 copied bit for bit, or a float kept)
    if fmt == "f32" and source_dtype in FLOAT_BITS:
        return None  # widening is exact
    if fmt in FLOAT_BITS:
        if source_dtype is None:
            return None  # an older manifest without the source's dtype: a float format, not known to be lossy
        return f"{fmt} cast from the source's {source_dtype}"
    origin = f"the source's {source_dtype}" if source_dtype else "the source's weights"
    return f"{fmt} quantized from {origin} (sluice convert --experts {fmt})"


def container_expert_loss(container) -> str | None:
    src = container.manifest.get("source")
    dtype = src.get("expert_dtype") if isinstance(src, dict) else None
    return expert_loss(container.expert_format, dtype if isinstance(dtype, str) else None)


def summary(lossy: dict) -> str:
    """The run summary's words for a stats ``lossy`` dict ("" when exact)."""
    parts = []
    if "experts" in lossy:
        parts.append(f"experts {lossy['experts']}")
    if "spine" in lossy:
        parts.append(f"spine {lossy['spine']}")
    if lossy.get("moe_top_k"):
        parts.append(f"--moe-top-k {lossy['moe_top_k']}")
    if lossy.get("prefer_cached"):
        parts.append(f"--prefer-cached {lossy['prefer_cached']}")
    return ("LOSSY: " + ", ".join(parts)) if parts else ""
