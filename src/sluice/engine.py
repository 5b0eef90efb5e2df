"""The public engine: load a model under a memory budget, run forwards, generate tokens.

``load()`` opens a Hugging Face directory (or a packed container), plans memory, loads the
spine and wires the family's layers to the expert interface. ``Engine.stream()`` is the
core step generator; ``generate()``, the CLI and the server are built on it.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from . import generation, kernels, validate
from .checkpoint import Checkpoint
from .container import Container, is_container
from .errors import CheckpointError, InvalidArgumentError, SluiceError
from .experts.cache import ExpertCache
from .experts.lookahead import rank_guesses
from .experts.policy import make_policy
from .experts.provider import ExpertProvider
from .experts.source import CheckpointExperts, ContainerExperts
from .generation import Request, Result, Step
from .layers.attention import SCORE_BLOCK_BYTES
from .layers.sampling import SamplingParams
from .models import get_family
from .models.base import MoEBlock, check_tensor
from .models.config import check_layer_count, eos_ids
from .plan import Plan, activation_bytes, make_plan
from .progress import Progress
from .resolve import resolve_model
from .runner import ModelRunner, SeqState
from .spine import LayerReads, SpineStreamer, layer_reads, streamable
from .spine import buffer_bytes as spine_buffer_bytes
from .stats import EngineCounters, EngineInfo, GenerationStats
from .storage import open_store
from .sysmem import current_rss, default_budget
from .tokenizer import Tokenizer
from .trace import TraceWriter
from .units import parse_size

DEFAULT_MAX_CONTEXT = 4096
DEFAULT_PREFILL_CHUNK = 512


@dataclass
class Options:
    """Everything ``load()`` accepts besides the path and budget, with its default."""

    cache_experts: int | None = None
    max_context: int | None = None
    threads: int | None = None
    reader_threads: int = 4
    cache_policy: str = "lfru"
    prefetch: bool = True
    huge_pages: bool = True  # transparent huge pages for read buffers: ~1.7-2x O_DIRECT throughput here
    direct_io: bool | None = None  # None: probe O_DIRECT, fall back to buffered
    ca_bundle: str | None = None  # a model at an https:// URL: PEM file of extra CA certificates to trust
    verify_reads: bool = True  # CRC32 of every expert record and streamed spine layer read from a container
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    progress: bool = True
    trace_routing: str | None = None  # write each decode token's routing to this JSONL file
    max_resident_layers: int | None = None  # stream the spine of the other layers (None: the planner decides)
    moe_top_k: int | None = None  # lossy
    prefer_cached: float = 0.0  # lossy
    # test-only: fill the spine stream buffers with 0xFF bytes (NaN in every float dtype) before
    # their first real fill, so a family that derives tensors from streamed weights at build time
    # gives NaN logits (the rule in spine.py); costs the buffers' memory up front
    poison_stream_buffers: bool = False


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


def check_spine_dtype(name: str, info, spine: dict) -> None:
    """Spine tensors are float32/bfloat16/float16; block-scaled FP8 (e4m3) only for a weight whose
    ``_scale_inv`` companion the family reads too."""
    if info.dtype in SPINE_DTYPES or (info.dtype == "F8_E4M3" and name + "_scale_inv" in spine):
        return
    if info.dtype == "F8_E4M3":
        raise CheckpointError(
            f"{info.file}: spine tensor {name!r} is F8_E4M3, but config.json declares no block-scaled "
            "quantization for it (quantization_config / modules_to_not_convert)")
    raise CheckpointError(
        f"{info.file}: spine tensor {name!r} is stored as {info.dtype}; Sluice computes with spine tensors "
        f"in {', '.join(SPINE_DTYPES)} (and block-scaled F8_E4M3 weights with their scales): re-save the "
        "checkpoint in a float dtype")


class ModelInfo:
    """An opened, validated model directory: config, family, tensor tables. Nothing loaded yet."""

    def __init__(self, path: str | os.PathLike, direct_io: bool | None = None, revision: str | None = None,
                 ca_bundle: str | None = None):
        self.path, self.model_id = resolve_model(path, revision)  # a local Path or a URL (str)
        remote = {"ca_bundle": os.fspath(ca_bundle)} if ca_bundle else {}
        try:
            self.store = store = open_store(self.path, **remote)  # the model's files, whatever holds them
            self.is_container = is_container(store)
            if self.is_container:
                self.checkpoint = Container(store, direct=direct_io)
            else:
                self.checkpoint = Checkpoint(store, direct=direct_io)
        except SluiceError:
            raise
        except OSError as e:  # a remote store that cannot be reached, listed or authenticated to
            raise CheckpointError(f"{self.path}: cannot open the model: {e}") from None
        self.raw_config = self.checkpoint.config
        self.family = get_family(self.raw_config.get("model_type"))
        self.config = self.family.parse_config(self.raw_config)
        check_layer_count(self.config.num_hidden_layers, self.checkpoint.tensors, getattr(self.config, "mtp_layers", 0))
        self.desc = self.family.describe(self.config)
        aliases = getattr(self.family, "tensor_aliases", None)
        if aliases is not None:  # a tensor some checkpoints store under another name
            tensors = self.checkpoint.tensors
            for name, alt in aliases(self.config).items():
                if name not in tensors and alt in tensors:
                    tensors[name] = tensors[alt]
        for name, shape in self.desc.spine.items():
            info = self.checkpoint.info(name)
            check_tensor(name, info, shape)
            check_spine_dtype(name, info, self.desc.spine)
        if self.is_container:
            self.experts = ContainerExperts(self.checkpoint, self.desc.moe_layers, self.desc.n_experts,
                                            self.desc.expert.matrix_shapes())
        else:
            self.experts = CheckpointExperts(self.checkpoint, self.desc.moe_layers, self.desc.n_experts,
                                             self.desc.expert_tensors, self.desc.expert_format, self.desc.expert)
        self.tokenizer: Tokenizer | None = None
        if store.exists("tokenizer.json"):
            self.tokenizer = Tokenizer(store)
        self.eos_token_ids = eos_ids(self.raw_config, self.checkpoint.generation_config)
        if not self.eos_token_ids and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.append(self.tokenizer.eos_token_id)

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
                glob += info.nbytes + (info.numel * 4 if len(info.shape) == 1 else 0)
        layers = {i: sum(self.checkpoint.info(n).nbytes for n in v) for i, v in movable.items()}
        return glob, layers

    def layer_reads(self) -> dict[int, LayerReads]:
        return {i: layer_reads(self.checkpoint, i, names) for i, names in streamable(self.desc).items()}

    def param_counts(self) -> tuple[int, int]:
        """(total parameters, parameters active per token)."""
        spine = sum(self.checkpoint.info(n).numel for n in self.desc.spine)
        per_expert = self.desc.expert.param_count() if self.desc.moe_layers else 0
        return spine + per_expert * self.desc.total_experts, spine + per_expert * self.desc.working_set

    def plan(self, memory: int | str | None, options: Options, baseline: int | None = None) -> Plan:
        limit = self.desc.max_position_embeddings
        max_ctx = options.max_context or min(limit, DEFAULT_MAX_CONTEXT)
        if max_ctx > limit:
            raise InvalidArgumentError(f"max_context (--max-context) {max_ctx} exceeds the model's limit of {limit} "
                                       "positions")
        budget = parse_size(memory, "memory") if memory is not None else default_budget()
        chunk = max(1, min(options.prefill_chunk, max_ctx))
        ffn = max(self.desc.expert.intermediate, getattr(self.config, "intermediate_size", 0) or 0)
        glob, layers = self.spine_split()
        reads = self.layer_reads()
        # a remote read holds its response body until it is copied into the slot: one per reader
        # thread and one for the spine stream (0 for local files, read straight into the buffers)
        transfer = (options.reader_threads + 1) * self.checkpoint.sources.transfer_bytes
        return make_plan(
            budget=budget, baseline=current_rss() if baseline is None else baseline,
            spine_global=glob, spine_layers=layers,
            stream_buffer=max((spine_buffer_bytes(r) for r in reads.values()), default=0),
            state_bytes=self.desc.state_bytes_per_token * max_ctx + self.desc.state_bytes_fixed,
            activations=activation_bytes(self.desc.hidden, ffn, self.desc.vocab, chunk, self.desc.attn_heads, max_ctx,
                                         score_block=SCORE_BLOCK_BYTES) + transfer,
            slot_bytes=self.experts.slot_bytes, working_set=self.desc.working_set,
            total_experts=self.desc.total_experts, top_k=self.desc.top_k, max_context=max_ctx,
            prefill_chunk=chunk, cache_experts=options.cache_experts,
            max_resident_layers=options.max_resident_layers,
        )


class Engine:
    def __init__(self, path: str | os.PathLike, memory: int | str | None, options: Options,
                 revision: str | None = None):
        t_load = time.perf_counter()
        self.options = options
        baseline = current_rss()
        self.threads = options.threads or os.cpu_count() or 1
        kernels.set_threads(self.threads)
        self.info = info = ModelInfo(path, options.direct_io, revision, ca_bundle=options.ca_bundle)
        self.path, self.model_id = info.path, info.model_id  # model_id: what a server reports
        self.checkpoint, self.raw_config, self.family = info.checkpoint, info.raw_config, info.family
        self.config, self.desc, self.experts_source = info.config, info.desc, info.experts
        self.tokenizer, self.eos_token_ids = info.tokenizer, info.eos_token_ids
        self.plan: Plan = info.plan(memory, options, baseline)
        self.spine: SpineStreamer | None = None
        spine = self._load_spine()
        self.cache = ExpertCache(self.plan.cache_slots, self.experts_source.slot_bytes,
                                 make_policy(options.cache_policy), huge_pages=options.huge_pages)
        self.experts = ExpertProvider(self.experts_source, self.cache, self.desc.expert, self.desc.n_experts,
                                      reader_threads=options.reader_threads, verify_reads=options.verify_reads)
        self.model = self.family.build(self.config, spine.__getitem__, self.experts)
        self.model.spine = self.spine
        del spine
        if options.prefetch or options.trace_routing:
            self.model.lookahead = self._lookahead
        self.set_lossy(moe_top_k=options.moe_top_k, prefer_cached=options.prefer_cached)
        self.trace = TraceWriter(options.trace_routing) if options.trace_routing else None
        # the generator and the server reach the model only through the runner
        self.runner = ModelRunner(self.model, self.experts, self.cache, self.checkpoint, self.spine,
                                  max_context=self.plan.max_context, prefill_chunk=self.plan.prefill_chunk,
                                  threads=self.threads, tokenizer=self.tokenizer, eos_token_ids=self.eos_token_ids,
                                  moe_layers=self.desc.moe_layers, trace=self.trace, info=self._info)
        self._lock = threading.Lock()
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
                                       poison=self.options.poison_stream_buffers)
            for i in sorted(streamed):
                out.update(self.spine.views(i))
        names = [n for n in self.desc.spine if n not in out]
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
        return out

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()
        if self.spine is not None:
            self.spine.close()
        self.experts.close()
        self.checkpoint.close()

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
        if moe_top_k == self.desc.top_k:
            moe_top_k = None  # the model's own top-k: exact, nothing lossy
        for layer in self.model.layers:
            if isinstance(layer.mlp, MoEBlock):
                layer.mlp.top_k = moe_top_k
                layer.mlp.prefer_cached = prefer_cached
        self.lossy = {k: v for k, v in (("moe_top_k", moe_top_k), ("prefer_cached", prefer_cached)) if v}
        if self.lossy and warn:
            warnings.warn(f"lossy routing enabled ({self.lossy}): outputs differ from the model's", stacklevel=2)

    # Lookahead prefetch (measured in docs/io.md): predict this many layers ahead (1 or 2) ...
    lookahead_depth = 1
    # ... read a guess only if some row gives it at least this router probability ...
    prefetch_min_prob = 0.0
    # ... and predict for forwards of at most this many rows (decode, a batch of sequences'
    # decode rows, speculative verification); a prefill chunk reads each expert once anyway
    lookahead_max_rows = 64

    def _lookahead(self, layer: int, h: torch.Tensor) -> None:
        """After layer ``layer``'s attention, start reads for the experts the next layers are
        predicted to use (and, when tracing routing, record the next layer's prediction for
        every token of the forward). With several rows (sequences batched in one forward, a
        verified draft), the union of the rows' guesses, by predicted weight mass."""
        traced = self.experts.predicted_routing
        prefetch = self.options.prefetch and h.shape[0] <= self.lookahead_max_rows
        if traced is None and not prefetch:
            return
        if isinstance(self.model.layers[layer].mlp, MoEBlock):
            # guess once this layer's own demand reads are issued (inside its MoE call)
            self.experts.after_reads(layer, lambda: self._predict_ahead(layer, h, prefetch, traced))
        else:
            self._predict_ahead(layer, h, prefetch, traced)

    def _predict_ahead(self, layer: int, h: torch.Tensor, prefetch: bool, traced) -> None:
        for distance in range(1, (self.lookahead_depth if prefetch else 1) + 1):
            target = layer + distance
            if self.spine is not None and not self.spine.ready(target):
                return  # its router is still being read
            got = self.model.predict_weights(target, h)
            if got is None:
                continue  # a dense layer (or past the last one)
            ids, probs = got
            if distance == 1 and traced is not None:
                traced[target] = ids
            if prefetch:
                self.experts.prefetch(target, rank_guesses(ids, probs, self.prefetch_min_prob), distance=distance)

    # -- model access ------------------------------------------------------------------------

    def _info(self) -> EngineInfo:
        """What every generation's stats report about this engine."""
        plan = self.plan
        return EngineInfo(budget_bytes=plan.budget, cache_slots=plan.cache_slots, total_experts=plan.total_experts,
                          direct_io=self.experts_source.direct_io, load_s=self.load_s, lossy=dict(self.lossy),
                          spine_resident_bytes=plan.spine_bytes - plan.stream_buffer_bytes,
                          spine_streamed_layers=len(plan.streamed_layers))

    def totals(self) -> EngineCounters:
        """The engine's counters since load (expert lookups and reads, bytes read, forwards): a read
        shared by several generations counts once here, in full in each one's stats."""
        return self.runner.counters()

    @property
    def slot(self) -> SeqState:
        """The state slot generations run on (one today: one sequence at a time)."""
        return self.runner.slots[0]

    @property
    def state(self):
        """The model state of ``slot`` (KV caches, recurrent states, the tokens they hold)."""
        return self.slot.model_state

    @property
    def max_context(self) -> int:
        return self.slot.max_context

    def _run(self, ids: list[int], start: int, last_n: int = 1) -> torch.Tensor | None:
        """Forward ``ids`` at positions start.. on ``slot``; logits [last_n, V] of the last positions."""
        return self.runner.run(self.slot, ids, start, last_n)

    def forward(self, input_ids) -> torch.Tensor:
        """fp32 logits [T, V] for every position of a 1-D token sequence, from an empty cache."""
        ids = validate.token_ids(input_ids.tolist() if torch.is_tensor(input_ids) else input_ids, "input_ids")
        if not ids:
            raise InvalidArgumentError("input_ids is empty")
        if len(ids) > self.max_context:
            raise InvalidArgumentError(f"input_ids: {len(ids)} tokens exceed max_context {self.max_context}")
        self._check_ids(ids)
        with self._lock, torch.inference_mode():
            self.slot.rewind(0)
            return self.runner.run(self.slot, ids, 0, last_n=len(ids))

    def _check_ids(self, ids: list[int]) -> None:
        v = self.desc.vocab
        bad = [i for i in ids if not 0 <= i < v]
        if bad:
            raise InvalidArgumentError(f"token id {bad[0]} is outside the vocabulary (0..{v - 1})")

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise CheckpointError(f"{self.path}: no tokenizer.json; pass token ids instead of text")
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

        ``speculate`` (greedy only) verifies n-gram drafts several tokens per forward; the
        tokens are the same as without it. Sampling never speculates.
        """
        validate.sampling(max_new_tokens=max_new_tokens, temperature_=temperature, top_p_=top_p, top_k=top_k,
                          seed_=seed, logprobs=logprobs, stop=stop, stop_token_ids=stop_token_ids,
                          flags=dict(ignore_eos=ignore_eos, reuse_prefix=reuse_prefix, speculate=speculate))
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        if isinstance(prompt, str):
            ids = self.encode(prompt)
        elif torch.is_tensor(prompt) or isinstance(prompt, (list, tuple)):
            ids = validate.token_ids(prompt.tolist() if torch.is_tensor(prompt) else prompt)
        else:
            raise InvalidArgumentError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise InvalidArgumentError("the prompt is empty: give at least one token")
        self._check_ids(ids)
        if len(ids) >= self.max_context:
            raise InvalidArgumentError(
                f"prompt of {len(ids)} tokens does not fit the context of {self.max_context} tokens "
                "(raise --max-context or shorten the prompt)"
            )
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        req = Request(ids, params, max_new_tokens, stops, set(stop_token_ids or []), ignore_eos, logprobs,
                      reuse_prefix, cancel, speculate)
        return self._locked(req)

    def _locked(self, req: Request) -> Iterator[Step]:
        if not self._lock.acquire(blocking=False):
            raise SluiceError("the engine is already generating; one generation runs at a time")
        gen = generation.run(self.runner, self.slot, req)
        try:
            for step in gen:
                if step.finish_reason:
                    self.last_stats = step.stats
                yield step
        finally:
            gen.close()
            self._lock.release()

    def generate(self, prompt: str | list[int], **kwargs) -> Result:
        """Run ``stream`` to the end; returns the generated tokens, text and stats."""
        want_lp = kwargs.get("logprobs") is not None
        tokens, text, lps = [], [], []
        finish, stats = "length", {}
        for step in self.stream(prompt, **kwargs):
            tokens.append(step.token_id)
            text.append(step.text_delta)
            if want_lp:
                lps.append(step.logprob)
            if step.finish_reason:
                finish, stats = step.finish_reason, step.stats
        return Result(tokens, "".join(text), finish, stats, lps if want_lp else None)


__all__ = ["Engine", "ModelInfo", "Options", "Result", "Step", "load"]
