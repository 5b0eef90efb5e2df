"""The public engine: load a model under a memory budget, run forwards, generate tokens.

``load()`` opens a Hugging Face directory (or a packed container), plans memory, loads the
spine and wires the family's layers to the expert interface (``ExpertProvider`` here, or
``RayExperts`` with ``ray``). ``Engine.stream()`` submits a generation to the scheduler
(``scheduler.py``), which runs every running generation in each step of the model runner
(``runner.py``), from any number of threads; ``generate()``, the CLI and the server are built
on it.
"""

from __future__ import annotations

import inspect
import os
import sys
import threading
import time
import warnings
from collections.abc import Iterator

import torch

from . import validate
from .kernels.backend import cpu
from .checkpoint import Checkpoint
from .container import Container, is_container
from .errors import CheckpointError, InvalidArgumentError, SluiceError
from .cluster.connect import connect as connect_cluster
from .cluster.model import signature as cluster_signature
from .cluster.provider import RayExperts
from .experts.cache import ExpertCache
from .experts.lookahead import Lookahead, PrefetchOptions
from .experts.policy_spec import make_policy
from .experts.provider import ExpertProvider
from .experts.source import CheckpointExperts, ContainerExperts
from .generation import Request, Result, Step
from .layers.attention import SCORE_BLOCK_BYTES
from .layers.sampling import SamplingParams
from .models import get_family
from .models import quantized_spine
from .models.base import MoEBlock, check_tensor
from .models.config import check_layer_count, eos_ids
from .options import DEFAULT_MAX_CONTEXT, DebugOptions, Options
from .plan import Plan, activation_bytes, below_working_set_warning, make_plan, rows_for
from .progress import Activity, Progress
from .resolve import resolve_model
from .rows import RowStore, RowTable, row_table
from .rows.table import paged_table
from .runner import ModelRunner, SeqState
from .scheduler import Scheduler
from .spine import LayerReads, SpineStreamer, layer_reads, streamable
from .spine import buffer_bytes as spine_buffer_bytes
from .stats import EngineCounters, EngineInfo, GenerationStats
from .storage import is_url, open_store
from .storage.disk_tier import open_tier
from .storage.urls import mask
from .sysmem import current_rss, default_budget
from .tokenizer import Tokenizer, has_tokenizer
from . import prompt_fit
from .outputs import model_inputs
from .trace import TraceWriter
from .units import parse_size


def load(path: str | os.PathLike, memory: int | str | None = None, *, revision: str | None = None,
         **options) -> "Engine":
    """Open a model under a memory budget (``"8GiB"``, bytes, or None for a safe default).

    ``path`` is a model directory, a container, an ``s3://`` or ``http(s)://`` URL of either,
    ``"demo"`` or a repo id in the local Hugging Face cache (at ``revision``, default main); see
    ``sluice.resolve``.
    """
    validate.model_path(path)
    validate.options(options, Options.__dataclass_fields__)
    if memory is not None:
        validate.warn_if_over_machine(parse_size(memory, "memory"))
    return Engine(path, memory, Options(**options), revision=revision)


SPINE_DTYPES = ("F32", "BF16", "F16")
FP8_SCALES = ("_scale_inv", "_scale")  # block FP8's weight_scale_inv, compressed-tensors' weight_scale


TABLE_DTYPES = ("I64", "I32")  # integer lookup tables (``ModelDescription.tables``)


def _scales_of(weight: str) -> list[str]:
    """Where FP8 weight ``weight``'s scales may be: ``_scale_inv`` / ``_scale`` after it, or
    DeepSeek-V4's ``<module>.scale``."""
    out = [weight + s for s in FP8_SCALES]
    return out + [weight[: -len(".weight")] + ".scale"] if weight.endswith(".weight") else out


def _weights_of(scale: str) -> list[str]:
    """The weights whose scales ``scale`` may be (the inverse of ``_scales_of``)."""
    out = [scale[: -len(s)] for s in FP8_SCALES if scale.endswith(s)]
    return out + [scale[: -len(".scale")] + ".weight"] if scale.endswith(".scale") else out


def check_spine_dtype(name: str, info, spine: dict, tables=()) -> None:
    """Spine tensors are float32/bfloat16/float16; FP8 (e4m3) only for a weight whose scales
    (``_scale_inv``, ``_scale`` or ``<module>.scale``) the family reads too, and e8m0 only for those
    scales; the family's integer ``tables`` I64 / I32 (and nothing else)."""
    if name in tables:
        if info.dtype in TABLE_DTYPES:
            return
        raise CheckpointError(f"{info.file}: tensor {name!r} is a lookup table of expert ids, stored as "
                              f"{info.dtype}; expected integers ({' or '.join(TABLE_DTYPES)})")
    if info.dtype in SPINE_DTYPES or (info.dtype == "F8_E4M3" and any(s in spine for s in _scales_of(name))):
        return
    if info.dtype == "F8_E8M0" and any(name in _scales_of(w) for w in _weights_of(name) if w in spine):
        return  # power-of-two block scales (DeepSeek-V4's ue8m0) of an FP8 weight the family reads
    if info.dtype == "F8_E4M3":
        raise CheckpointError(
            f"{info.file}: spine tensor {name!r} is F8_E4M3, but config.json declares no FP8 quantization for "
            "it (quantization_config / modules_to_not_convert / ignore)")
    raise CheckpointError(
        f"{info.file}: spine tensor {name!r} is stored as {info.dtype}; Sluice computes with spine tensors "
        f"in {', '.join(SPINE_DTYPES)} (and block-scaled F8_E4M3 weights with their scales): re-save the "
        "checkpoint in a float dtype")


class ModelInfo:
    """An opened, validated model directory: config, family, tensor tables. Nothing loaded yet."""

    def __init__(self, path: str | os.PathLike, options: Options | None = None, *, revision: str | None = None):
        """``options``: the load options that opening reads (``direct_io``, ``ca_bundle``,
        ``allow_unversioned_remote``, ``disk_cache``, ``disk_cache_dir``, ``progress``); None: the
        defaults, without progress lines."""
        o = options if options is not None else Options(progress=False)
        direct_io, ca_bundle, disk_cache, disk_cache_dir = o.direct_io, o.ca_bundle, o.disk_cache, o.disk_cache_dir
        if disk_cache_dir is not None and disk_cache is None:
            raise InvalidArgumentError("disk_cache_dir (--disk-cache-dir) needs disk_cache (--disk-cache SIZE): "
                                       "there is no disk tier without a size")
        self.path, self.model_id = resolve_model(path, revision)  # a local Path or a URL (str)
        remote = {"ca_bundle": os.fspath(ca_bundle)} if ca_bundle else {}
        if o.allow_unversioned_remote:
            remote["allow_unversioned"] = True
        # memory -> disk tier -> remote store: only a model at a URL has one (a local file needs none)
        self.disk_tier = open_tier(disk_cache, disk_cache_dir) if disk_cache is not None and is_url(self.path) else None
        if self.disk_tier is not None:
            remote["disk_tier"] = self.disk_tier
        # a remote model's metadata requests (config, index, headers, tokenizer), shown on a terminal
        self.meta_progress = Activity(f"{mask(str(self.path))}: metadata", enabled=o.progress and is_url(self.path))
        try:
            self.store = store = open_store(self.path, progress=self.meta_progress, **remote)
            self.is_container = is_container(store)
            if self.is_container:
                self.checkpoint = Container(store, direct=direct_io)
            else:
                self.checkpoint = Checkpoint(store, direct=direct_io)
        except BaseException as e:
            self.close()
            if isinstance(e, OSError) and not isinstance(e, SluiceError):
                # a remote store that cannot be reached, listed or authenticated to
                raise CheckpointError(mask(f"{self.path}: cannot open the model: {e}")) from None
            raise
        self.raw_config = self.checkpoint.config
        self.family = get_family(self.raw_config.get("model_type"))
        self.config = self.family.parse_config(self.raw_config)
        wrapped = isinstance(self.raw_config.get("text_config"), dict)  # a multimodal wrapper's text model
        check_layer_count(self.config.num_hidden_layers, self.checkpoint.tensors, getattr(self.config, "mtp_layers", 0),
                          "config.json text_config" if wrapped else "config.json")
        self.desc = self.family.describe(self.config)
        aliases = getattr(self.family, "tensor_aliases", None)
        if aliases is not None:  # a tensor some checkpoints store under another name
            tensors = self.checkpoint.tensors
            for name, alt in aliases(self.config).items():
                if name not in tensors and alt in tensors:
                    tensors[name] = tensors[alt]
        # spine matrices a container stores in a weight format (an int8 spine): name -> format
        self.spine_quant: dict[str, str] = dict(getattr(self.checkpoint, "spine_quant", {}))
        for name in self.spine_quant:
            if name not in self.desc.spine:
                raise CheckpointError(f"{self.checkpoint.manifest_path}: {name!r} is stored quantized but is not "
                                      "a spine tensor of this model")
        for name, shape in self.desc.spine.items():
            info = self.checkpoint.info(name)
            if name in self.spine_quant:
                quantized_spine.check(name, self.spine_quant[name], shape, self.checkpoint.tensors,
                                      self.checkpoint.manifest_path)
                continue
            check_tensor(name, info, shape)
            check_spine_dtype(name, info, self.desc.spine, self.desc.tables)
        # tables read by row (rows/): where each row's bytes are; refused by name if absent or mis-shaped
        self.row_tables = {name: self._row_table(name, rows, dim) for name, (rows, dim) in self.desc.row_tables.items()}
        check_rows = getattr(self.family, "check_row_tables", None)
        if check_rows is not None and self.row_tables:
            check_rows(self.config, self.checkpoint)
        if self.is_container:
            self.experts = ContainerExperts(self.checkpoint, self.desc.moe_layers, self.desc.n_experts,
                                            self.desc.expert)
        else:
            self.experts = CheckpointExperts(self.checkpoint, self.desc.moe_layers, self.desc.n_experts,
                                             self.desc.expert_tensors, self.desc.expert_format, self.desc.expert)
        self.tokenizer: Tokenizer | None = None
        if has_tokenizer(store):
            self.tokenizer = Tokenizer(store)
        self.meta_progress.close()
        self.eos_token_ids = eos_ids(self.raw_config, self.checkpoint.generation_config)
        if not self.eos_token_ids and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.append(self.tokenizer.eos_token_id)

    def _row_table(self, name: str, rows: int, dim: int) -> RowTable:
        """Where table ``name``'s rows are: a container's pages, or a directory's safetensors pieces."""
        if not self.is_container:
            return row_table(self.checkpoint.tensors, name, rows, dim)
        entry = self.checkpoint.row_tables.get(name)
        if entry is None:
            raise CheckpointError(f"{self.checkpoint.manifest_path}: row table {name!r} is missing from the rows table")
        dtype, shape, off, page, pages = entry
        if shape != [rows, dim]:
            raise CheckpointError(f"{self.checkpoint.manifest_path}: row table {name!r} has shape {shape}, config.json "
                                  f"implies {[rows, dim]}")
        t = paged_table(name, rows, dim, dtype, self.checkpoint.rows_file, off, page)
        if t.pages != pages:
            raise CheckpointError(f"{self.checkpoint.manifest_path}: row table {name!r} lists {pages} pages, its rows "
                                  f"fill {t.pages}")
        return t

    @property
    def spine_format(self) -> str:
        """How the spine's matrices are stored: "stored" (as the checkpoint has them) or a
        format of ``quantized_spine.SPINE_FORMATS`` (lossy: ``convert --spine``)."""
        return next(iter(self.spine_quant.values()), "stored")

    @property
    def expert_loss(self) -> str | None:
        """How the experts differ from the source checkpoint's (a container that ``sluice convert``
        quantized or narrowed), or None when they are its own weights (``lossy.py``)."""
        from .lossy import container_expert_loss

        return container_expert_loss(self.checkpoint) if self.is_container else None

    def spine_tensor_bytes(self, name: str) -> int:
        """Bytes spine tensor ``name`` takes as stored (every part of a quantized one)."""
        return quantized_spine.nbytes(name, self.spine_quant, self.checkpoint.tensors)

    def close(self) -> None:
        """Close the model's files and its disk tier (writing the tier's pending bookkeeping)."""
        meta = getattr(self, "meta_progress", None)
        if meta is not None:
            meta.close()  # a model that failed to open: end the progress line
        ckpt = getattr(self, "checkpoint", None)
        if ckpt is not None:
            ckpt.close()
        if self.disk_tier is not None:
            self.disk_tier.close()

    def spine_bytes(self) -> int:
        """Bytes the whole spine takes resident: stored tensors plus fp32 copies of 1-D ones (norms)."""
        glob, layers = self.spine_split()
        return glob + sum(layers.values())

    def spine_split(self) -> tuple[int, dict[int, int]]:
        """(bytes always resident, {layer: bytes of its streamable matrices})."""
        movable = streamable(self.desc)
        names = {n for v in movable.values() for n in v}
        glob = 0
        for name in self.desc.spine:
            if name not in names:
                info = self.checkpoint.info(name)
                glob += self.spine_tensor_bytes(name) + (info.numel * 4 if len(info.shape) == 1 else 0)
        layers = {i: sum(self.spine_tensor_bytes(n) for n in v) for i, v in movable.items()}
        return glob, layers

    def layer_reads(self) -> dict[int, LayerReads]:
        return {i: layer_reads(self.checkpoint, i, quantized_spine.stored_names(names, self.spine_quant))
                for i, names in streamable(self.desc).items()}

    def param_counts(self) -> tuple[int, int]:
        """(total parameters, parameters active per token)."""
        spine = sum(quantized_spine.numel(n, self.desc) for n in self.desc.spine)
        per_expert = self.desc.expert.param_count() if self.desc.moe_layers else 0
        return spine + per_expert * self.desc.total_experts, spine + per_expert * self.desc.working_set

    def plan(self, memory: int | str | None, options: Options, baseline: int | None = None) -> Plan:
        """The memory plan of ``memory`` for ``options.parallel`` sequences (None: the default rule);
        with row tables, they are resident when they fit in a tenth of the budget above the floor
        (``plan.rows_for``), else a row cache (``options.row_cache``, or that tenth)."""
        args = self.plan_args(memory, options, baseline)
        if not self.row_tables:
            return make_plan(parallel=options.parallel, **args)
        tables = sum(t.nbytes for t in self.row_tables.values())
        one_each = sum(t.row_bytes for t in self.row_tables.values())
        floor = make_plan(parallel=options.parallel, **{**args, "budget": 1 << 50}).floor
        cache = parse_size(options.row_cache, "row_cache") if options.row_cache is not None else None
        resident, nbytes = rows_for(tables, one_each, args["budget"], floor, cache)
        plan = make_plan(parallel=options.parallel, row_bytes=nbytes, **args)
        # the floors say what runs at all: with the smallest row store (one row per table)
        least = make_plan(parallel=options.parallel, row_bytes=one_each, **{**args, "budget": 1 << 50})
        plan.floor, plan.floor_resident = least.floor, least.floor_resident
        plan.rows_resident, plan.row_table_bytes = resident, tables
        return plan

    def plan_args(self, memory: int | str | None, options: Options, baseline: int | None = None) -> dict:
        """``make_plan``'s arguments but ``parallel`` (one sequence's state in ``state_bytes``)."""
        limit = self.desc.max_position_embeddings
        max_ctx = options.max_context or min(limit, DEFAULT_MAX_CONTEXT)
        if max_ctx > limit:
            raise InvalidArgumentError(f"max_context (--max-context) {max_ctx} exceeds the model's limit of {limit} "
                                       "positions")
        budget = parse_size(memory, "memory") if memory is not None else default_budget()
        chunk = max(1, min(options.prefill_chunk, max_ctx))
        # with --ray the experts live on the workers: this process plans no expert cache
        here = not options.ray
        ffn = max(self.desc.expert.intermediate, getattr(self.config, "intermediate_size", 0) or 0)
        glob, layers = self.spine_split()
        reads = self.layer_reads()
        # a remote read holds its response body until it is copied into the slot: one per reader
        # thread and one for the spine stream (0 for local files, read straight into the buffers)
        transfer = (options.reader_threads + 1) * self.checkpoint.sources.transfer_bytes

        def acts(c: int) -> int:  # a prefill chunk's buffers (the planner shrinks the chunk to fit a small cache)
            return activation_bytes(self.desc.hidden, ffn, self.desc.vocab, c, self.desc.attn_heads, max_ctx,
                                    score_block=SCORE_BLOCK_BYTES) + transfer

        return dict(
            budget=budget, baseline=current_rss() if baseline is None else baseline,
            spine_global=glob, spine_layers=layers,
            stream_buffer=max((spine_buffer_bytes(r) for r in reads.values()), default=0),
            state_bytes=self.desc.state_bytes(max_ctx),
            activations=acts(chunk), activations_for=acts, layer_experts=self.desc.n_experts,
            # the floor holds the lookahead's reads in flight: top-k per layer it predicts ahead
            lookahead_slots=(self.desc.top_k * max(options.prefetch.depth, options.prefetch.max_depth)
                             if here and options.prefetch.enabled else 0),
            slot_bytes=self.experts.slot_bytes, working_set=self.desc.working_set if here else 0,
            total_experts=self.desc.total_experts, top_k=self.desc.top_k if here else 0, max_context=max_ctx,
            prefill_chunk=chunk, cache_experts=options.cache_experts if here else 0,
            max_resident_layers=options.max_resident_layers,
        )


class Engine:
    def __init__(self, path: str | os.PathLike, memory: int | str | None, options: Options,
                 revision: str | None = None):
        t_load = time.perf_counter()
        self.options = options
        baseline = current_rss()
        self.threads = options.threads or os.cpu_count() or 1
        cpu.set_threads(self.threads)
        self.info = info = ModelInfo(path, options, revision=revision)
        try:
            self._build(info, memory, options, baseline, t_load)
        except BaseException:  # a budget too small, an interrupt: what was opened is closed (the tier too)
            self.close()
            raise

    def _build(self, info: ModelInfo, memory, options: Options, baseline: int, t_load: float) -> None:
        self.path, self.model_id = info.path, info.model_id  # model_id: what a server reports
        self.checkpoint, self.raw_config, self.family = info.checkpoint, info.raw_config, info.family
        self.config, self.desc, self.experts_source = info.config, info.desc, info.experts
        self.tokenizer, self.eos_token_ids = info.tokenizer, info.eos_token_ids
        self.plan: Plan = info.plan(memory, options, baseline)
        if (note := below_working_set_warning(self.plan)) is not None:
            warnings.warn(note, stacklevel=3)  # once per load: the cache cannot keep experts across tokens
        self.spine: SpineStreamer | None = None
        spine = self._load_spine()
        if options.ray:
            self.cache = None  # the driver holds no expert cache
            self.experts = self._start_workers()
        else:
            self.cache = ExpertCache(self.plan.cache_slots, self.experts_source.slot_bytes,
                                     make_policy(options.cache_policy), huge_pages=options.huge_pages)
            self.experts = ExpertProvider(self.experts_source, self.cache, self.desc.expert, self.desc.n_experts,
                                          reader_threads=options.reader_threads, verify_reads=options.verify_reads,
                                          total_experts=self.desc.total_experts)
        if info.spine_format != "stored":
            warnings.warn(f"{info.path}: the spine is stored as {info.spine_format} (sluice convert --spine "
                          f"{info.spine_format}): lossy, outputs differ from the model's", stacklevel=3)
        self.model = self.family.build(self.config, spine.__getitem__, self.experts)
        self.model.spine = self.spine
        self.rows: RowStore | None = None
        if info.row_tables:  # token-keyed tables: resident or read by row on the experts' reader pool
            pool = getattr(self.experts, "pool", None)
            self.rows = RowStore(info.row_tables, self.checkpoint.file, resident=self.plan.rows_resident,
                                 cache_bytes=self.plan.row_bytes, pool=pool, verify=options.verify_reads)
            self.model.attach_rows(self.rows)
        del spine
        # the router lookahead (the expert side's): prefetch, and the predictions a routing trace records
        self.lookahead = (Lookahead(self.experts, self.model, options.prefetch, certain=options.certain_reads)
                          if options.prefetch.enabled or options.trace_routing else None)
        self.set_lossy(moe_top_k=options.moe_top_k, prefer_cached=options.prefer_cached)
        # the routing trace never overwrites a model file
        self.trace = (TraceWriter(options.trace_routing, model_inputs(getattr(self.checkpoint, "store", None)))
                      if options.trace_routing else None)
        # the generator and the server reach the model only through the runner
        self.runner = ModelRunner(self.model, self.experts, self.checkpoint, self.spine,
                                  max_context=self.plan.max_context, prefill_chunk=self.plan.prefill_chunk,
                                  threads=self.threads, tokenizer=self.tokenizer, eos_token_ids=self.eos_token_ids,
                                  moe_layers=self.desc.moe_layers, trace=self.trace, info=self._info,
                                  slots=self.plan.parallel, lookahead=self.lookahead,
                                  certain_reads=options.certain_reads)
        # every generation runs as a sequence of the scheduler, on one of the runner's state slots
        self.scheduler = Scheduler(self.runner, step_tokens=self.plan.prefill_chunk)
        self.load_s = time.perf_counter() - t_load
        self.last_stats: GenerationStats | dict = {}

    # -- loading -----------------------------------------------------------------------------

    def _load_spine(self) -> dict[str, torch.Tensor]:
        """Resident spine tensors, plus views into the stream buffers for streamed layers."""
        out: dict[str, torch.Tensor] = {}
        streamed = set(self.plan.streamed_layers)
        if streamed:
            reads = self.info.layer_reads()
            self.spine = SpineStreamer(self.checkpoint, [reads[i] for i in sorted(streamed)],
                                       huge_pages=self.options.huge_pages, verify=self.options.verify_reads,
                                       poison=self.options.debug.poison_stream_buffers)
            for i in sorted(streamed):
                out.update(self.spine.views(i))
        names = [n for n in quantized_spine.stored_names(list(self.desc.spine), self.info.spine_quant)
                 if n not in out]
        total = sum(self.checkpoint.info(n).nbytes for n in names)
        bar = Progress(total, "loading spine", enabled=self.options.progress and total > (64 << 20))
        # per group: a container checks each spine group's CRC over the very bytes it loads
        batches: dict[str, list[str]] = {}
        group_of = getattr(self.checkpoint, "group_of", {})
        for n in names:
            batches.setdefault(group_of.get(n, n), []).append(n)
        for batch in batches.values():
            out.update(self.checkpoint.read_tensors(batch))
            bar.update(sum(self.checkpoint.info(n).nbytes for n in batch))
        bar.close()
        return quantized_spine.assemble(out, self.info.spine_quant, self.desc)

    def _start_workers(self) -> RayExperts:
        """Experts on a Ray cluster (``--ray``): connect, start the workers, check their signatures."""
        o = self.options
        if o.prefer_cached:
            raise InvalidArgumentError("prefer_cached (--prefer-cached) needs the expert cache in this process; "
                                       "it cannot be used with --ray")
        if o.expert_workers is not None and (not isinstance(o.expert_workers, int) or o.expert_workers < 1):
            raise InvalidArgumentError("expert_workers (--expert-workers) must be at least 1, "
                                       f"got {o.expert_workers!r}")
        validate.number(o.replicate_hot, "replicate_hot (--replicate-hot)", lo=0)
        worker_memory = parse_size(o.worker_memory, "worker_memory") if o.worker_memory is not None else None
        note = connect_cluster(o.ray, timeout=float(o.ray_timeout))
        location = self.path if isinstance(self.path, str) else os.fspath(self.path.resolve())
        experts = RayExperts(
            location, cluster_signature(self.checkpoint), self.desc.moe_layers, self.desc.n_experts,
            workers=o.expert_workers, worker_memory=worker_memory, replicate_hot=int(o.replicate_hot),
            timeout=float(o.ray_timeout), compiled=o.ray_compiled,
            worker_opts=dict(reader_threads=o.reader_threads, cache_policy=o.cache_policy,
                             verify_reads=o.verify_reads, huge_pages=o.huge_pages, direct_io=o.direct_io,
                             ca_bundle=o.ca_bundle, allow_unversioned_remote=o.allow_unversioned_remote,
                             cache_experts=o.cache_experts,
                             max_rows=self.plan.prefill_chunk * self.desc.top_k))
        self.cluster_note = f"{note}: {experts.describe()}"
        if o.progress:
            print(self.cluster_note, file=sys.stderr)
        return experts

    def close(self) -> None:
        """Stop the engine's threads and close its files and disk tier; a second call does nothing (so
        does a part that a failed load never made)."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        for part in ("scheduler", "trace", "spine", "rows", "experts", "info"):
            obj = getattr(self, part, None)
            if obj is not None:
                obj.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def set_lossy(self, moe_top_k: int | None = None, prefer_cached: float = 0.0, warn: bool = True) -> None:
        """Opt-in lossy routing switches (outputs then differ from the model's; a warning says so).

        ``moe_top_k``: route each token to only this many experts. ``prefer_cached``: add this
        bias to the router scores of experts already in memory when selecting.
        """
        if moe_top_k is not None and not 1 <= moe_top_k <= self.desc.top_k:
            raise InvalidArgumentError(f"moe_top_k (--moe-top-k) must be between 1 and the model's {self.desc.top_k}, "
                                       f"got {moe_top_k!r}")
        validate.number(prefer_cached, "prefer_cached (--prefer-cached)", lo=0.0)
        if prefer_cached and self.options.ray:
            raise InvalidArgumentError("prefer_cached (--prefer-cached) needs the expert cache in this process; "
                                       "it cannot be used with --ray")
        if moe_top_k == self.desc.top_k:
            moe_top_k = None  # the model's own top-k: exact, nothing lossy
        for layer in self.model.layers:
            if isinstance(layer.mlp, MoEBlock):
                layer.mlp.top_k = moe_top_k
                layer.mlp.prefer_cached = prefer_cached
        routing = {k: v for k, v in (("moe_top_k", moe_top_k), ("prefer_cached", prefer_cached)) if v}
        spine = self.info.spine_format
        experts = self.info.expert_loss
        self.lossy = {**routing, **({"spine": spine} if spine != "stored" else {}),
                      **({"experts": self.experts_source.format} if experts else {})}  # every result's stats say so
        if routing and warn:
            warnings.warn(f"lossy routing enabled ({routing}): outputs differ from the model's", stacklevel=2)

    # -- model access ------------------------------------------------------------------------

    def _info(self) -> EngineInfo:
        """What every generation's stats report about this engine."""
        plan = self.plan
        # with --ray: the workers' slots together (the driver itself holds none)
        slots = getattr(self.experts, "pooled_slots", plan.cache_slots)
        return EngineInfo(budget_bytes=plan.budget, cache_slots=slots, total_experts=plan.total_experts,
                          direct_io=self.experts_source.direct_io, load_s=self.load_s, lossy=dict(self.lossy),
                          spine_resident_bytes=plan.spine_bytes - plan.stream_buffer_bytes,
                          spine_streamed_layers=len(plan.streamed_layers))

    def totals(self) -> EngineCounters:
        """The engine's counters since load (expert lookups and reads, bytes read, forwards): a read
        shared by several generations counts once here, in full in each one's stats."""
        return self.runner.counters()

    @property
    def parallel(self) -> int:
        """Sequences that run at once (``--parallel``; more wait for a state slot)."""
        return self.plan.parallel

    @property
    def slot(self) -> SeqState:
        """The state slot the most recent generation ran on (slot 0 before any)."""
        return self.scheduler.last_slot

    @property
    def state(self):
        """The model state of ``slot`` (KV caches, recurrent states, the tokens they hold)."""
        return self.slot.model_state

    @property
    def max_context(self) -> int:
        return self.slot.max_context

    def _run(self, ids: list[int], start: int, last_n: int = 1) -> torch.Tensor | None:
        """Forward ``ids`` at positions start.. on ``slot``; logits [last_n, V] of the last positions
        (for tests, with no generation running)."""
        return self.runner.run(self.slot, ids, start, last_n)

    def forward(self, input_ids) -> torch.Tensor:
        """fp32 logits [T, V] for every position of a 1-D token sequence, from an empty cache."""
        ids = validate.token_ids(input_ids.tolist() if torch.is_tensor(input_ids) else input_ids, "input_ids")
        if not ids:
            raise InvalidArgumentError("input_ids is empty")
        if len(ids) > self.max_context:
            raise InvalidArgumentError(f"input_ids: {len(ids)} tokens exceed max_context {self.max_context}")
        self._check_ids(ids)

        def run(slot: SeqState) -> torch.Tensor:
            slot.rewind(0)
            return self.runner.run(slot, ids, 0, last_n=len(ids))

        return self.scheduler.exclusive(run)  # on an idle slot, between two steps of running generations

    def _check_ids(self, ids: list[int]) -> None:
        v = self.desc.vocab
        bad = [i for i in ids if not 0 <= i < v]
        if bad:
            raise InvalidArgumentError(f"token id {bad[0]} is outside the vocabulary (0..{v - 1})")

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise CheckpointError(f"{mask(str(self.path))}: no tokenizer.json; pass token ids instead of text")
        return self.tokenizer.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    # -- generation --------------------------------------------------------------------------

    def stream(
        self,
        prompt: str | list[int],
        *,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: list[str] | str | None = None,
        stop_token_ids: list[int] | None = None,
        ignore_eos: bool = False,
        logprobs: int | None = None,
        reuse_prefix: bool = False,
        cancel: threading.Event | None = None,
        speculate: bool = True,
    ) -> Iterator[Step]:
        """Generate token by token. Closing the generator (or setting ``cancel``) stops it cleanly.

        Callable from several threads at once: each generation joins the running batch (up to
        ``parallel`` at once, the rest wait for a state slot); its tokens are the same as alone.
        ``speculate`` (greedy only) verifies n-gram drafts several tokens per forward; the
        tokens are the same as without it. Sampling never speculates.
        """
        req = self.request(prompt, **dict(
            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=stop,
            stop_token_ids=stop_token_ids, ignore_eos=ignore_eos, logprobs=logprobs, reuse_prefix=reuse_prefix,
            cancel=cancel, speculate=speculate))
        return self._steps(req)

    def request(self, prompt, **kw) -> Request:
        """A checked generation request (``stream``'s arguments), for ``scheduler.submit``: the server
        submits at once, so its admission counts the request from then on."""
        unknown = set(kw) - _STREAM_ARGS
        if unknown:
            raise InvalidArgumentError(f"unknown argument(s) {sorted(unknown)}; known: {sorted(_STREAM_ARGS)}")
        kw = {**_STREAM_DEFAULTS, **kw}
        validate.sampling(max_new_tokens=kw["max_new_tokens"], temperature_=kw["temperature"], top_p_=kw["top_p"],
                          top_k=kw["top_k"], seed_=kw["seed"], logprobs=kw["logprobs"], stop=kw["stop"],
                          stop_token_ids=kw["stop_token_ids"],
                          flags=dict(ignore_eos=kw["ignore_eos"], reuse_prefix=kw["reuse_prefix"],
                                     speculate=kw["speculate"]))
        params = SamplingParams(temperature=kw["temperature"], top_p=kw["top_p"], top_k=kw["top_k"], seed=kw["seed"])
        if isinstance(prompt, str):
            ids = self.encode(prompt)
        elif torch.is_tensor(prompt) or isinstance(prompt, (list, tuple)):
            ids = validate.token_ids(prompt.tolist() if torch.is_tensor(prompt) else prompt)
        else:
            raise InvalidArgumentError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise InvalidArgumentError("the prompt is empty: give at least one token")
        self._check_ids(ids)
        prompt_fit.check(len(ids), self.max_context, self.desc.max_position_embeddings)
        stop = kw["stop"]
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        return Request(ids, params, kw["max_new_tokens"], stops, set(kw["stop_token_ids"] or []), kw["ignore_eos"],
                       kw["logprobs"], kw["reuse_prefix"], kw["cancel"], kw["speculate"])

    def _steps(self, req: Request) -> Iterator[Step]:
        # joins the batch on the first next(), not when stream() is called
        yield from self.follow(self.scheduler.submit(req))

    def follow(self, seq) -> Iterator[Step]:
        """The steps of a sequence submitted to ``scheduler`` (``scheduler.submit(engine.request(...))``,
        as the server does); the last one's stats become ``last_stats``."""
        for step in self.scheduler.steps(seq):
            if step.finish_reason:
                self.last_stats = step.stats
            yield step

    def generate(self, prompt: str | list[int] | list[str] | list[list[int]], **kwargs) -> Result | list[Result]:
        """Run ``stream`` to the end; returns the generated tokens, text and stats.

        A list of prompts (strings, or lists of token ids) runs them all at once (``parallel``
        at a time) and returns a list of ``Result``s, in order; each equals its prompt run alone.
        """
        many = isinstance(prompt, (list, tuple)) and len(prompt) > 0 and all(
            isinstance(p, str) or torch.is_tensor(p) or isinstance(p, (list, tuple)) for p in prompt)
        if not many:
            return _collect(self._steps(self.request(prompt, **kwargs)), kwargs.get("logprobs") is not None)
        reqs = [self.request(p, **kwargs) for p in prompt]
        seqs = [self.scheduler.submit(r) for r in reqs]
        try:
            return [_collect(self.scheduler.steps(s), kwargs.get("logprobs") is not None) for s in seqs]
        finally:
            for s in seqs:
                self.scheduler.cancel(s)


_STREAM_DEFAULTS = {name: p.default for name, p in inspect.signature(Engine.stream).parameters.items()
                    if p.kind == p.KEYWORD_ONLY}
_STREAM_ARGS = set(_STREAM_DEFAULTS)


def _collect(steps: Iterator[Step], want_lp: bool) -> Result:
    tokens, text, lps = [], [], []
    finish, stats = "length", {}
    for step in steps:
        tokens.append(step.token_id)
        text.append(step.text_delta)
        if want_lp:
            lps.append(step.logprob)
        if step.finish_reason:
            finish, stats = step.finish_reason, step.stats
    return Result(tokens, "".join(text), finish, stats, lps if want_lp else None)


__all__ = ["DebugOptions", "Engine", "ModelInfo", "Options", "PrefetchOptions", "Result", "Step", "load"]
