"""``sluice convert``: a Hugging Face directory -> a packed container, tensor by tensor.

Peak memory stays at one tensor or one expert whatever the model size. The container is
written under ``<dst>.partial`` and renamed when complete, so an interrupted conversion
never leaves a directory that loads; rerunning replaces it.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from pathlib import Path

import torch

from . import __version__
from .checkpoint import DTYPE_NAMES
from .container import (
    FORMAT_IDS,
    FORMAT_NAME,
    HEADER_BYTES,
    VERSION,
    bank_name,
    is_container,
    pack_header,
    plan_parts,
    record_bytes_for,
)
from .engine import ModelInfo
from .errors import CheckpointError
from .experts.fused import canonical_layout, canonical_weights
from .experts.source import views
from .progress import Progress
from .quant.fp8 import FORMAT as FP8_FORMAT
from .quant import QuantMatrix, assemble
from .storage import ALIGN, AlignedBuffer, align_up

MATRIX_ROLES = ("gate", "up", "down")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")
DENSE_FORMATS = ("f32", "bf16", "f16")


def part_specs(fmt: str, layout) -> list[tuple[str, str, tuple[int, ...]]]:
    """The parts one expert record holds in format ``fmt``: matrices in canonical order, then biases."""
    by_name = {v.name: v for v in layout.views}
    specs = []
    for role in MATRIX_ROLES:
        v = by_name[role]
        if fmt in DENSE_FORMATS:
            specs.append((role, _DENSE_DTYPE[fmt], tuple(v.shape)))
        elif fmt == FP8_FORMAT:  # stored as is; "<role>_scale_inv" follows among the other parts
            specs.append((role, DTYPE_NAMES[v.dtype], tuple(v.shape)))
        else:
            from .quant.formats import FORMATS

            n, k = v.shape
            for part, (dtype, shape) in FORMATS[fmt].parts(n, k).items():
                specs.append((f"{role}.{part}", DTYPE_NAMES[dtype], tuple(shape)))
    for name in sorted(n for n in by_name if n not in MATRIX_ROLES):
        v = by_name[name]
        specs.append((name, DTYPE_NAMES[v.dtype], tuple(v.shape)))
    return specs


_DENSE_DTYPE = {"f32": "F32", "bf16": "BF16", "f16": "F16"}
_TORCH_DENSE = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def encode_parts(fmt: str, weights: dict[str, torch.Tensor], parts, record: AlignedBuffer, base: int) -> None:
    """Write each part of one expert (cast or quantized from ``weights``) into ``record``."""
    encoded: dict[str, torch.Tensor] = {}
    for role in MATRIX_ROLES:
        w = weights[role]
        if isinstance(w, QuantMatrix):  # stored quantized (a native MXFP4 checkpoint): kept as is if
            if w.format.name == fmt:     # the target is its own format, else dequantized first
                encoded.update({f"{role}.{part}": t for part, t in w.parts.items()})
                continue
            w = w.dequantize()
        if fmt in DENSE_FORMATS:
            encoded[role] = w if w.dtype == _TORCH_DENSE[fmt] else w.to(_TORCH_DENSE[fmt])
        elif fmt == FP8_FORMAT:
            encoded[role] = w
        else:
            from .quant.formats import FORMATS

            for part, t in FORMATS[fmt].quantize(w.float()).items():
                encoded[f"{role}.{part}"] = t
    for p in parts:
        t = encoded[p.name] if p.name in encoded else weights[p.name]
        dest = record.tensor(base + p.offset, t.dtype, tuple(t.shape))
        dest.copy_(t)


def spine_group(name: str) -> str:
    """Spine tensors are stored grouped per layer ("layer.N"), plus "embed" and "head"."""
    parts = name.split(".")
    if "layers" in parts:
        i = parts.index("layers")
        if i + 1 < len(parts) and parts[i + 1].isdigit():
            return f"layer.{int(parts[i + 1])}"
    return "embed" if "embed" in name else "head"


def _group_order(g: str) -> tuple[int, int]:
    if g == "embed":
        return (0, 0)
    if g.startswith("layer."):
        return (1, int(g.split(".")[1]))
    return (2, 0)


def convert(src: str | os.PathLike, dst: str | os.PathLike, *, experts: str | None = None,
            progress: bool = True) -> Path:
    """Convert ``src`` (a Hugging Face directory, ``demo`` or a cached repo id) into a container at
    ``dst``; returns ``dst``."""
    src, dst = Path(src), Path(dst)
    if is_container(src):
        raise CheckpointError(f"{src}: is already a Sluice container")
    info = ModelInfo(src, direct_io=None)
    src = info.path  # 'demo' or a cached repo id resolved to its directory
    ckpt, desc, source = info.checkpoint, info.desc, info.experts
    fmt = experts or source.format
    if fmt not in FORMAT_IDS:
        raise ValueError(f"unknown expert format {fmt!r} (choose from: {', '.join(FORMAT_IDS)})")
    if (fmt == FP8_FORMAT) != (source.format == FP8_FORMAT):
        raise ValueError(f"expert format {fmt!r} from {source.format!r} experts is not supported: block-scaled FP8 "
                         "experts are stored as they are (fp8), and other experts are not quantized to fp8")
    # sizes first: check free disk
    layer0 = desc.moe_layers[0] if desc.moe_layers else None
    # fused on-disk layouts (GPT-OSS) become canonical gate/up/down records here
    shapes = desc.expert.matrix_shapes()
    specs = part_specs(fmt, canonical_layout(source.layout(layer0, 0), shapes)) if layer0 is not None else []
    parts, payload = plan_parts(specs)
    rec = record_bytes_for(payload)
    spine_total = sum(align_up(ckpt.info(n).nbytes, ALIGN) for n in desc.spine)
    total = spine_total + rec * desc.total_experts
    dst.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(dst.parent).free
    if free < total + (64 << 20):
        raise OSError(f"not enough free disk at {dst.parent}: the container needs {total / 1e9:.2f} GB, "
                      f"{free / 1e9:.2f} GB free")
    tmp = dst.with_name(dst.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    # counts the bytes it writes as data (not alignment padding), so it ends at 100%
    written = sum(ckpt.info(n).nbytes for n in desc.spine) + rec * desc.total_experts
    bar = Progress(written, f"converting to {dst.name}", enabled=progress)

    # spine: grouped per layer, each group 4096-aligned, tensors 64-aligned inside
    groups: dict[str, list[str]] = {}
    for name in desc.spine:
        groups.setdefault(spine_group(name), []).append(name)
    tensors, group_table = {}, {}
    with open(tmp / "spine.bin", "wb") as f:
        off = 0
        for g in sorted(groups, key=_group_order):
            start = align_up(off, ALIGN)
            f.write(b"\0" * (start - off))
            off = start
            crc = 0
            for name in groups[g]:
                pad = b"\0" * (align_up(off, 64) - off)
                f.write(pad)
                crc = zlib.crc32(pad, crc)
                off += len(pad)
                t = ckpt.read(name)
                data = memoryview(t.reshape(-1).view(torch.uint8).numpy())
                f.write(data)
                crc = zlib.crc32(data, crc)
                tensors[name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "offset": off, "group": g}
                off += len(data)
                bar.update(len(data))
            group_table[g] = [start, off - start, crc]
        f.write(b"\0" * (align_up(off, ALIGN) - off))

    # expert banks: one record per expert
    bank_table = {}
    buf = AlignedBuffer(source.slot_bytes)
    record = AlignedBuffer(rec)
    for layer in desc.moe_layers:
        with open(tmp / bank_name(layer), "wb") as f:
            for e in range(desc.n_experts):
                layout = source.read(layer, e, buf)
                record.tensor(0, torch.uint8, (rec,)).zero_()
                weights = canonical_weights(views(buf, 0, layout))
                if layout.format is not None:  # natively quantized source: parts -> matrices
                    weights = assemble(layout.format, weights, shapes)
                encode_parts(fmt, weights, parts, record, HEADER_BYTES)
                payload_bytes = record.view(HEADER_BYTES, payload)
                record.view(0, HEADER_BYTES)[:] = pack_header(fmt, layer, e, len(parts), payload_bytes)
                f.write(record.view(0, rec))
                bar.update(rec)
        bank_table[str(layer)] = {
            "file": bank_name(layer), "count": desc.n_experts, "record_bytes": rec,
            "parts": [{"name": p.name, "offset": p.offset, "dtype": p.dtype, "shape": list(p.shape)} for p in parts],
        }
    bar.close()

    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy2(src / name, tmp / name)
            copied.append(name)
    manifest = {
        "format": FORMAT_NAME,
        "version": VERSION,
        "created_by": f"sluice {__version__}",
        "model_type": desc.model_type,
        "config": info.raw_config,
        "generation_config": ckpt.generation_config,
        "expert_format": fmt,
        "source": {"path": src.name, "expert_dtype": source.format},
        "spine": {"file": "spine.bin", "tensors": tensors, "groups": group_table},
        "experts": {"record_bytes": rec, "layers": bank_table},
        "tokenizer_files": copied,
    }
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
    ckpt.close()
    if dst.exists():
        old = dst.with_name(dst.name + ".old")
        if old.exists():
            shutil.rmtree(old)
        os.replace(dst, old)
        os.replace(tmp, dst)
        shutil.rmtree(old)
    else:
        os.replace(tmp, dst)
    return dst
