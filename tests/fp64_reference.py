"""A true float64 evaluation of a transformers model: the exact value fp32 results are judged by.

transformers loaded with ``dtype=torch.float64`` still computes parts in fp32: its norms upcast
with ``.float()`` / ``.to(torch.float32)``, attention and routers take ``softmax(...,
dtype=torch.float32)``, and the Gated DeltaNet kernels cast q, k, v, g and beta to fp32
(``torch_chunk_gated_delta_rule``). ``true_fp64()`` makes those casts keep float64 tensors in
float64 while it is active (fp32 and other tensors are cast as asked), so every operation of an
fp64 model runs in fp64. ``fp64_logits`` evaluates a checkpoint that way.

(Proof that nothing is left in fp32: on qwen3_5_moe's tiny model the chunked and the recurrent
delta rule, two summation orders, agree to 3e-13 inside ``true_fp64()``, where fp32 would leave
them ~1e-6 apart; tests/models/test_qwen3_5_moe.py.)
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.nn.functional as F

_F64 = torch.float64
_TO = torch.Tensor.to  # the cast itself, as it is outside ``true_fp64()``


def _keep64(x: torch.Tensor, dtype):
    """The dtype a cast of ``x`` to ``dtype`` takes inside ``true_fp64()``."""
    return _F64 if x.dtype == _F64 and dtype == torch.float32 else dtype


@contextlib.contextmanager
def true_fp64():
    """While active, float64 tensors cast to float32 stay float64 (``Tensor.to``, ``Tensor.float``,
    ``softmax(dtype=torch.float32)``); everything else is unchanged. Restored on exit."""
    to0, float0, softmax0, fsoftmax0 = torch.Tensor.to, torch.Tensor.float, torch.softmax, F.softmax

    def to(self, *args, **kwargs):
        if self.dtype == _F64:
            args = tuple(_F64 if a is torch.float32 else a for a in args)
            if kwargs.get("dtype") is torch.float32:
                kwargs["dtype"] = _F64
        return to0(self, *args, **kwargs)

    def flt(self, *args, **kwargs):
        return self if self.dtype == _F64 else float0(self, *args, **kwargs)

    def softmax(x, *args, dtype=None, **kwargs):
        return softmax0(x, *args, dtype=_keep64(x, dtype) if dtype is not None else None, **kwargs)

    def fsoftmax(x, *args, dtype=None, **kwargs):
        return fsoftmax0(x, *args, dtype=_keep64(x, dtype) if dtype is not None else None, **kwargs)

    torch.Tensor.to, torch.Tensor.float, torch.softmax, F.softmax = to, flt, softmax, fsoftmax
    try:
        yield
    finally:
        torch.Tensor.to, torch.Tensor.float, torch.softmax, F.softmax = to0, float0, softmax0, fsoftmax0


def rounded_to_fp32(x: torch.Tensor) -> torch.Tensor:
    """A float64 tensor rounded to fp32 and back (inside ``true_fp64()`` too): one fp32 rounding."""
    return _TO(_TO(x, torch.float32), _F64)


def fp64_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    """[T, V] logits of the checkpoint at ``path`` on ``ids``, every operation in float64."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=_F64, experts_implementation="eager").eval()
    with torch.no_grad(), true_fp64():
        return model(ids[None], use_cache=False).logits[0]
