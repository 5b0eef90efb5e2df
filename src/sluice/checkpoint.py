"""Hugging Face checkpoint directories: config, safetensors tensor tables and byte spans.

Nothing here loads a whole checkpoint. Opening a directory parses ``config.json`` and the
JSON header of every safetensors shard, and keeps, for every tensor, its file, absolute
byte offset, length, dtype and shape. Tensors are then read by byte range on demand.
Everything read from disk is treated as untrusted: every offset, length and dtype is
checked, and errors name the file and tensor.

Files are reached only through the storage seam: the directory is a ``Store`` (metadata by
member name) and each shard a ``ByteSource`` from the checkpoint's ``Sources``; nothing here
knows which kind of storage holds them.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import CheckpointError
from .storage import jsonfile
from .storage.jsonfile import nesting
from .storage import ByteSource, LocalDir, ReadStats, Sources, Store, open_source, open_store

# safetensors dtype name -> (torch dtype, bytes per element)
DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F64": (torch.float64, 8),
    "F32": (torch.float32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "I64": (torch.int64, 8),
    "I32": (torch.int32, 4),
    "I16": (torch.int16, 2),
    "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1),
    "BOOL": (torch.bool, 1),
    "F8_E4M3": (torch.float8_e4m3fn, 1),
    "F8_E5M2": (torch.float8_e5m2, 1),
    "F8_E8M0": (torch.float8_e8m0fnu, 1),
}

DTYPE_NAMES = {v[0]: k for k, v in DTYPES.items()}

# As the reference implementation (the ``safetensors`` library): a header over 100 MB is refused
# before it is read. The format nests three deep ({name: {"shape": [..]}}); deeper JSON is
# refused before parsing, so a hostile header can neither recurse nor balloon in memory.
MAX_HEADER_BYTES = 100_000_000
MAX_HEADER_DEPTH = 3


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes are: ``file`` at absolute ``offset``, ``nbytes`` long."""

    name: str
    file: str
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype][0]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def read_safetensors_header(path: str | Path, reader: ByteSource | None = None) -> tuple[dict[str, TensorInfo], dict]:
    """Parse one safetensors file's header; returns (tensors, metadata).

    As strict as the reference implementation: the header length (at most 100 MB, inside the
    file), UTF-8 JSON starting with ``{`` and nested no deeper than the format needs, no
    duplicate names, every dtype and shape, and the tensors' byte ranges sorted by offset
    exactly tiling the data region (no gap, no overlap, nothing outside it or after it).
    ``reader``: the file's byte source (default: one opened on ``path``, buffered).
    """
    path = str(path)
    f = reader or open_source(path, direct=False)
    try:
        size = f.size
        if size < 8:
            raise CheckpointError(f"{path}: file is {size} bytes, too short to be safetensors (truncated or empty?)")
        (hlen,) = struct.unpack("<Q", f.pread(8, 0))
        if hlen > MAX_HEADER_BYTES:
            raise CheckpointError(
                f"{path}: safetensors header length {hlen} is impossible: headers are at most {MAX_HEADER_BYTES} "
                "bytes (corrupt or hostile file; re-download or re-save the checkpoint)")
        if hlen == 0 or 8 + hlen > size:
            raise CheckpointError(
                f"{path}: safetensors header length {hlen} is impossible for a file of {size} bytes "
                "(corrupt header or truncated file; re-download or re-save the checkpoint)"
            )
        raw = f.pread(hlen, 8)
        if len(raw) != hlen:
            raise CheckpointError(f"{path}: short read of the {hlen}-byte safetensors header (file truncated?)")
        if not raw.startswith(b"{"):
            raise CheckpointError(f"{path}: safetensors header is not valid JSON (it does not start with "
                                  "'{'); the file is corrupt")
        depth = nesting(raw)
        if depth > MAX_HEADER_DEPTH:
            raise CheckpointError(
                f"{path}: safetensors header nests JSON {depth} levels deep; the format needs {MAX_HEADER_DEPTH} "
                "(corrupt or hostile file)")
        try:
            header = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
        except _DuplicateKey as e:
            raise CheckpointError(
                f"{path}: safetensors header names {e.args[0]!r} twice; the file is corrupt") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: safetensors header is not valid JSON ({e}); the file is corrupt") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: safetensors header is not a JSON object; the file is corrupt")
        data_start = 8 + hlen
        data_size = size - data_start
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise CheckpointError(f"{path}: safetensors __metadata__ must map names to strings; the file is corrupt")
        tensors: dict[str, TensorInfo] = {}
        for name, entry in header.items():
            tensors[name] = _tensor_info(path, name, entry, data_start, data_size)
        _check_tiling(path, tensors, data_start, data_size)
        return tensors, metadata
    finally:
        if reader is None:
            f.close()


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def _check_tiling(path: str, tensors: dict[str, TensorInfo], data_start: int, data_size: int) -> None:
    """Sorted by offset, each tensor starts where the previous ends, and the last ends at the
    end of the file (the reference's rule): no gaps, no overlaps, no trailing bytes."""
    end = 0
    prev = None
    for t in sorted(tensors.values(), key=lambda t: (t.offset, t.offset + t.nbytes)):
        begin = t.offset - data_start
        if begin < end:
            raise CheckpointError(f"{path}: tensor {t.name!r} (bytes {begin}..{begin + t.nbytes} of the data) "
                                  f"overlaps tensor {prev!r}, which ends at {end}; the file is corrupt")
        if begin > end:
            raise CheckpointError(f"{path}: tensor {t.name!r} starts at data byte {begin}, leaving a gap after "
                                  f"byte {end}; the tensors must be contiguous (the file is corrupt)")
        end, prev = begin + t.nbytes, t.name
    if end != data_size:
        raise CheckpointError(f"{path}: the tensors end at data byte {end} but the data region holds {data_size} "
                              "bytes; the file is corrupt or was appended to")


def _tensor_info(path: str, name: str, entry, data_start: int, data_size: int) -> TensorInfo:
    if not isinstance(entry, dict):
        raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry")
    dtype = entry.get("dtype")
    shape = entry.get("shape")
    offsets = entry.get("data_offsets")
    if dtype not in DTYPES:
        raise CheckpointError(
            f"{path}: tensor {name!r} has unsupported dtype {dtype!r} (supported: {', '.join(DTYPES)})"
        )
    if not (isinstance(shape, list) and all(type(s) is int and s >= 0 for s in shape)):
        raise CheckpointError(f"{path}: tensor {name!r} has a malformed shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
        raise CheckpointError(f"{path}: tensor {name!r} has malformed data_offsets {offsets!r}")
    begin, end = offsets
    nbytes = math.prod(shape) * DTYPES[dtype][1]
    if not (0 <= begin <= end):
        raise CheckpointError(f"{path}: tensor {name!r} has data_offsets {offsets} out of order")
    if end > data_size:
        raise CheckpointError(
            f"{path}: tensor {name!r} ends at byte {data_start + end} but the file has only "
            f"{data_start + data_size} bytes: the file is truncated (re-download or re-save it)"
        )
    if end - begin != nbytes:
        raise CheckpointError(
            f"{path}: tensor {name!r} spans {end - begin} bytes but dtype {dtype} shape {shape} needs {nbytes}"
        )
    return TensorInfo(name, path, data_start + begin, nbytes, dtype, tuple(shape))


def read_json(store: Store, name: str, what: str | None = None) -> dict:
    """Member ``name`` of ``store`` as a JSON object; errors name it and say what it is."""
    path, what = store.locate(name), what or name
    try:
        # size-capped, depth-checked (storage/jsonfile.py)
        data = jsonfile.read_json(store, name, "" if what == name else what)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: {what} not found") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read {what} ({e.strerror or e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: {what} must be a JSON object")
    return data


class Checkpoint:
    """A Hugging Face model directory, opened lazily.

    ``path``: a directory path or an opened ``Store``. ``tensors`` maps every tensor name to
    its ``TensorInfo`` (``file`` is the shard's location, ``store.locate(shard)``); ``read``
    loads one tensor by byte range. ``direct`` and ``stats`` go to every byte source opened
    (``direct=None``: probe O_DIRECT); ``sources.wrap`` wraps them (fault injection).
    """

    def __init__(self, path: str | Path | Store, *, direct: bool | None = None, stats: ReadStats | None = None):
        self.store = store = path if isinstance(path, Store) else open_store(path)
        self.location = store.location
        self.path = Path(store.location) if isinstance(store, LocalDir) else store.location  # a URL stays a str
        if not store.is_directory():
            raise CheckpointError(f"{self.location}: not a directory (expected a Hugging Face model directory)")
        self.config = read_json(store, "config.json")
        gen = "generation_config.json"
        self.generation_config = read_json(store, gen) if store.exists(gen) else {}
        self.sources = Sources(direct=direct, stats=stats, store=store)
        self.stats, self.direct = self.sources.stats, direct
        self.tensors: dict[str, TensorInfo] = {}
        index, single = "model.safetensors.index.json", "model.safetensors"
        if store.exists(index):
            ipath = store.locate(index)
            idx = read_json(store, index)
            weight_map = idx.get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{ipath}: missing or empty 'weight_map'")
            shards = sorted(set(weight_map.values()))
            by_shard: dict[str, dict[str, TensorInfo]] = {}
            for shard in shards:
                if not isinstance(shard, str) or "/" in shard or shard.startswith("."):
                    raise CheckpointError(f"{ipath}: invalid shard file name {shard!r}")
                if not store.exists(shard):
                    raise CheckpointError(f"{store.locate(shard)}: shard listed in {index} is missing")
                by_shard[shard] = self._parse(shard)
            for name, shard in weight_map.items():
                if name not in by_shard[shard]:
                    raise CheckpointError(f"{store.locate(shard)}: tensor {name!r} listed in {index} "
                                          "is not in this shard")
                self.tensors[name] = by_shard[shard][name]
        elif store.exists(single):
            self.tensors = self._parse(single)
        else:
            raise CheckpointError(
                f"{self.location}: no model.safetensors or model.safetensors.index.json "
                "(Sluice reads safetensors checkpoints only)"
            )

    def _parse(self, shard: str) -> dict[str, TensorInfo]:
        path = self.store.locate(shard)
        return read_safetensors_header(path, self.file(path))[0]

    def file(self, location: str) -> ByteSource:
        """The byte source of a shard, by its location (``TensorInfo.file``)."""
        return self.sources.get(location)

    @property
    def direct_io(self) -> bool:
        return self.sources.direct_io

    def info(self, name: str) -> TensorInfo:
        t = self.tensors.get(name)
        if t is None:
            raise CheckpointError(f"{self.location}: tensor {name!r} is missing from the checkpoint")
        return t

    def read(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """Read tensor ``name`` into a new tensor (or ``out``, same dtype and numel)."""
        info = self.info(name)
        if out is None:
            out = torch.empty(info.shape, dtype=info.torch_dtype)
        if info.nbytes:
            dest = out.reshape(-1).view(torch.uint8).numpy()
            try:
                self.file(info.file).read_into(memoryview(dest), info.offset)
            except OSError as e:
                raise CheckpointError(f"{info.file}: reading tensor {name!r} failed: {e}") from None
        return out

    def read_tensors(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Several tensors (no checksums to check in a Hugging Face directory)."""
        return {name: self.read(name) for name in names}

    def close(self) -> None:
        self.sources.close()
