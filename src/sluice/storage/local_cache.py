"""The local caches on disk, as ``sluice cache list|clear`` sees them (the library behind the command).

Sluice keeps two caches on disk, each with a reason to be its own format:

- the **disk tier** (``disk_tier.py``): byte ranges of a remote model's data (experts, spine
  layers), CRC-checked entry files under one size bound with decayed-frequency eviction
  (``sluice.decay``), shared by concurrent processes;
- the **metadata cache** (``meta_cache.py``): whole small objects that opening a model reads
  (config, index, manifest, tokenizer files, safetensors headers), the newest version only,
  revalidated by ETag. It is not bounded by ``--disk-cache`` and not evicted by the tier's rule:
  a model must open (and be revalidated by one conditional request) however full the tier is,
  and its copies are kilobytes to a few MiB.

(A third, a copy of ``tokenizer.json`` for the tokenizer library, is gone: the tokenizer is built
from the bytes the metadata cache keeps.) ``survey`` and ``clear`` return the report ``--json``
prints and the lines the command prints otherwise, with what is worth a note or warning.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..errors import SluiceError
from ..units import format_size
from . import meta_cache
from .disk_tier import DiskTier, default_dir


@dataclass
class CacheReport:
    report: dict  # what ``sluice cache --json`` prints
    lines: list[str]  # what it prints otherwise
    notes: list[str] = field(default_factory=list)  # ``sluice: note:`` lines
    warnings: list[str] = field(default_factory=list)  # ``sluice: warning:`` lines


def _open_tier(directory) -> DiskTier | None:
    if not os.path.exists(directory) or (os.path.isdir(directory) and not os.listdir(directory)):
        return None
    return DiskTier(directory, create=False)  # a directory that is not a tier is refused here, untouched


def _foreign_note(meta) -> list[str]:
    if not meta.foreign:
        return []
    return [f"{len(meta.foreign)} file(s) in {meta.dir} that the metadata cache did not make were left alone "
            f"(e.g. {meta.foreign[0]})"]


def survey(disk_cache_dir=None) -> CacheReport:
    """What the disk tier (at ``disk_cache_dir``, default ``disk_tier.default_dir()``) and the
    metadata cache hold, per model."""
    directory = disk_cache_dir or default_dir()
    tier = _open_tier(directory)
    try:
        report = {"dir": str(directory), "exists": False, "models": [], "entries": 0, "bytes": 0}
        lines = [f"no disk tier at {directory}"]
        meta = meta_cache.survey()
        if tier is not None:
            bound, users = tier.openers()
            report = {"dir": str(tier.dir), "exists": True, "models": tier.models(), **tier.usage(),
                      "open_by": users, "bound": bound}
            held = f"; open by {users} process(es), bound {format_size(bound)} (the smallest --disk-cache)" \
                if users else ""
            lines = [f"disk tier {tier.dir}: {report['entries']} entries, {format_size(report['bytes'])}{held}"]
            lines += [f"  {format_size(m['bytes']):>12}  {m['entries']:6d} entries  {m['objects']:4d} files  "
                      f"{m['hits']:8d} hits  {m['model']}" for m in report["models"]]
        report["meta"] = {"dir": str(meta.dir), "exists": meta.exists, **meta.totals(), "notes": meta.problems}
        t = report["meta"]
        extra = "".join(f", {t[k]} {k}" for k in ("corrupt", "partial") if t[k])
        lines.append(f"metadata cache {meta.dir}: {t['files']} files, {format_size(t['bytes'])}{extra}"
                     if meta.exists else f"no metadata cache at {meta.dir}")
        warnings = [f"metadata cache: {'; '.join(meta.problems)}"] if meta.problems else []
        return CacheReport(report, lines, _foreign_note(meta), warnings)
    finally:
        if tier is not None:
            tier.close()


def clear(disk_cache_dir=None, model: str | None = None) -> CacheReport:
    """Remove ``model``'s entries (None: everything) from the disk tier and the metadata cache;
    ``SluiceError`` when ``model`` is in neither, or the metadata cache could not be cleared
    completely (after the report: ``clear`` raises with it attached as ``err.cache_report``)."""
    directory = disk_cache_dir or default_dir()
    tier = _open_tier(directory)
    try:
        report = {"dir": str(directory), "exists": False, "models": [], "entries": 0, "bytes": 0}
        lines = [f"no disk tier at {directory}"]
        meta, meta_removed = meta_cache.clear(model=model)
        if tier is not None:
            held = model is None or any(m["model"] == model for m in tier.models())
            report = {"dir": str(tier.dir), "removed": tier.clear(model) if held else {"entries": 0, "bytes": 0},
                      **tier.usage()}
            lines = [f"removed {report['removed']['entries']} entries ({format_size(report['removed']['bytes'])}) "
                     f"of {model or 'every model'} from {tier.dir}; {report['entries']} entries "
                     f"({format_size(report['bytes'])}) left"]
        if (model is not None and not report.get("removed", {}).get("entries") and not meta_removed["files"]
                and not meta.problems):  # (with problems: the report, then the error naming them)
            raise SluiceError(f"neither the disk tier {directory} nor the metadata cache {meta.dir} holds anything "
                              f"of {model} (sluice cache list shows what they hold)")
        report["meta"] = {"dir": str(meta.dir), "removed": meta_removed, **meta.totals(), "notes": meta.problems}
        lines.append(f"removed {meta_removed['files']} files ({format_size(meta_removed['bytes'])}) of "
                     f"{model or 'every model'} from the metadata cache {meta.dir}; "
                     f"{report['meta']['files']} files left")
        out = CacheReport(report, lines, _foreign_note(meta))
        if meta.problems:
            err = SluiceError(f"the metadata cache was not cleared completely: {'; '.join(meta.problems)}")
            err.cache_report = out
            raise err
        return out
    finally:
        if tier is not None:
            tier.close()


__all__ = ["CacheReport", "clear", "survey"]
