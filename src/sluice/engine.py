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
from .errors import CheckpointError, InvalidArgumentError
from .cluster.connect import connect as connect_cluster
from .cluster.model import signature as cluster_signature
from .cluster.provider import RayExperts
from .experts.cache import ExpertCache
from .experts.lookahead import Lookahead, PrefetchOptions
from .experts.policy_spec import make_policy
from .experts.provider import ExpertProvider
from .generation import Request, Result, Step
from .layers.sampling import SamplingParams
from .models import quantized_spine
from .models.base import MoEBlock
from .options import DebugOptions, Options
from .plan import Plan, below_working_set_warning
from .progress import Progress
from .rows import RowStore
from .runner import ModelRunner, SeqState
from .scheduler import Scheduler
from .spine import SpineStreamer
from .stats import EngineCounters, EngineInfo, GenerationStats
from .storage.urls import mask
from .sysmem import current_rss
from . import prompt_fit
from .outputs import model_inputs
from .trace import TraceWriter
from .units import parse_size
from .model_info import ModelInfo, check_spine_dtype  # noqa: F401  (re-exported: the public names)


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
