"""What one routed expert is, independent of any model family."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertSpec:
    """A routed expert's shape and computation.

    ``variant``:
      - ``"swiglu"``: ``down(act(gate(x)) * up(x))`` with gate/up [I, H] and down [H, I]
        (Mixtral, Qwen3-MoE, OLMoE, DeepSeek, ...), optional biases.
      - ``"clamped_swiglu"``: GPT-OSS: gate clamped above at ``limit``, up clamped to
        [-limit, limit], ``(up + 1) * (gate * sigmoid(gate * alpha))`` (transformers'
        ``GptOssExperts._apply_gate``, same order of operations), with biases.
      - ``"clamped_silu"``: DeepSeek-V4: gate clamped above at ``limit``, up clamped to
        [-limit, limit], then ``act(gate) * up`` (transformers' ``DeepseekV4Experts._apply_gate``;
        not GPT-OSS's ``(up + 1)`` and ``alpha``, so it is a variant of its own).

    ``block``: the (rows, cols) weight block of block-scaled matrices (FP8 checkpoints: a
    role's record holds ``<role>`` and ``<role>_scale_inv``), None for plain dtypes.
    """

    hidden: int
    intermediate: int
    act: str = "silu"
    variant: str = "swiglu"
    bias: bool = False
    limit: float = 7.0
    alpha: float = 1.702
    block: tuple[int, int] | None = None

    @property
    def input_major(self) -> bool:
        """Checkpoints store these experts input-major (``x @ W``: GPT-OSS). Every layout of them
        (the checkpoint's fused slices, canonical container records) is then summed in the
        input-major order (``quant.linear_chain``), so that both give the same bits."""
        return self.variant == "clamped_swiglu"

    def matrix_shapes(self) -> dict[str, tuple[int, int]]:
        """Canonical [out, in] shape of each matrix."""
        h, i = self.hidden, self.intermediate
        return {"gate": (i, h), "up": (i, h), "down": (h, i)}

    def role_shapes(self) -> dict[str, tuple[int, int]]:
        """[out, in] of every matrix role a record or checkpoint may hold: the canonical three and
        the fused ``gate_up`` [2I, H] (rows interleaving gate and up, as GPT-OSS MXFP4 stores it)."""
        return {**self.matrix_shapes(), "gate_up": (2 * self.intermediate, self.hidden)}

    def param_count(self) -> int:
        """Parameters of one expert (matrices, plus biases when ``bias``), whatever the storage format."""
        h, i = self.hidden, self.intermediate
        return 3 * h * i + ((2 * i + h) if self.bias else 0)


@dataclass(frozen=True)
class TensorRef:
    """Where one expert matrix lives in a checkpoint: tensor ``name``, optionally the
    ``index``-th slice along dim 0 of a fused [E, ...] tensor, starting ``row0`` rows into
    that slice (gate and up halves of a fused gate_up tensor), of ``shape``."""

    name: str
    shape: tuple[int, ...]
    index: int | None = None
    row0: int = 0


ExpertTensors = dict[str, TensorRef]  # role ("gate", "up", "down", "gate_bias", ...) -> ref
