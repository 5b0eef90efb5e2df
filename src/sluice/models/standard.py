"""Checkpoint naming shared by several families: per-expert tensors named by a template."""

from __future__ import annotations

from ..experts.spec import ExpertSpec, TensorRef

PROJ_NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def expert_refs(spec: ExpertSpec, template: str, names: dict[str, str]):
    """``expert_tensors(layer, e)`` for per-expert tensors named ``template.format(layer=, e=, name=)``."""
    shapes = spec.matrix_shapes()

    def expert_tensors(layer: int, e: int) -> dict[str, TensorRef]:
        return {role: TensorRef(template.format(layer=layer, e=e, name=n), shapes[role]) for role, n in names.items()}

    return expert_tensors
