"""Where one expert's bytes are, and how they land in a cache slot.

An ``ExpertLayout`` is a short list of aligned reads (file, offset, length -> slot offset)
and the tensor views over the slot once the reads are done. The alignment is the byte
sources' own (``ByteSource.alignment``), passed in by the caller that has them. A container record is one
read; a Hugging Face expert is its gate/up/down tensors, merged into one read whenever
they are adjacent in the shard (which is how ``save_pretrained`` writes them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..storage import align_down, align_up


@dataclass(frozen=True)
class Read:
    file: str
    offset: int  # file offset, a multiple of the source's alignment
    length: int  # a multiple of the source's alignment
    slot_offset: int  # offset inside the slot, a multiple of the source's alignment
    need: int  # bytes of this read that hold tensor data (a shorter read is an error)


@dataclass(frozen=True)
class View:
    name: str
    slot_offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Span:
    """``nbytes`` of tensor data at absolute ``offset`` of ``file``."""

    name: str
    file: str
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ExpertLayout:
    reads: tuple[Read, ...]
    views: tuple[View, ...]
    slot_bytes: int
    # What ``quant.assemble`` needs to turn the bytes into weights, once per read:
    # quantized records: the weight format (a ``sluice.quant.FORMATS`` name) and each role's
    # (role, n, k); the views are then named "<role>.<part>". None: the views are the matrices
    # themselves (f32/bf16/f16, or FP8 "<role>" + "<role>_scale_inv"), bound by their dtype.
    format: str | None = None
    shapes: tuple[tuple[str, int, int], ...] = ()
    # the quantized weights are the model itself (a natively quantized checkpoint, or a container
    # that copied them): computed with fp32 activations, as the reference is (``quant.activations``)
    exact: bool = False
    block: tuple[int, int] | None = None  # FP8 records: the (rows, cols) weight block of the scales
    input_major: bool = False  # the model's experts are input-major (``ExpertSpec.input_major``)

    @property
    def read_bytes(self) -> int:
        return sum(r.length for r in self.reads)


def layout_from_spans(spans: list[Span], align: int, merge_gap: int = 64 << 10) -> ExpertLayout:
    """Reads covering ``spans``, their offsets, lengths and slot offsets multiples of ``align`` (the
    alignment the spans' byte sources ask for); spans of one file closer than ``merge_gap`` share a read."""
    by_file: dict[str, list[Span]] = {}
    for s in spans:
        by_file.setdefault(s.file, []).append(s)
    reads: list[Read] = []
    views: list[View] = []
    slot = 0
    for file in sorted(by_file):
        group = sorted(by_file[file], key=lambda s: s.offset)
        runs: list[list[Span]] = [[group[0]]]
        for s in group[1:]:
            last = runs[-1][-1]
            if s.offset - (last.offset + last.nbytes) <= merge_gap:
                runs[-1].append(s)
            else:
                runs.append([s])
        for run in runs:
            a0 = align_down(run[0].offset, align)
            a1 = align_up(max(s.offset + s.nbytes for s in run), align)
            end = max(s.offset + s.nbytes for s in run)
            reads.append(Read(file, a0, a1 - a0, slot, end - a0))
            for s in run:
                views.append(View(s.name, slot + s.offset - a0, s.dtype, s.shape))
            slot += a1 - a0
    return ExpertLayout(tuple(reads), tuple(views), slot)


__all__ = ["ExpertLayout", "Read", "Span", "View", "layout_from_spans"]
