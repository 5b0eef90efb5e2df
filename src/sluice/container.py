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

Everything read back is untrusted: the manifest carries a SHA-256 of its canonical JSON
(checked at open) and is bounds-checked against the files; every spine group's CRC32 is
checked when the group is loaded (and, with ``verify_reads``, each time a streamed layer is
read); each record's header is checked (magic, layer, expert, length) on every read and,
with ``verify_reads`` (the default), its payload CRC32 too, on the reader thread.

The container's files are reached only through the storage seam (a ``Store`` for the
manifest, ``ByteSource``s for the spine and banks): nothing here knows which kind of storage
holds them. Records and spine groups are ``FORMAT_ALIGN``-aligned, so any source whose
``alignment`` divides it reads one in one aligned read.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from .checkpoint import DTYPES, TensorInfo
from .errors import CheckpointError, ExpertReadError, shown
from .storage import AlignedBuffer, ByteSource, LocalDir, ReadStats, Sources, Store, align_up, open_store
from .storage.crc import crc32
from .storage.jsonfile import JSONFileError, read_json

MAGIC = b"SLXR"
FORMAT_NAME = "sluice-container"
VERSION = 1
HEADER = struct.Struct("<4sHHIIIIQI28x")
HEADER_BYTES = 64
PART_ALIGN = 64
FORMAT_ALIGN = 4096  # spine groups start, and expert records are sized, at multiples of this
assert HEADER.size == HEADER_BYTES

# expert format name <-> id stored in record headers
FORMAT_IDS = {"f32": 1, "bf16": 2, "f16": 3, "int8": 4, "q4": 5, "mxfp4": 6, "rvq3": 7, "fp8": 8, "int4": 9, "fp4": 10}


CHECKSUM_KEY = "manifest_sha256"


def manifest_digest(m: dict) -> str:
    """SHA-256 of the manifest's canonical JSON (sorted keys, no spaces) without its checksum field."""
    body = {k: v for k, v in m.items() if k != CHECKSUM_KEY}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8")).hexdigest()


def seal_manifest(m: dict) -> dict:
    """Store the manifest's checksum in it (after any edit); returns ``m``."""
    m[CHECKSUM_KEY] = manifest_digest(m)
    return m


def is_container(path: str | Path | Store) -> bool:
    store = path if isinstance(path, Store) else open_store(path)
    return store.exists("manifest.json")


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
    return align_up(HEADER_BYTES + payload, FORMAT_ALIGN)


def pack_header(fmt: str, layer: int, expert: int, nparts: int, payload: bytes | memoryview) -> bytes:
    return HEADER.pack(MAGIC, VERSION, FORMAT_IDS[fmt], layer, expert, HEADER_BYTES, nparts, len(payload),
                       crc32(payload))


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
        got = crc32(record[HEADER_BYTES : HEADER_BYTES + plen])
        if got != crc:
            raise ExpertReadError(f"{where}: CRC mismatch (stored {crc:08x}, computed {got:08x}): "
                                  "the record is corrupt")


class Container:
    """An opened container; offers the same tensor-store interface as ``Checkpoint``.

    ``path``: a directory path or an opened ``Store``; ``direct``, ``stats`` and ``sources``
    as for ``Checkpoint``.
    """

    def __init__(self, path: str | Path | Store, *, direct: bool | None = None, stats: ReadStats | None = None):
        self.store = store = path if isinstance(path, Store) else open_store(path)
        self.location = store.location
        self.path = Path(store.location) if isinstance(store, LocalDir) else store.location  # a URL stays a str
        self.sources = Sources(direct=direct, stats=stats, store=store)
        self.stats, self.direct = self.sources.stats, direct
        self.manifest_path = mpath = store.locate("manifest.json")
        try:
            m = read_json(store, "manifest.json")  # size-capped, depth-checked (storage/jsonfile.py)
        except FileNotFoundError:
            raise CheckpointError(f"{mpath}: not found (not a Sluice container)") from None
        except JSONFileError as e:
            raise type(e)(f"{e}; the container is damaged") from None
        except OSError as e:
            raise CheckpointError(f"{mpath}: cannot read ({e.strerror or e})") from None
        self.manifest = m
        if not isinstance(m, dict) or m.get("format") != FORMAT_NAME:
            raise CheckpointError(f"{mpath}: not a {FORMAT_NAME} manifest")
        if m.get("version") != VERSION:
            raise CheckpointError(
                f"{mpath}: container version {m.get('version')!r} is not supported (this Sluice reads version "
                f"{VERSION}); convert the model again"
            )
        stored = m.get(CHECKSUM_KEY)
        self.manifest_checksum: bool | None = None  # None: an older container without one
        if stored is None:
            warnings.warn(f"{mpath}: the container was written by an older Sluice and its manifest has no checksum, "
                          "so edits to it cannot be detected; convert the model again", stacklevel=3)
        else:
            got = manifest_digest(m)
            if stored != got:
                raise CheckpointError(
                    f"{mpath}: manifest checksum mismatch (stored {str(stored)[:16]!r}..., computed {got[:16]}...): "
                    "the manifest was edited or is corrupt; convert the model again")
            self.manifest_checksum = True
        self.config = _obj(m, "config", mpath)
        self.generation_config = m.get("generation_config") or {}
        self.expert_format = m.get("expert_format")
        if self.expert_format not in FORMAT_IDS:
            raise CheckpointError(f"{mpath}: unknown expert_format {self.expert_format!r}")
        spine = _obj(m, "spine", mpath)
        self.spine_file = store.locate(member_file(spine.get("file"), mpath))
        sfile = self.file(self.spine_file)
        self.tensors: dict[str, TensorInfo] = {}
        # spine matrices stored in a weight format (``convert --spine int8``): name -> format name;
        # the tensor under ``name`` is the format's ``weight`` part, others follow as "<name>.<part>"
        self.spine_quant: dict[str, str] = {}
        for name, t in _obj(spine, "tensors", mpath).items():
            self.tensors[name] = _spine_tensor(name, t, self.spine_file, sfile.size, mpath)
            if isinstance(t, dict) and "format" in t:
                if not isinstance(t["format"], str):
                    raise CheckpointError(f"{mpath}: spine tensor {name!r} has a malformed format {t['format']!r}")
                self.spine_quant[name] = t["format"]
        self.spine_groups: dict[str, tuple[int, int, int]] = {}
        for k, v in (spine.get("groups") or {}).items():
            try:
                off, n, crc = (int(x) for x in v)
            except (TypeError, ValueError):
                raise CheckpointError(f"{mpath}: spine group {k!r} entry is malformed") from None
            if off < 0 or n < 0 or off % FORMAT_ALIGN or off + n > sfile.size:
                raise CheckpointError(f"{self.spine_file}: spine group {k!r} lies outside the file or is unaligned")
            self.spine_groups[k] = (off, n, crc)
        # every spine tensor lies inside its CRC-protected group
        self.group_of: dict[str, str] = {}
        for name, t in spine["tensors"].items():
            g = t.get("group")
            info = self.tensors[name]
            if g not in self.spine_groups:
                raise CheckpointError(f"{mpath}: spine tensor {name!r} names group {g!r}, which the spine table "
                                      "does not have (its bytes would not be CRC-checked)")
            off, n, _ = self.spine_groups[g]
            if not off <= info.offset <= info.offset + info.nbytes <= off + n:
                raise CheckpointError(f"{mpath}: spine tensor {name!r} ({info.nbytes} bytes at {info.offset}) lies "
                                      f"outside its group {g!r} ({n} bytes at {off})")
            self.group_of[name] = g
        self.banks = _obj(m, "experts", mpath)
        # token-keyed tables packed into CRC-checked pages (rows/table.py): name -> (dtype, [rows, dim],
        # offset, page bytes, pages) in ``rows_file``; the row store reads them (nothing here knows rows)
        self.row_tables: dict[str, tuple[str, list[int], int, int, int]] = {}
        self.rows_file: str | None = None
        rows = m.get("rows")
        if rows is not None:
            rows = _obj(m, "rows", mpath)
            self.rows_file = store.locate(member_file(rows.get("file"), mpath))
            size = self.file(self.rows_file).size
            for name, t in _obj(rows, "tables", mpath).items():
                try:
                    dtype, shape, off, page = str(t["dtype"]), [int(x) for x in t["shape"]], int(t["offset"]), \
                        int(t["page_bytes"])
                    pages = int(t["pages"])
                except (KeyError, TypeError, ValueError):
                    raise CheckpointError(f"{mpath}: row table {name!r} entry is malformed") from None
                if (len(shape) != 2 or min(shape) <= 0 or page <= 0 or page % FORMAT_ALIGN or off < 0
                        or off % FORMAT_ALIGN or pages <= 0 or off + pages * page > size):
                    raise CheckpointError(f"{self.rows_file}: row table {name!r} lies outside the file or is "
                                          "unaligned")
                self.row_tables[name] = (dtype, shape, off, page, pages)
        tok_files = m.get("tokenizer_files", [])
        if not isinstance(tok_files, list):
            raise CheckpointError(f"{mpath}: tokenizer_files must be a list of file names")
        self.tokenizer_files = [member_file(n, mpath, "tokenizer file name") for n in tok_files]

    def locate(self, name: str) -> str:
        """The location of member ``name`` (a bank file named by the manifest)."""
        return self.store.locate(name)

    def file(self, location: str) -> ByteSource:
        """The byte source of a member, by its location (``spine_file``, ``locate(bank)``)."""
        return self.sources.get(location)

    @property
    def direct_io(self) -> bool:
        return self.sources.direct_io

    def info(self, name: str) -> TensorInfo:
        t = self.tensors.get(name)
        if t is None:
            raise CheckpointError(f"{self.manifest_path}: tensor {name!r} is missing from the spine table")
        return t

    def read(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """One spine tensor; its whole group is read to check the group's CRC."""
        return self.read_tensors([name], {name: out} if out is not None else None)[name]

    def read_tensors(self, names: list[str], out: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Spine tensors, one pass per group: the group's bytes are read in chunks, CRC-checked, and
        each requested tensor is copied from the very bytes checked. Raises ``CheckpointError`` on
        a CRC mismatch (nothing returned) or a failed read."""
        result: dict[str, torch.Tensor] = {}
        by_group: dict[str, list[str]] = {}
        for name in names:
            info = self.info(name)
            t = (out or {}).get(name)
            result[name] = t if t is not None else torch.empty(info.shape, dtype=info.torch_dtype)
            by_group.setdefault(self.group_of[name], []).append(name)
        for g, members in by_group.items():
            self.read_group(g, {n: result[n] for n in members})
        return result

    def read_group(self, g: str, dest: dict[str, torch.Tensor]) -> None:
        off, n, stored = self.spine_groups[g]
        f = self.file(self.spine_file)
        spans = sorted((self.tensors[name].offset - off, self.tensors[name].nbytes,
                        memoryview(t.reshape(-1).view(torch.uint8).numpy())) for name, t in dest.items())
        a = f.alignment
        buf = AlignedBuffer(min(f.read_size, align_up(max(n, 1), a)))
        crc, pos = 0, 0
        while pos < n:
            want = min(buf.nbytes, n - pos)
            try:
                got = f.read_aligned(buf.view(0, align_up(want, a)), off + pos)
            except OSError as e:
                raise CheckpointError(f"{self.spine_file}: reading spine group {g!r} failed: {e}") from None
            if got < want:
                raise CheckpointError(f"{self.spine_file}: short read in spine group {g!r} at offset {off + pos} "
                                      "(file truncated or storage error)")
            chunk = buf.view(0, want)
            crc = crc32(chunk, crc)
            for start, length, mv in spans:  # the part of each tensor inside this chunk
                lo, hi = max(start, pos), min(start + length, pos + want)  # (not `a`: the alignment)
                if lo < hi:
                    mv[lo - start : hi - start] = chunk[lo - pos : hi - pos]
            pos += want
        if crc != stored:
            raise CheckpointError(
                f"{self.spine_file}: spine group {g!r} CRC mismatch (stored {stored:08x}, computed {crc:08x}): "
                "the spine is corrupt; convert the model again (sluice check lists all damage)")

    def close(self) -> None:
        self.sources.close()


def _obj(m: dict, key: str, where) -> dict:
    v = m.get(key)
    if not isinstance(v, dict):
        raise CheckpointError(f"{where}: '{key}' missing or not an object")
    return v


class ManifestNameError(CheckpointError):
    """A file name in a container manifest is not a plain name inside the container
    (a path separator, ``..``, an absolute path, a control character)."""


def member_file(v, where, what: str = "file name") -> str:
    """A file name from the manifest: a plain name inside the container directory (no separator,
    not ``.``/``..`` nor hidden, not absolute, no NUL or control character); ``ManifestNameError``."""
    if (not isinstance(v, str) or not v or "/" in v or "\\" in v or v.startswith(".")
            or any(ord(c) < 32 or ord(c) == 127 for c in v)):
        raise ManifestNameError(f"{where}: invalid {what} {shown(v)}: a container names only plain files "
                                "inside its directory (no path separators, no '..', not absolute); the manifest "
                                "is damaged or hostile")
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
