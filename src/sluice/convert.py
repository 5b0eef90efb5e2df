"""``sluice convert``: a Hugging Face directory -> a packed container, tensor by tensor.

Peak memory stays at one tensor or one expert whatever the model size. The container is
written under ``<dst>.partial``, fsynced, and renamed when complete, so an interrupted
conversion never leaves a directory that loads.

Convert never deletes anything that is not a Sluice container, and replaces an existing
container only with ``force=True`` (``convert_install.py``: the destination checks and the
swap). A failed write (e.g. ENOSPC) removes the partial output.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from pathlib import Path

import torch

from . import __version__
from .checkpoint import DTYPE_NAMES
from .container import (
    FORMAT_ALIGN,
    FORMAT_IDS,
    FORMAT_NAME,
    HEADER_BYTES,
    VERSION,
    bank_name,
    is_container,
    pack_header,
    plan_parts,
    record_bytes_for,
    seal_manifest,
)
from .engine import ModelInfo
from .options import Options
from .errors import CheckpointError, ConvertError, InvalidArgumentError, SluiceError
from .experts.fused import canonical_layout
from .models import quantized_spine
from .progress import Progress
from .resolve import resolve_model
from .rows.table import pack_page, page_bytes_for
from .quant.fp8 import FORMAT as FP8_FORMAT
from .quant import FORMATS, QuantMatrix, assemble
from .quant.fp8 import SCALE_SUFFIX, BlockFP8
from .storage.crc import crc32
from .storage import AlignedBuffer, align_up
from .convert_install import PARTIAL_MARK, Naming, check_destination, fsync_path, install, remove_ours, sync_close
from .convert_install import writer as open_writer


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
    todo: dict[str, torch.Tensor] = {}
    for role in MATRIX_ROLES:
        w = weights[role]
        if isinstance(w, QuantMatrix):  # stored quantized (a native MXFP4 checkpoint): kept as is if
            if w.format.name == fmt:     # the target is its own format, else dequantized first
                encoded.update({f"{role}.{part}": t for part, t in w.parts.items()})
                continue
            w = w.dequantize()
        if isinstance(w, BlockFP8):  # stored as is (fp8 to fp8 only): the values and their block scales
            encoded[role], encoded[role + SCALE_SUFFIX] = w.weight, w.stored_scale
        elif fmt in DENSE_FORMATS:
            encoded[role] = w if w.dtype == _TORCH_DENSE[fmt] else w.to(_TORCH_DENSE[fmt])
        else:
            todo[role] = w if w.dtype in _TORCH_DENSE.values() else w.float()
    if todo:
        quant = FORMATS[fmt]
        if getattr(quant, "threads_per_matrix", 0) == 1 and len(todo) > 1:  # one thread each: matrices in parallel
            results = dict(zip(todo, _matrix_pool().map(quant.quantize, todo.values())))
        else:  # the quantizer spreads one matrix over the cores itself
            results = {role: quant.quantize(w) for role, w in todo.items()}
        for role, out in results.items():
            encoded.update({f"{role}.{part}": t for part, t in out.items()})
    for p in parts:
        t = encoded[p.name] if p.name in encoded else weights[p.name]
        dest = record.tensor(base + p.offset, t.dtype, tuple(t.shape))
        dest.copy_(t)


_POOL: ThreadPoolExecutor | None = None


def _matrix_pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        # one thread per matrix wherever there are two cores: on 2 cores, 3 matrices finish together
        # (time-sliced) instead of 2 then 1
        cores = min(torch.get_num_threads(), os.cpu_count() or 1)
        _POOL = ThreadPoolExecutor(len(MATRIX_ROLES) if cores >= 2 else 1, thread_name_prefix="sluice-quantize-matrix")
    return _POOL


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
            spine: str | None = None, progress: bool = True, force: bool = False,
            allow_unversioned_remote: bool = False) -> Path:
    """Convert ``src`` (a Hugging Face directory, ``demo``, a cached repo id, or the ``s3://`` or
    ``http(s)://`` URL of a directory) into a container at ``dst``; returns ``dst``.

    ``spine``: None or "stored" keeps the spine tensors as the checkpoint stores them; "int8"
    (lossy, opt-in) stores the spine's matrices (``quantized_spine.quantizable``) as int8 with
    one fp32 scale per row.

    An existing container at ``dst`` is replaced only with ``force``; any other existing path,
    and an output that is, lies inside or contains ``src``, is refused (``ConvertError``).

    ``allow_unversioned_remote``: a source at a URL whose server sends neither ETag nor
    Last-Modified is read anyway (refused by default, as for ``sluice.load``).
    """
    src, dst = resolve_model(src)[0], Path(dst)  # 'demo' or a cached repo id: its directory; a URL: a str
    if not dst.name or dst.name == "..":
        dst = dst.resolve()
    if is_container(src):
        raise CheckpointError(f"{src}: is already a Sluice container")
    check_destination(src, dst, force)
    info = ModelInfo(src, Options(progress=False, allow_unversioned_remote=allow_unversioned_remote))
    ckpt, desc, source = info.checkpoint, info.desc, info.experts
    fmt = experts or source.format
    spine = spine or "stored"
    if spine != "stored" and spine not in quantized_spine.SPINE_FORMATS:
        raise InvalidArgumentError(f"spine (--spine): unknown spine format {spine!r} (choose from: stored, "
                                   f"{', '.join(quantized_spine.SPINE_FORMATS)})")
    if fmt not in FORMAT_IDS:
        raise InvalidArgumentError(f"experts (--experts): unknown expert format {fmt!r} (choose from: "
                                   f"{', '.join(FORMAT_IDS)})")
    if (fmt == FP8_FORMAT) != (source.format == FP8_FORMAT):
        raise InvalidArgumentError(f"experts (--experts): format {fmt!r} from {source.format!r} experts is not "
                                   "supported: block-scaled FP8 experts are stored as they are (fp8), and other "
                                   "experts are not quantized to fp8")
    # sizes first: check free disk
    layer0 = desc.moe_layers[0] if desc.moe_layers else None
    # fused on-disk layouts (GPT-OSS) become canonical gate/up/down records here
    shapes = desc.expert.matrix_shapes()
    specs = part_specs(fmt, canonical_layout(source.layout(layer0, 0), shapes)) if layer0 is not None else []
    parts, payload = plan_parts(specs)
    rec = record_bytes_for(payload)
    spine_total = sum(align_up(ckpt.info(n).nbytes, FORMAT_ALIGN) for n in desc.spine)
    total = spine_total + rec * desc.total_experts + sum(2 * t.nbytes + FORMAT_ALIGN for t in info.row_tables.values())
    dst.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(dst.parent).free
    if free < total + (64 << 20):
        raise ConvertError(f"not enough free disk at {dst.parent}: the container needs {total / 1e9:.2f} GB, "
                           f"{free / 1e9:.2f} GB free")
    tmp = dst.with_name(dst.name + ".partial")
    remove_ours(tmp)
    tmp.mkdir()
    (tmp / PARTIAL_MARK).touch()
    writing = tmp
    try:
        writing = _write(src, tmp, info, fmt, parts, payload, rec, progress, dst.name, spine)
        writing = dst
        install(tmp, dst)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and not isinstance(e, SluiceError):
            where = e.filename or writing
            if e.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
                err = ConvertError(f"{where}: no space left on the device while writing the container; the partial "
                                   f"output {tmp} was removed (free some space and convert again)")
            else:
                err = ConvertError(f"{where}: writing the container failed ({e.strerror or e}); the partial "
                                   f"output {tmp} was removed")
            err.errno = e.errno
            raise err from None
        raise
    finally:
        ckpt.close()
    return dst


SPINE_CHUNK = 8 << 20  # spine tensors are copied in pieces of at most this many bytes


def _copy_tensor(ckpt, info, f, crc: int, chunk: AlignedBuffer, bar: Progress) -> int:
    """Copy one spine tensor's bytes from the checkpoint to ``f`` in bounded pieces; returns the CRC."""
    file = ckpt.file(info.file)
    step = chunk.nbytes
    for pos in range(0, info.nbytes, step):
        n = min(step, info.nbytes - pos)
        data = chunk.view(0, n)
        try:
            file.read_into(data, info.offset + pos)
        except OSError as e:
            raise CheckpointError(f"{info.file}: reading tensor {info.name!r} failed: {e}") from None
        f.write(data)
        crc = crc32(data, crc)
        bar.update(n)
    return crc


def _quantize_tensor(ckpt, name: str, spine: str, f, off: int, crc: int, chunk: AlignedBuffer,
                     bar: Progress) -> tuple[dict, int, int]:
    """Write spine matrix ``name`` in format ``spine``: its ``weight`` part quantized from row
    blocks of at most ``chunk`` source bytes, then its other parts (64-byte aligned). Returns
    (the parts' tensor-table entries without their group, the offset after them, the CRC)."""
    info = ckpt.info(name)  # (its bytes may be stored under an alias's name)
    n, k = info.shape
    file = ckpt.file(info.file)
    row_bytes = info.nbytes // max(n, 1)
    step = max(1, chunk.nbytes // max(row_bytes, 1))
    rest: dict[str, list[torch.Tensor]] = {}
    names = quantized_spine.part_names(name, spine)
    entries = {}
    for r0 in range(0, n, step):
        r = min(step, n - r0)
        data = chunk.view(0, r * row_bytes)
        try:
            file.read_into(data, info.offset + r0 * row_bytes)
        except OSError as e:
            raise CheckpointError(f"{info.file}: reading tensor {info.name!r} failed: {e}") from None
        q = quantized_spine.quantize_rows(spine, chunk.tensor(0, info.torch_dtype, (r, k)))
        out = memoryview(q["weight"].contiguous().view(torch.uint8).numpy()).cast("B")
        f.write(out)
        crc = crc32(out, crc)
        for part, t in q.items():
            if part != "weight":
                rest.setdefault(part, []).append(t)
        bar.update(r * row_bytes)
    specs = FORMATS[spine].parts(n, k)
    dtype, shape = specs["weight"]
    entries[names["weight"]] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "offset": off, "format": spine}
    off += math.prod(shape) * dtype.itemsize
    for part, pieces in rest.items():
        pad = b"\0" * (align_up(off, 64) - off)
        f.write(pad)
        crc = crc32(pad, crc)
        off += len(pad)
        t = torch.cat(pieces).contiguous()
        data = memoryview(t.view(torch.uint8).numpy()).cast("B")
        f.write(data)
        crc = crc32(data, crc)
        entries[names[part]] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(specs[part][1]), "offset": off}
        off += len(data)
    return entries, off, crc


def _write_rows(tmp: Path, info, bar) -> dict:
    """rows.bin: every row table packed into CRC-checked pages (``rows.table.pack_page``), each table
    4096-aligned; returns the manifest's ``rows`` entry."""
    tables = {}
    f = open_writer(tmp / "rows.bin")
    with Naming(tmp / "rows.bin"), closing(f):
        off = 0
        for name, t in info.row_tables.items():
            page = page_bytes_for(t.row_bytes)
            per = (page - 4) // t.row_bytes
            start = align_up(off, FORMAT_ALIGN)
            f.write(b"\0" * (start - off))
            off, pages = start, 0
            buf = bytearray()
            for p in t.pieces:  # the rows in order, a bounded number of pages at a time
                file = info.checkpoint.file(p.file)
                step = max(per, (SPINE_CHUNK // t.row_bytes) // per * per)
                for r0 in range(0, p.rows, step):
                    n = min(step, p.rows - r0)
                    data = bytearray(n * t.row_bytes)
                    try:
                        file.read_into(memoryview(data), p.offset + r0 * t.row_bytes)
                    except OSError as e:
                        raise CheckpointError(f"{p.file}: reading row table {name!r} failed: {e}") from None
                    buf += data
                    while len(buf) >= per * t.row_bytes:
                        f.write(pack_page(buf[: per * t.row_bytes], page))
                        del buf[: per * t.row_bytes]
                        pages += 1
                    bar.update(len(data))
            if buf:
                f.write(pack_page(buf, page))
                pages += 1
            tables[name] = {"dtype": t.dtype, "shape": [t.rows, t.dim], "offset": start, "page_bytes": page,
                            "pages": pages}
            off = start + pages * page
        sync_close(f)
    return {"file": "rows.bin", "tables": tables}


def _write(src: Path | str, tmp: Path, info, fmt: str, parts, payload: int, rec: int,
           progress: bool, label: str, spine: str = "stored") -> Path:
    ckpt, desc, source = info.checkpoint, info.desc, info.experts
    quantize = set()
    if spine != "stored":  # float matrices only: FP8 weights stay as stored (one byte already)
        quantize = {n for n in quantized_spine.quantizable(desc) if ckpt.info(n).dtype in ("F32", "BF16", "F16")}
    # counts the bytes it writes as data (not alignment padding), so it ends at 100%
    written = (sum(ckpt.info(n).nbytes for n in desc.spine) + rec * desc.total_experts
               + sum(t.nbytes for t in info.row_tables.values()))
    bar = Progress(written, f"converting to {label}", enabled=progress)

    # spine: grouped per layer, each group 4096-aligned, tensors 64-aligned inside
    groups: dict[str, list[str]] = {}
    for name in desc.spine:
        groups.setdefault(spine_group(name), []).append(name)
    tensors, group_table = {}, {}
    chunk = AlignedBuffer(SPINE_CHUNK)
    f = open_writer(tmp / "spine.bin")
    with Naming(tmp / "spine.bin"), closing(f):
        off = 0
        for g in sorted(groups, key=_group_order):
            start = align_up(off, FORMAT_ALIGN)
            f.write(b"\0" * (start - off))
            off = start
            crc = 0
            for name in groups[g]:
                pad = b"\0" * (align_up(off, 64) - off)
                f.write(pad)
                crc = crc32(pad, crc)
                off += len(pad)
                info_t = ckpt.info(name)
                if name in quantize:
                    entries, off, crc = _quantize_tensor(ckpt, name, spine, f, off, crc, chunk, bar)
                    tensors.update({n: {**e, "group": g} for n, e in entries.items()})
                    continue
                crc = _copy_tensor(ckpt, info_t, f, crc, chunk, bar)
                tensors[name] = {"dtype": DTYPE_NAMES[info_t.torch_dtype], "shape": list(info_t.shape),
                                 "offset": off, "group": g}
                off += info_t.nbytes
            group_table[g] = [start, off - start, crc]
        f.write(b"\0" * (align_up(off, FORMAT_ALIGN) - off))
        sync_close(f)

    rows_entry = _write_rows(tmp, info, bar) if info.row_tables else None

    # expert banks: one record per expert. A reader thread reads the next expert while this one is
    # encoded, and a writer thread writes the previous record (two buffers each; the quantizers
    # and the I/O release the GIL): bounded memory, the same bytes in the same order
    bank_table = {}
    bufs = [AlignedBuffer(source.slot_bytes) for _ in range(2)]
    records = [AlignedBuffer(rec) for _ in range(2)]
    items = [(layer, e) for layer in desc.moe_layers for e in range(desc.n_experts)]

    def read(i: int):
        return source.read(*items[i], bufs[i % 2])

    i = 0
    with ThreadPoolExecutor(1, thread_name_prefix="sluice-convert-read") as reader:
        pending = reader.submit(read, 0) if items else None
        for layer in desc.moe_layers:
            f = open_writer(tmp / bank_name(layer))
            with Naming(tmp / bank_name(layer)), closing(f), \
                    ThreadPoolExecutor(1, thread_name_prefix="sluice-convert-write") as writer:
                writes = [None, None]
                for e in range(desc.n_experts):
                    layout = pending.result()
                    buf, record = bufs[i % 2], records[i % 2]
                    if i + 1 < len(items):  # the other buffer's expert was encoded last round
                        pending = reader.submit(read, i + 1)
                    if writes[i % 2] is not None:  # this record's previous write is done
                        writes[i % 2].result()
                    record.tensor(0, torch.uint8, (rec,)).zero_()
                    weights = assemble(buf, 0, layout).canonical()  # fused layouts de-interleaved
                    encode_parts(fmt, weights, parts, record, HEADER_BYTES)
                    payload_bytes = record.view(HEADER_BYTES, payload)
                    record.view(0, HEADER_BYTES)[:] = pack_header(fmt, layer, e, len(parts), payload_bytes)
                    writes[i % 2] = writer.submit(f.write, record.view(0, rec))
                    bar.update(rec)
                    i += 1
                for w in writes:
                    if w is not None:
                        w.result()
                sync_close(f)
            bank_table[str(layer)] = {
                "file": bank_name(layer), "count": desc.n_experts, "record_bytes": rec,
                "parts": [{"name": p.name, "offset": p.offset, "dtype": p.dtype, "shape": list(p.shape)}
                          for p in parts],
            }
    bar.close()

    copied = []
    for name in TOKENIZER_FILES:
        if info.store.exists(name):
            local = info.store.local_path(name)
            if local is not None:
                shutil.copy2(local, tmp / name)
            else:
                (tmp / name).write_bytes(info.store.read_bytes(name))
            fsync_path(tmp / name)
            copied.append(name)
    manifest = {
        "format": FORMAT_NAME,
        "version": VERSION,
        "created_by": f"sluice {__version__}",
        "model_type": desc.model_type,
        "config": info.raw_config,
        "generation_config": ckpt.generation_config,
        "expert_format": fmt,
        "spine_format": spine,
        "source": {"path": Path(src).name, "expert_dtype": source.format},
        "spine": {"file": "spine.bin", "tensors": tensors, "groups": group_table},
        "experts": {"record_bytes": rec, "layers": bank_table},
        "tokenizer_files": copied,
    }
    if rows_entry is not None:
        manifest["rows"] = rows_entry
    f = open_writer(tmp / "manifest.json")
    with Naming(tmp / "manifest.json"), closing(f):
        f.write(json.dumps(seal_manifest(manifest), indent=1).encode("utf-8"))
        sync_close(f)
    fsync_path(tmp)
    return tmp
