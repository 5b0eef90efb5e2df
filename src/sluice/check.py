"""``sluice check``: read every spine group and expert record of a container and verify its CRC.

A tool above the API: it opens the container as the engine would (``ModelInfo``: the family
says which layers have experts and what shapes their records hold), then reads everything.
"""

from __future__ import annotations

from pathlib import Path

from .container import Container
from .engine import ModelInfo
from .errors import CheckpointError, ExpertReadError
from .progress import Progress
from .storage import AlignedBuffer


def check_container(path: str | Path, progress: bool = True) -> dict:
    """Verify every spine group and expert record CRC; returns a report (``ok``, ``errors``)."""
    info = ModelInfo(path)
    c, src = info.checkpoint, info.experts
    if not isinstance(c, Container):
        raise CheckpointError(f"{path}: not a Sluice container (sluice check verifies containers)")
    errors: list[str] = []
    records = list(src.records())
    bar = Progress(sum(n for _, n, _ in c.spine_groups.values()) + len(records) * src.slot_bytes,
                   f"checking {info.model_id}", enabled=progress)
    for g, (_off, n, _crc) in c.spine_groups.items():
        try:
            c.read_group(g, {})
        except CheckpointError as e:
            errors.append(str(e))
        bar.update(n)
    buf = AlignedBuffer(src.slot_bytes)
    for layer, e in records:
        try:
            src.read(layer, e, buf, 0, verify_crc=True)
        except ExpertReadError as err:
            errors.append(str(err))
        bar.update(src.slot_bytes)
    bar.close()
    c.close()
    return {"path": str(path), "manifest_checksum": c.manifest_checksum, "spine_groups": len(c.spine_groups),
            "records": len(records), "errors": errors, "ok": not errors}
