"""Expert sources: where each (layer, expert) record is and how to read it.

``CheckpointExperts`` indexes routed experts inside the original Hugging Face safetensors
shards (no copy); ``ContainerExperts`` reads a packed container's banks, one record per
expert. The expert path sees only ``layout(layer, expert)`` and ``file(location)``, a
``ByteSource`` whose kind (local file, later a remote object) it never asks.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from ..checkpoint import DTYPE_NAMES, DTYPES, Checkpoint
from ..container import FORMAT_ALIGN, HEADER_BYTES, Container, check_record, member_file, parse_part
from ..errors import CheckpointError, ExpertReadError
from ..quant.fp8 import FORMAT as FP8_FORMAT
from ..quant.fp8 import SCALE_SUFFIX
from ..storage import AlignedBuffer, ByteSource
from .layout import ExpertLayout, Read, Span, View, layout_from_spans


from .spec import ExpertSpec, ExpertTensors


class ExpertSource:
    """Interface: ``layout``, ``file``, ``validate``, ``slot_bytes``, ``format``, ``record_bytes``."""

    format: str
    slot_bytes: int
    # True when quantized expert weights are the model itself (a natively quantized checkpoint,
    # or a container that copied them): computed with fp32 activations, as the reference does
    native_quant: bool = False

    def layout(self, layer: int, expert: int) -> ExpertLayout:
        raise NotImplementedError

    def validate(self, layer: int, expert: int, record: memoryview, verify_crc: bool) -> None:
        """Check a record just read (container headers, CRC); raise ``ExpertReadError``."""

    def read(self, layer: int, expert: int, buf: AlignedBuffer, base: int = 0,
             verify_crc: bool = False) -> ExpertLayout:
        """Read one expert into ``buf`` at ``base`` (aligned); raises ``ExpertReadError`` naming it."""
        layout = self.layout(layer, expert)
        for r in layout.reads:
            try:
                got = self.file(r.file).read_aligned(buf.view(base + r.slot_offset, r.length), r.offset)
            except OSError as e:
                raise ExpertReadError(
                    f"{r.file}: reading layer {layer} expert {expert} failed: {e.strerror or e}") from e
            if got < r.need:
                raise ExpertReadError(
                    f"{r.file}: short read for layer {layer} expert {expert}: got {got} of {r.need} bytes at "
                    f"offset {r.offset} (file truncated or storage error)"
                )
        self.validate(layer, expert, buf.view(base, layout.slot_bytes), verify_crc)
        return layout

    def file(self, location: str) -> ByteSource:
        raise NotImplementedError

    @property
    def direct_io(self) -> bool:
        raise NotImplementedError

    @property
    def record_bytes(self) -> int:
        """Bytes of weights one expert holds (without alignment slack)."""
        raise NotImplementedError


_FORMAT_OF_DTYPE = {"F32": "f32", "BF16": "bf16", "F16": "f16", "F8_E4M3": FP8_FORMAT}
_BLOCK_SCALED = ("F8_E4M3",)


class CheckpointExperts(ExpertSource):
    def __init__(self, ckpt: Checkpoint, layers: list[int], n_experts: int,
                 tensors: Callable[[int, int], ExpertTensors], format: str | None = None,
                 spec: ExpertSpec | None = None):
        """``format``: a quant format the checkpoint stores the expert matrices in natively (their
        roles named "<role>.<part>", read as they are, ``spec`` giving each role's [n, k]);
        None: plain f32/bf16/f16 matrices."""
        self.ckpt = ckpt
        self._layouts: dict[tuple[int, int], ExpertLayout] = {}
        dtypes: set[str] = set()
        part_dtypes: dict[str, dict[str, str]] = {}  # part -> dtype -> the first tensor with it
        payload = 0
        aligns: dict[str, int] = {}  # file -> its source's alignment

        def align(file: str) -> int:
            if file not in aligns:
                aligns[file] = ckpt.file(file).alignment
            return aligns[file]

        for layer in layers:
            for e in range(n_experts):
                spans = []
                refs = tensors(layer, e)
                for role, ref in refs.items():
                    info = ckpt.info(ref.name)
                    spans.append(self._span(role, ref, info))
                    if "." in role:  # a part of a natively quantized matrix ("gate_up.blocks")
                        part_dtypes.setdefault(role.split(".", 1)[1], {}).setdefault(info.dtype, ref.name)
                    elif not role.endswith(SCALE_SUFFIX):  # matrices and biases (not FP8 block scales)
                        dtypes.add(info.dtype)
                        if info.dtype in _BLOCK_SCALED and role + SCALE_SUFFIX not in refs:
                            raise CheckpointError(
                                f"{info.file}: expert tensor {ref.name!r} is {info.dtype} but config.json declares "
                                "no FP8 quantization (quantization_config) to read its scales with")
                self._layouts[(layer, e)] = layout_from_spans(spans, max((align(s.file) for s in spans), default=1))
                if not payload:
                    payload = sum(s.nbytes for s in spans)
        self._payload = payload
        if spec is not None:  # what assemble needs beside the bytes
            for key, lay in self._layouts.items():
                self._layouts[key] = replace(lay, block=spec.block, input_major=spec.input_major)
        if format is not None:
            self._native(format, dtypes, part_dtypes, spec)
            return
        if len(dtypes) > 1:
            raise CheckpointError(f"{ckpt.location}: routed experts mix dtypes {sorted(dtypes)}; expected one dtype")
        dtype = dtypes.pop() if dtypes else "F32"
        if dtype not in _FORMAT_OF_DTYPE:
            raise CheckpointError(
                f"{ckpt.location}: routed experts have dtype {dtype}; Sluice streams f32/bf16/f16 and block-scaled "
                "FP8 (e4m3) experts from Hugging Face checkpoints (convert other formats with `sluice convert`)"
            )
        self.format = _FORMAT_OF_DTYPE[dtype]
        self.slot_bytes = max((lay.slot_bytes for lay in self._layouts.values()), default=4096)

    def _native(self, format: str, dtypes: set[str], part_dtypes: dict[str, dict[str, str]], spec) -> None:
        from ..quant import FORMATS

        fmt = FORMATS.get(format)
        if fmt is None:
            raise CheckpointError(f"{self.ckpt.location}: experts stored as {format!r}, "
                                  "a format this build does not know")
        want = {part: DTYPE_NAMES[dt] for part, (dt, _) in fmt.parts(1, fmt.block).items()}
        for part, found in part_dtypes.items():
            if part not in want or set(found) != {want[part]}:
                odd = next((name for dt, name in found.items() if dt != want.get(part)), "")
                raise CheckpointError(
                    f"{self.ckpt.location}: {format} expert part {part!r} has dtype {sorted(found)} ({odd!r} is "
                    f"{next(dt for dt, name in found.items() if name == odd)}), the format stores "
                    f"{want.get(part, 'no such part')}")
        if len(dtypes) > 1 or not dtypes <= set(_FORMAT_OF_DTYPE):
            raise CheckpointError(f"{self.ckpt.location}: expert biases have dtypes {sorted(dtypes)}; expected one of "
                                  f"{', '.join(_FORMAT_OF_DTYPE)}")
        self.format = format
        self.native_quant = True
        known = spec.role_shapes()
        for key, lay in self._layouts.items():
            roles = sorted({v.name.split(".", 1)[0] for v in lay.views if "." in v.name})
            self._layouts[key] = replace(lay, format=format, shapes=tuple((r, *known[r]) for r in roles), exact=True)
        self.slot_bytes = max((lay.slot_bytes for lay in self._layouts.values()), default=4096)

    @staticmethod
    def _span(role: str, ref, info) -> Span:
        itemsize = DTYPES[info.dtype][1]
        shape = tuple(info.shape)
        offset = info.offset
        if ref.index is not None:
            if not shape or ref.index >= shape[0]:
                raise CheckpointError(f"{info.file}: tensor {ref.name!r} {list(shape)} has no expert {ref.index}")
            shape = shape[1:]
            offset += ref.index * math.prod(shape) * itemsize
        row_bytes = math.prod(shape[1:]) * itemsize if shape else itemsize
        want = tuple(ref.shape)
        if ref.row0 or (ref.index is not None and want != shape):
            if len(want) != len(shape) or want[1:] != shape[1:] or ref.row0 + want[0] > shape[0]:
                raise CheckpointError(
                    f"{info.file}: tensor {ref.name!r} slice {list(shape)} cannot hold rows "
                    f"{ref.row0}..{ref.row0 + want[0]} of shape {list(want)} implied by config.json"
                )
            offset += ref.row0 * row_bytes
        elif shape != want:
            raise CheckpointError(
                f"{info.file}: tensor {ref.name!r} has shape {list(shape)} but config.json implies {list(want)}"
            )
        nbytes = math.prod(want) * itemsize
        return Span(role, info.file, offset, nbytes, info.torch_dtype, want)

    def layout(self, layer: int, expert: int) -> ExpertLayout:
        return self._layouts[(layer, expert)]

    def file(self, location: str) -> ByteSource:
        return self.ckpt.file(location)

    @property
    def direct_io(self) -> bool:
        return self.ckpt.direct_io

    @property
    def record_bytes(self) -> int:
        return self._payload


class ContainerExperts(ExpertSource):
    """Experts of a container: one aligned read per expert, header checked on every read."""

    def __init__(self, container: Container, layers: list[int], n_experts: int, spec: ExpertSpec):
        """``spec``: the model's experts (each role's shape; the FP8 weight block and the
        input-major order that ``quant.assemble`` needs beside a record's bytes)."""
        self.container = container
        roles = spec.matrix_shapes()
        self.format = container.expert_format
        src = container.manifest.get("source")
        # quantized records copied bit for bit from a natively quantized checkpoint (not requantized)
        self.native_quant = isinstance(src, dict) and src.get("expert_dtype") == self.format \
            and self.format not in ("f32", "bf16", "f16")
        mpath = container.manifest_path
        banks = container.banks.get("layers")
        if not isinstance(banks, dict):
            raise CheckpointError(f"{mpath}: 'experts.layers' must be an object keyed by layer")
        self._banks: dict[int, tuple[str, int, tuple[View, ...], int]] = {}
        payload = 0
        for layer in layers:
            b = banks.get(str(layer))
            if not isinstance(b, dict):
                raise CheckpointError(f"{mpath}: no expert bank for MoE layer {layer}")
            fname = container.locate(member_file(b.get("file"), mpath))
            count, rec = b.get("count"), b.get("record_bytes")
            if count != n_experts:
                raise CheckpointError(f"{mpath}: layer {layer} bank holds {count!r} experts, config says {n_experts}")
            if not isinstance(rec, int) or rec <= HEADER_BYTES or rec % FORMAT_ALIGN:
                raise CheckpointError(f"{mpath}: layer {layer} record_bytes {rec!r} is not a positive multiple of "
                                      f"{FORMAT_ALIGN}")
            parts = [parse_part(p, mpath, layer) for p in b.get("parts") or []]
            end = max((p.offset + p.nbytes for p in parts), default=0)
            if end + HEADER_BYTES > rec:
                raise CheckpointError(f"{mpath}: layer {layer} parts end at {end} bytes, beyond the {rec}-byte record")
            names = {p.name for p in parts}
            for role, shape in roles.items():
                if role not in names and not any(n.startswith(role + ".") for n in names):
                    raise CheckpointError(f"{mpath}: layer {layer} records have no part for {role!r}")
                p = next((p for p in parts if p.name == role), None)
                if p is not None and p.shape != tuple(shape):
                    raise CheckpointError(
                        f"{mpath}: layer {layer} part {role!r} has shape {list(p.shape)}, config implies {list(shape)}"
                    )
            f = container.file(fname)
            if rec % f.alignment:
                raise CheckpointError(f"{fname}: {rec}-byte records cannot be read whole from a source that reads "
                                      f"in multiples of {f.alignment} bytes")
            if f.size < count * rec:
                raise CheckpointError(
                    f"{fname}: expert bank is {f.size} bytes, {count} records of {rec} bytes need {count * rec}: "
                    "the file is truncated (convert again)"
                )
            views = tuple(View(p.name, HEADER_BYTES + p.offset, DTYPES[p.dtype][0], p.shape) for p in parts)
            self._banks[layer] = (fname, rec, views, end)
            payload = end
        # the record's description for quant.assemble: dense and FP8 records hold the matrices by
        # role (FP8 with "<role>_scale_inv"), the other formats "<role>.<part>" views
        self._quant = dict(block=spec.block, input_major=spec.input_major)
        if self.format not in _FORMAT_OF_DTYPE.values():
            self._quant.update(format=self.format, shapes=tuple((r, *s) for r, s in roles.items()),
                               exact=self.native_quant)
        self.slot_bytes = max((b[1] for b in self._banks.values()), default=FORMAT_ALIGN)
        self._payload = payload
        self.crc_bytes = 0  # payload bytes CRC-checked so far, and the reader-thread seconds it took
        self.crc_s = 0.0
        self._crc_lock = threading.Lock()

    def layout(self, layer: int, expert: int) -> ExpertLayout:
        fname, rec, views, end = self._banks[layer]
        return ExpertLayout((Read(fname, expert * rec, rec, 0, HEADER_BYTES + end),), views, rec, **self._quant)

    def validate(self, layer: int, expert: int, record: memoryview, verify_crc: bool) -> None:
        fname, rec, views, end = self._banks[layer]
        t0 = time.thread_time() if verify_crc else 0.0
        check_record(f"{fname}: layer {layer} expert {expert}", record, self.format, layer, expert, end, verify_crc)
        if verify_crc:
            dt = time.thread_time() - t0
            with self._crc_lock:
                self.crc_bytes += end
                self.crc_s += dt

    def file(self, location: str) -> ByteSource:
        return self.container.file(location)

    @property
    def direct_io(self) -> bool:
        return self.container.direct_io

    @property
    def record_bytes(self) -> int:
        return self._payload

    def records(self):
        """(layer, expert) of every record, bank by bank (for ``sluice check``)."""
        for layer in sorted(self._banks):
            fname, rec, _, _ = self._banks[layer]
            for e in range(self.container.file(fname).size // rec):
                yield layer, e
