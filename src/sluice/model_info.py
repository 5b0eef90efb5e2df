"""What a model is before it runs: its files, family, description and plan (``ModelInfo``).

``ModelInfo`` opens a Hugging Face directory, a packed container or a URL (with its disk tier),
reads and validates the config, describes the family's tensors, locates the row tables and
plans memory for a budget; ``inspect``, ``check``, ``convert`` and the engine all start from it
(the engine then loads the spine and wires the experts: ``engine.py``).
"""

from __future__ import annotations

import os


from .checkpoint import Checkpoint
from .container import Container, is_container
from .errors import CheckpointError, InvalidArgumentError, SluiceError
from .experts.source import CheckpointExperts, ContainerExperts
from .layers.attention import SCORE_BLOCK_BYTES
from .models import get_family
from .models import quantized_spine
from .models.base import check_tensor
from .models.config import check_layer_count, eos_ids
from .options import DEFAULT_MAX_CONTEXT, Options
from .plan import Plan, activation_bytes, make_plan, rows_for
from .progress import Activity
from .resolve import resolve_model
from .rows import RowTable, row_table
from .rows.table import paged_table
from .spine import LayerReads, layer_reads, streamable
from .spine import buffer_bytes as spine_buffer_bytes
from .storage import is_url, open_store
from .storage.disk_tier import open_tier
from .storage.urls import mask
from .sysmem import current_rss, default_budget
from .tokenizer import Tokenizer, has_tokenizer
from .units import parse_size




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
