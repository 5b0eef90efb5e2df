"""Checkpoint naming shared by several families: the usual names of an expert's projections
(``Model.routed_experts(spec, template, PROJ_NAMES)``)."""

from __future__ import annotations

PROJ_NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
