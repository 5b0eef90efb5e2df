"""The packed container: manifest, spine file, one expert bank per MoE layer.

Layout of a container directory::

    manifest.json            format version, family, source config verbatim, tensor tables
    spine.bin                spine tensors; each layer's tensors contiguous, the group 4096-aligned
    experts-L{layer:03d}.bin one record per expert, ``record_bytes`` apart (a multiple of 4096)
    tokenizer.json, ...      the source's tokenizer files, copied

An expert record is one aligned read: a 64-byte header, then the payload (every part of
gate, up and down, each 64-byte aligned), zero-padded to ``record_bytes``::

    0  magic  b"SLXR"        4  version u16   6  format id u16
    8  layer u32             12 expert u32    16 payload offset u32   20 part count u32
    24 payload bytes u64     32 CRC32 of the payload u32             36 reserved

Everything read back is untrusted: the manifest is bounds-checked against the files at
open, and each record's header is checked (magic, layer, expert, length) on every read;
``verify_reads`` also checks the payload CRC.
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from .checkpoint import DTYPES, TensorInfo
from .errors import CheckpointError, ExpertReadError
from .storage import ALIGN, LocalFile, ReadStats, align_up

MAGIC = b"SLXR"
FORMAT_NAME = "sluice-container"
VERSION = 1
HEADER = struct.Struct("<4sHHIIIIQI28x")
HEADER_BYTES = 64
PART_ALIGN = 64
assert HEADER.size == HEADER_BYTES

# expert format name <-> id stored in record headers
FORMAT_IDS = {"f32": 1, "bf16": 2, "f16": 3, "int8": 4, "q4": 5, "mxfp4": 6, "rvq3": 7, "fp8": 8}


def is_container(path: str | Path) -> bool:
    return (Path(path) / "manifest.json").exists()


def bank_name(layer: int) -> str:
    return f"experts-L{layer:03d}.bin"


@dataclass(frozen=True)
class Part:
    name: str  # view name: "gate", "up_bias", "down.scales", ...
    offset: int  # within the payload
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype][1]


def plan_parts(parts: list[tuple[str, str, tuple[int, ...]]]) -> tuple[list[Part], int]:
    """Lay out (name, dtype, shape) parts adjacently, each 64-byte aligned; returns parts, payload bytes."""
    out, off = [], 0
    for name, dtype, shape in parts:
        off = align_up(off, PART_ALIGN)
        p = Part(name, off, dtype, tuple(shape))
        out.append(p)
        off += p.nbytes
    return out, off


def record_bytes_for(payload: int) -> int:
    return align_up(HEADER_BYTES + payload, ALIGN)


def pack_header(fmt: str, layer: int, expert: int, nparts: int, payload: bytes | memoryview) -> bytes:
    return HEADER.pack(MAGIC, VERSION, FORMAT_IDS[fmt], layer, expert, HEADER_BYTES, nparts, len(payload),
                       zlib.crc32(payload))


def check_record(where: str, record: memoryview, fmt: str, layer: int, expert: int, payload: int,
                 verify_crc: bool) -> None:
    """Check an expert record just read: header (magic, place, length, format), and with
    ``verify_crc`` the payload's CRC32. Raises ``ExpertReadError`` starting with ``where``."""
    magic, version, fid, lay, exp, poff, nparts, plen, crc = HEADER.unpack(record[:HEADER_BYTES])
    if magic != MAGIC:
        raise ExpertReadError(f"{where}: bad record magic {magic!r} (corrupt bank or wrong offset)")
    if lay != layer or exp != expert:
        raise ExpertReadError(f"{where}: record header says layer {lay} expert {exp} (records out of place)")
    if poff != HEADER_BYTES or plen != payload or version != VERSION or fid != FORMAT_IDS[fmt]:
        raise ExpertReadError(f"{where}: record header does not match the manifest (payload {plen} bytes, "
                              f"expected {payload}; format id {fid})")
    if verify_crc:
        got = zlib.crc32(record[HEADER_BYTES : HEADER_BYTES + plen])
        if got != crc:
            raise ExpertReadError(f"{where}: CRC mismatch (stored {crc:08x}, computed {got:08x}): the record is corrupt")


class Container:
    """An opened container; offers the same tensor-store interface as ``Checkpoint``."""

    def __init__(self, path: str | Path, *, direct: bool | None = None, stats: ReadStats | None = None):
        self.path = Path(path)
        self.stats = stats if stats is not None else ReadStats()
        self.direct = direct
        self._files: dict[str, LocalFile] = {}
        mpath = self.path / "manifest.json"
        try:
            m = json.loads(mpath.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise CheckpointError(f"{mpath}: not found (not a Sluice container)") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{mpath}: not valid JSON ({e}); the container is damaged") from None
        self.manifest = m
        if not isinstance(m, dict) or m.get("format") != FORMAT_NAME:
            raise CheckpointError(f"{mpath}: not a {FORMAT_NAME} manifest")
        if m.get("version") != VERSION:
            raise CheckpointError(
                f"{mpath}: container version {m.get('version')!r} is not supported (this Sluice reads version "
                f"{VERSION}); convert the model again"
            )
        self.config = _obj(m, "config", mpath)
        self.generation_config = m.get("generation_config") or {}
        self.expert_format = m.get("expert_format")
        if self.expert_format not in FORMAT_IDS:
            raise CheckpointError(f"{mpath}: unknown expert_format {self.expert_format!r}")
        spine = _obj(m, "spine", mpath)
        self.spine_file = str(self.path / member_file(spine.get("file"), mpath))
        sfile = self.file(self.spine_file)
        self.tensors: dict[str, TensorInfo] = {}
        for name, t in _obj(spine, "tensors", mpath).items():
            self.tensors[name] = _spine_tensor(name, t, self.spine_file, sfile.size, mpath)
        self.spine_groups: dict[str, tuple[int, int, int]] = {}
        for k, v in (spine.get("groups") or {}).items():
            try:
                off, n, crc = (int(x) for x in v)
            except (TypeError, ValueError):
                raise CheckpointError(f"{mpath}: spine group {k!r} entry is malformed") from None
            if off < 0 or off % ALIGN or off + n > sfile.size:
                raise CheckpointError(f"{self.spine_file}: spine group {k!r} lies outside the file or is unaligned")
            self.spine_groups[k] = (off, n, crc)
        self.banks = _obj(m, "experts", mpath)

    def file(self, path: str) -> LocalFile:
        f = self._files.get(path)
        if f is None:
            try:
                f = self._files[path] = LocalFile(path, direct=self.direct, stats=self.stats)
            except OSError as e:
                raise CheckpointError(f"{path}: cannot open ({e.strerror})") from None
        return f

    @property
    def direct_io(self) -> bool:
        return bool(self._files) and all(f.direct_io for f in self._files.values())

    def info(self, name: str) -> TensorInfo:
        t = self.tensors.get(name)
        if t is None:
            raise CheckpointError(f"{self.path / 'manifest.json'}: tensor {name!r} is missing from the spine table")
        return t

    def read(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        info = self.info(name)
        if out is None:
            out = torch.empty(info.shape, dtype=info.torch_dtype)
        if info.nbytes:
            try:
                self.file(info.file).read_into(memoryview(out.reshape(-1).view(torch.uint8).numpy()), info.offset)
            except OSError as e:
                raise CheckpointError(f"{info.file}: reading tensor {name!r} failed: {e}") from None
        return out

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


def _obj(m: dict, key: str, where) -> dict:
    v = m.get(key)
    if not isinstance(v, dict):
        raise CheckpointError(f"{where}: '{key}' missing or not an object")
    return v


def member_file(v, where) -> str:
    """A file name from the manifest: a plain name inside the container directory."""
    if not isinstance(v, str) or not v or "/" in v or v.startswith("."):
        raise CheckpointError(f"{where}: invalid file name {v!r}")
    return v


def _spine_tensor(name: str, t, file: str, size: int, where) -> TensorInfo:
    try:
        dtype, shape, off = t["dtype"], tuple(t["shape"]), int(t["offset"])
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{where}: spine tensor {name!r} entry is malformed") from None
    if dtype not in DTYPES or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise CheckpointError(f"{where}: spine tensor {name!r} has bad dtype/shape {dtype!r} {list(shape)}")
    nbytes = math.prod(shape) * DTYPES[dtype][1]
    if off < 0 or off + nbytes > size:
        raise CheckpointError(
            f"{file}: spine tensor {name!r} ({nbytes} bytes at {off}) lies outside the {size}-byte file "
            "(truncated or edited container)"
        )
    return TensorInfo(name, file, off, nbytes, dtype, shape)


def parse_part(p, where, layer) -> Part:
    try:
        part = Part(str(p["name"]), int(p["offset"]), str(p["dtype"]), tuple(int(s) for s in p["shape"]))
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{where}: layer {layer} has a malformed part entry {p!r}") from None
    if part.dtype not in DTYPES or part.offset < 0 or part.offset % PART_ALIGN or any(s < 0 for s in part.shape):
        raise CheckpointError(f"{where}: layer {layer} part {part.name!r} has bad dtype/offset/shape")
    return part
