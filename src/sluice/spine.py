"""The spine in memory, or streamed layer by layer when it does not fit.

Global tensors (embeddings, head, final norm) and every 1-D tensor of a layer (norms,
biases, per-head scalars) are always resident. Every other tensor of a layer, *every
tensor of two or more dimensions* (projections, routers, conv kernels, block scales,
KDA's 4-D ``A_log``), is either resident or *streamed*, as the whole layer is: before the
layer runs they are read into one of a small ring of reusable buffers by a background
reader, which meanwhile fills the next buffer, so reading layer L+1 overlaps computing
layer L.

The layer objects of a streamed layer are built once, over views into "its" buffer
(streamed layer of rank r uses buffer r % n), so no tensor is allocated per layer or per
token: refilling a buffer changes what the views see. The rule for families and layers:
**never derive a tensor at build time from a tensor of two or more dimensions** (no
``.float()`` of a half-precision weight, no concatenation, no arithmetic, no
``.contiguous()`` copy); keep the tensor as given and derive inside the forward (views
such as ``.view``/``.reshape`` of a contiguous tensor are fine: they see every refill).
1-D tensors may be converted once at build time.

The rule is enforced by the test-only load option ``DebugOptions.poison_stream_buffers``: it fills
every stream buffer with 0xFF bytes (NaN in f32, bf16, f16 and FP8 e4m3) before the first
real fill, so anything derived at build time from a streamed tensor is NaN and the
streamed spine stops being bit-identical to the resident one (tests/test_contracts.py).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .storage import AlignedBuffer, align_up

TENSOR_ALIGN = 64


def layer_of(name: str) -> int | None:
    """The decoder layer a spine tensor belongs to, or None for global tensors."""
    parts = name.split(".")
    if "layers" in parts:
        i = parts.index("layers")
        if i + 1 < len(parts) and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def streamable(desc) -> dict[int, list[str]]:
    """Per layer, the spine matrices that may be streamed (2-D and larger; not the integer lookup
    tables, ``ModelDescription.tables``, read by token id before their layer runs)."""
    out: dict[int, list[str]] = {}
    tables = set(getattr(desc, "tables", ()))
    for name, shape in desc.spine.items():
        layer = layer_of(name)
        if layer is not None and len(shape) >= 2 and name not in tables:
            out.setdefault(layer, []).append(name)
    return out


@dataclass
class LayerReads:
    """How to fill a buffer with one layer's matrices: (file, file offset, length, buffer offset)."""

    layer: int
    reads: list[tuple[str, int, int, int]]
    views: dict[str, tuple[int, torch.dtype, tuple[int, ...]]]  # name -> (buffer offset, dtype, shape)
    nbytes: int  # bytes actually read per fill
    crc: tuple[int, int] | None = None  # a container group: (its byte length, its CRC32), checked per fill


@dataclass
class SpineStats:
    bytes_read: int = 0
    fills: int = 0
    wait_s: float = 0.0
    read_s: float = 0.0


def layer_reads(store, layer: int, names: list[str]) -> LayerReads:
    """A container stores a layer's spine as one aligned group: one read (its length rounded up to
    the spine source's alignment). Otherwise one read per tensor."""
    infos = [store.info(n) for n in names]
    groups = getattr(store, "spine_groups", {})
    group = groups.get(f"layer.{layer}")
    if group is not None:
        start, length, crc = group
        if all(i.file == store.spine_file and start <= i.offset and i.offset + i.nbytes <= start + length
               for i in infos):
            views = {i.name: (i.offset - start, i.torch_dtype, tuple(i.shape)) for i in infos}
            nbytes = align_up(length, store.file(store.spine_file).alignment)
            return LayerReads(layer, [(store.spine_file, start, nbytes, 0)], views, nbytes, (length, crc))
    reads, views, off = [], {}, 0
    for i in infos:
        off = align_up(off, TENSOR_ALIGN)
        reads.append((i.file, i.offset, i.nbytes, off))
        views[i.name] = (off, i.torch_dtype, tuple(i.shape))
        off += i.nbytes
    return LayerReads(layer, reads, views, sum(r[2] for r in reads))


def check_group_crc(plan: LayerReads, buf: AlignedBuffer, file: str) -> None:
    from .errors import CheckpointError
    from .storage.crc import crc32

    length, stored = plan.crc
    got = crc32(buf.view(0, length))
    if got != stored:
        raise CheckpointError(f"{file}: spine group 'layer.{plan.layer}' CRC mismatch when streamed (stored "
                              f"{stored:08x}, computed {got:08x}): the spine is corrupt; convert the model again")


def buffer_bytes(lr: LayerReads) -> int:
    """The stream buffer one layer needs (whole pages, as ``AlignedBuffer`` allocates them)."""
    return AlignedBuffer.size_for(max((r[3] + r[2] for r in lr.reads), default=0))


class SpineStreamer:
    """Double (or n-) buffered background reads of streamed layers' matrices."""

    def __init__(self, store, plans: list[LayerReads], n_buffers: int = 2, huge_pages: bool = True,
                 verify: bool = True, poison: bool = False):
        self.store = store
        self.verify = verify  # check a container group's CRC32 after each fill
        self.plans = plans
        self.rank = {p.layer: r for r, p in enumerate(plans)}
        self.n = max(1, min(n_buffers, len(plans)))
        size = max((buffer_bytes(p) for p in plans), default=AlignedBuffer.size_for(1))
        self.buffers = [AlignedBuffer(size, huge=huge_pages) for _ in range(self.n)]
        if poison:  # test-only: NaN bytes until the first real fill (see the module docstring)
            for buf in self.buffers:
                buf.tensor(0, torch.uint8, (buf.nbytes,)).fill_(0xFF)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sluice-spine")
        self.pending: list[Future | None] = [None] * self.n
        self.loaded: list[int | None] = [None] * self.n  # rank held by each buffer
        self.stats = SpineStats()

    @property
    def buffer_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    def views(self, layer: int) -> dict[str, torch.Tensor]:
        """Tensors of a streamed layer: views into its buffer (valid while the layer runs)."""
        buf = self.buffers[self.rank[layer] % self.n]
        views = self.plans[self.rank[layer]].views
        return {name: buf.tensor(off, dtype, shape) for name, (off, dtype, shape) in views.items()}

    def _fill(self, rank: int) -> None:
        t0 = time.perf_counter()
        plan, buf = self.plans[rank], self.buffers[rank % self.n]
        for file, offset, length, boff in plan.reads:
            f = self.store.file(file)
            a = f.alignment  # what the source's aligned reads need; anything else goes through read_into
            if offset % a == 0 and boff % a == 0 and length % a == 0:
                got = f.read_aligned(buf.view(boff, length), offset)
                if got < min(length, f.size - offset):
                    raise OSError(f"short read of layer {plan.layer}'s spine from {file}")
            else:
                f.read_into(buf.view(boff, length), offset)
        if self.verify and plan.crc is not None:
            check_group_crc(plan, buf, self.store.spine_file)
        self.stats.read_s += time.perf_counter() - t0
        self.stats.bytes_read += plan.nbytes
        self.stats.fills += 1

    def _issue(self, rank: int) -> None:
        slot = rank % self.n
        if self.loaded[slot] == rank and self.pending[slot] is not None:
            return
        self.loaded[slot] = rank
        self.pending[slot] = self.pool.submit(self._fill, rank)

    def start(self) -> None:
        """Begin reading the first streamed layers (called at the start of every forward)."""
        for r in range(self.n):
            self._issue(r)

    def acquire(self, layer: int) -> None:
        """Block until ``layer``'s matrices are in its buffer."""
        r = self.rank.get(layer)
        if r is None:
            return
        slot = r % self.n
        if self.loaded[slot] != r:
            self._issue(r)
        fut = self.pending[slot]
        t0 = time.perf_counter()
        try:
            fut.result()
        except BaseException:
            self.loaded[slot] = self.pending[slot] = None
            raise
        self.stats.wait_s += time.perf_counter() - t0

    def ready(self, layer: int) -> bool:
        """True if ``layer`` is resident or its buffer already holds it (no waiting)."""
        r = self.rank.get(layer)
        if r is None:
            return True
        slot = r % self.n
        return self.loaded[slot] == r and self.pending[slot] is not None and self.pending[slot].done()

    def release(self, layer: int) -> None:
        """``layer`` is done: refill its buffer with the streamed layer n ranks later (wrapping
        around to the next forward's first layers)."""
        r = self.rank.get(layer)
        if r is None:
            return
        self._issue((r + self.n) % len(self.plans))

    def read_bandwidth(self, seconds: float = 3.0) -> dict:
        """Fill the buffers with streamed layers back to back for ``seconds``, no compute: the
        read path's own bandwidth for this model's spine (benchmarks). Leaves no layer marked
        loaded, so the next forward reads what it needs again."""
        for fut in self.pending:
            if fut is not None:
                try:
                    fut.result()
                except BaseException:
                    pass
        before, fills = self.stats.bytes_read, 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            self._fill(fills % len(self.plans))
            fills += 1
        dt = time.perf_counter() - t0
        nbytes = self.stats.bytes_read - before
        self.stats.bytes_read, self.stats.fills = before, self.stats.fills - fills  # not the model's reads
        self.loaded = [None] * self.n
        self.pending = [None] * self.n
        return {"bytes_per_s": nbytes / dt, "fills": fills, "seconds": dt}

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
