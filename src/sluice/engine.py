"""The public engine: load a model under a memory budget, run forwards, generate tokens.

``load()`` opens a Hugging Face directory (or a packed container), plans memory, loads the
spine and wires the family's layers to the expert interface. ``Engine.stream()`` is the
core step generator; ``generate()``, the CLI and the server are built on it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .checkpoint import Checkpoint
from .container import Container, ContainerExperts, is_container
from .errors import CheckpointError, GenerationCancelled, SluiceError
from .experts.cache import ExpertCache
from .experts.policy import make_policy
from .experts.provider import ExpertProvider
from .experts.source import CheckpointExperts
from .layers.sampling import Sampler, SamplingParams, logprobs
from .models import get_family
from .models.base import check_tensor
from .models.config import eos_ids
from .plan import Plan, activation_bytes, make_plan
from .progress import Progress
from .sysmem import current_rss, default_budget, peak_rss
from .text import Detokenizer, StopStrings
from .tokenizer import Tokenizer
from .units import parse_size

DEFAULT_MAX_CONTEXT = 4096
DEFAULT_PREFILL_CHUNK = 512


@dataclass
class Step:
    """One generated token, as the step generator yields it."""

    token_id: int
    text_delta: str
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" on the last step
    stats: dict = field(default_factory=dict)


@dataclass
class Result:
    """A finished generation: the generated tokens only (not the prompt)."""

    token_ids: list[int]
    text: str
    finish_reason: str
    stats: dict
    logprobs: list[float] | None = None


@dataclass
class Options:
    """Everything ``load()`` accepts besides the path and budget, with its default."""

    cache_experts: int | None = None
    max_context: int | None = None
    threads: int | None = None
    reader_threads: int = 4
    cache_policy: str = "lfru"
    prefetch: bool = True
    direct_io: bool | None = None  # None: probe O_DIRECT, fall back to buffered
    verify_reads: bool = False
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    progress: bool = True


def load(path: str | os.PathLike, memory: int | str | None = None, **options) -> "Engine":
    """Open a model directory under a memory budget (``"8GiB"``, bytes, or None for a safe default)."""
    unknown = set(options) - set(Options.__dataclass_fields__)
    if unknown:
        raise TypeError(f"unknown option(s) {sorted(unknown)}; known: {sorted(Options.__dataclass_fields__)}")
    return Engine(path, memory, Options(**options))


class ModelInfo:
    """An opened, validated model directory: config, family, tensor tables. Nothing loaded yet."""

    def __init__(self, path: str | os.PathLike, direct_io: bool | None = None):
        self.path = Path(path)
        self.is_container = is_container(self.path)
        if self.is_container:
            self.checkpoint = Container(self.path, direct=direct_io)
        else:
            self.checkpoint = Checkpoint(self.path, direct=direct_io)
        self.raw_config = self.checkpoint.config
        self.family = get_family(self.raw_config.get("model_type"))
        self.config = self.family.parse_config(self.raw_config)
        self.desc = self.family.describe(self.config)
        for name, shape in self.desc.spine.items():
            check_tensor(name, self.checkpoint.info(name), shape)
        if self.is_container:
            self.experts = ContainerExperts(self.checkpoint, self.desc.moe_layers, self.desc.n_experts,
                                            self.desc.expert.matrix_shapes())
        else:
            self.experts = CheckpointExperts(self.checkpoint, self.desc.moe_layers, self.desc.n_experts,
                                             self.desc.expert_tensors, self.desc.expert_format, self.desc.expert)
        self.tokenizer: Tokenizer | None = None
        if (self.path / "tokenizer.json").exists():
            self.tokenizer = Tokenizer(self.path)
        self.eos_token_ids = eos_ids(self.raw_config, self.checkpoint.generation_config)
        if not self.eos_token_ids and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.append(self.tokenizer.eos_token_id)

    def spine_bytes(self) -> int:
        """Bytes the resident spine takes: stored tensors plus fp32 copies of 1-D ones (norms)."""
        total = 0
        for name in self.desc.spine:
            info = self.checkpoint.info(name)
            total += info.nbytes + (info.numel * 4 if len(info.shape) == 1 else 0)
        return total

    def param_counts(self) -> tuple[int, int]:
        """(total parameters, parameters active per token)."""
        spine = sum(self.checkpoint.info(n).numel for n in self.desc.spine)
        per_expert = self.desc.expert.param_count() if self.desc.moe_layers else 0
        return spine + per_expert * self.desc.total_experts, spine + per_expert * self.desc.working_set

    def plan(self, memory: int | str | None, options: Options, baseline: int | None = None) -> Plan:
        limit = self.desc.max_position_embeddings
        max_ctx = options.max_context or min(limit, DEFAULT_MAX_CONTEXT)
        if max_ctx > limit:
            raise ValueError(f"--max-context {max_ctx} exceeds the model's limit of {limit} positions")
        budget = parse_size(memory) if memory is not None else default_budget()
        chunk = max(1, min(options.prefill_chunk, max_ctx))
        ffn = max(self.desc.expert.intermediate, getattr(self.config, "intermediate_size", 0) or 0)
        return make_plan(
            budget=budget, baseline=current_rss() if baseline is None else baseline,
            spine_bytes=self.spine_bytes(),
            state_bytes=self.desc.state_bytes_per_token * max_ctx + self.desc.state_bytes_fixed,
            activations=activation_bytes(self.desc.hidden, ffn, self.desc.vocab, chunk, self.desc.attn_heads, max_ctx),
            slot_bytes=self.experts.slot_bytes, working_set=self.desc.working_set,
            total_experts=self.desc.total_experts, top_k=self.desc.top_k, max_context=max_ctx,
            prefill_chunk=chunk, cache_experts=options.cache_experts,
        )


class Engine:
    def __init__(self, path: str | os.PathLike, memory: int | str | None, options: Options):
        t_load = time.perf_counter()
        self.options = options
        self.path = Path(path)
        baseline = current_rss()
        if options.threads:
            torch.set_num_threads(options.threads)
        self.info = info = ModelInfo(self.path, options.direct_io)
        self.checkpoint, self.raw_config, self.family = info.checkpoint, info.raw_config, info.family
        self.config, self.desc, self.experts_source = info.config, info.desc, info.experts
        self.tokenizer, self.eos_token_ids = info.tokenizer, info.eos_token_ids
        self.plan: Plan = info.plan(memory, options, baseline)
        spine = self._load_spine()
        self.cache = ExpertCache(self.plan.cache_slots, self.experts_source.slot_bytes,
                                 make_policy(options.cache_policy))
        self.experts = ExpertProvider(self.experts_source, self.cache, self.desc.expert,
                                      reader_threads=options.reader_threads, verify_reads=options.verify_reads)
        self.model = self.family.build(self.config, spine.__getitem__, self.experts)
        del spine
        if options.prefetch:
            self.model.lookahead = self._lookahead
        self.state = self.model.new_state(self.plan.max_context)
        self._lock = threading.Lock()
        self.load_s = time.perf_counter() - t_load
        self.last_stats: dict = {}

    # -- loading -----------------------------------------------------------------------------

    def _load_spine(self) -> dict[str, torch.Tensor]:
        names = list(self.desc.spine)
        total = sum(self.checkpoint.info(n).nbytes for n in names)
        bar = Progress(total, "loading spine", enabled=self.options.progress and total > (64 << 20))
        out = {}
        for n in names:
            out[n] = self.checkpoint.read(n)
            bar.update(self.checkpoint.info(n).nbytes)
        bar.close()
        return out

    def close(self) -> None:
        self.experts.close()
        self.checkpoint.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _lookahead(self, layer: int, h: torch.Tensor) -> None:
        """After layer ``layer``'s attention, start reads for the next layer's predicted experts."""
        if h.shape[0] != 1:
            return  # prefill reads each expert once per layer anyway
        ids = self.model.predict(layer + 1, h)
        if ids is not None:
            self.experts.prefetch(layer + 1, ids[0].tolist())

    # -- model access ------------------------------------------------------------------------

    @property
    def max_context(self) -> int:
        return self.state.max_ctx

    def _run(self, ids: list[int], start: int, all_logits: bool) -> torch.Tensor:
        """Forward ``ids`` at positions start.., in prefill chunks; logits of the last (or every) position."""
        outs = []
        chunk = self.plan.prefill_chunk
        for c0 in range(0, len(ids), chunk):
            part = ids[c0 : c0 + chunk]
            self.cache.policy.tick()
            h = self.model.forward(torch.tensor(part, dtype=torch.long), self.state, start + c0)
            self.state.length = start + c0 + len(part)
            self.state.tokens[start + c0 :] = part
            if all_logits:
                outs.append(self.model.logits(h))
            elif c0 + chunk >= len(ids):
                outs.append(self.model.logits(h[-1:]))
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def forward(self, input_ids) -> torch.Tensor:
        """fp32 logits [T, V] for every position of a 1-D token sequence, from an empty cache."""
        ids = [int(i) for i in (input_ids.tolist() if torch.is_tensor(input_ids) else input_ids)]
        if not ids:
            raise ValueError("input_ids is empty")
        if len(ids) > self.max_context:
            raise ValueError(f"{len(ids)} tokens exceed max_context {self.max_context}")
        self._check_ids(ids)
        with self._lock, torch.inference_mode():
            self.state.rewind(0)
            self.experts.decoding = False
            return self._run(ids, 0, all_logits=True)

    def _check_ids(self, ids: list[int]) -> None:
        v = self.desc.vocab
        bad = [i for i in ids if not 0 <= i < v]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{v - 1})")

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
    ) -> Iterator[Step]:
        """Generate token by token. Closing the generator (or setting ``cancel``) stops it cleanly."""
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        ids = self.encode(prompt) if isinstance(prompt, str) else [int(i) for i in prompt]
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        self._check_ids(ids)
        if len(ids) >= self.max_context:
            raise ValueError(
                f"prompt of {len(ids)} tokens does not fit the context of {self.max_context} tokens "
                "(raise --max-context or shorten the prompt)"
            )
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        return self._generate(ids, params, max_new_tokens, stops, set(stop_token_ids or []), ignore_eos,
                              logprobs, reuse_prefix, cancel)

    def _generate(self, ids, params, max_new_tokens, stops, stop_ids, ignore_eos, n_logprobs, reuse_prefix,
                  cancel) -> Iterator[Step]:
        if not self._lock.acquire(blocking=False):
            raise SluiceError("the engine is already generating; one generation runs at a time")
        try:
            yield from self._steps(ids, params, max_new_tokens, stops, stop_ids, ignore_eos, n_logprobs,
                                   reuse_prefix, cancel)
        finally:
            self.experts.decoding = False
            self._lock.release()

    def _steps(self, ids, params, max_new_tokens, stops, stop_ids, ignore_eos, n_logprobs, reuse_prefix,
               cancel) -> Iterator[Step]:
        t0 = time.perf_counter()
        c = self.experts.counters
        c0 = _snapshot(c)
        bytes0 = self.checkpoint.stats.bytes_read
        evict0 = self.cache.evictions
        sampler = Sampler(params)
        stop_on = set(stop_ids) | (set() if ignore_eos else set(self.eos_token_ids))
        detok = Detokenizer(self.tokenizer, ids) if self.tokenizer is not None else None
        stopper = StopStrings(stops)

        common = 0
        if reuse_prefix:
            old = self.state.tokens[: self.state.length]
            while common < min(len(old), len(ids) - 1) and old[common] == ids[common]:
                common += 1
        with torch.inference_mode():
            self.experts.decoding = False
            reused = self.state.rewind(common)
            logits = self._run(ids[reused:], reused, all_logits=False)[-1]
            self.state.mark()
        t_prefill = time.perf_counter() - t0
        budget_tokens = min(max_new_tokens, self.max_context - len(ids))
        generated: list[int] = []
        decode_times: list[float] = []
        stats: dict = {}
        finish = None
        while True:
            if cancel is not None and cancel.is_set():
                raise GenerationCancelled("generation cancelled")
            token = sampler(logits)
            lp, top = (logprobs(logits, token, n_logprobs) if n_logprobs is not None else (None, None))
            generated.append(token)
            delta = ""
            if token in stop_on:
                finish = "stop"
                delta = stopper.flush()
            else:
                if detok is not None:
                    delta = detok.push(token)
                delta, hit = stopper.feed(delta)
                if hit:
                    finish = "stop"
                elif len(generated) >= budget_tokens:
                    finish = "length"
                    tail = detok.flush() if detok is not None else ""
                    more, hit = stopper.feed(tail)
                    delta += more + ("" if hit else stopper.flush())
                    finish = "stop" if hit else "length"
            if finish is not None:
                stats = self._stats(ids, generated, reused, t0, t_prefill, decode_times, c0, bytes0, evict0)
                self.last_stats = stats
            yield Step(token, delta, lp, top, finish, stats)
            if finish is not None:
                return
            t1 = time.perf_counter()
            with torch.inference_mode():
                self.experts.decoding = True
                logits = self._run([token], len(ids) + len(generated) - 1, all_logits=False)[-1]
            decode_times.append(time.perf_counter() - t1)

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

    # -- stats -------------------------------------------------------------------------------

    def _stats(self, ids, generated, reused, t0, t_prefill, decode_times, c0, bytes0, evict0) -> dict:
        c = self.experts.counters
        d = {k: getattr(c, k) - v for k, v in c0.items()}
        steady = decode_times[1:]
        lookups = d["lookups"]
        prefilled = len(ids) - reused
        return {
            "prompt_tokens": len(ids),
            "generated_tokens": len(generated),
            "reused_prefix_tokens": reused,
            "prefill_tok_s": prefilled / t_prefill if t_prefill > 0 else 0.0,
            "decode_tok_s": len(steady) / sum(steady) if steady and sum(steady) > 0 else 0.0,
            "ttft_s": t_prefill,
            "total_s": time.perf_counter() - t0,
            "hit_rate": d["hits"] / lookups if lookups else 0.0,
            "expert_lookups": lookups,
            "expert_hits": d["hits"],
            "expert_misses": d["misses"],
            "demand_reads": d["demand_reads"],
            "prefetch_reads": d["prefetch_reads"],
            "prefetch_used": d["prefetch_used"],
            "prefetch_cancelled": d["prefetch_cancelled"],
            "lookahead_recall": d["predicted_hits"] / d["predicted"] if d["predicted"] else 0.0,
            "evictions": self.cache.evictions - evict0,
            "bytes_read": self.checkpoint.stats.bytes_read - bytes0,
            "read_wait_s": d["read_wait_s"],
            "expert_compute_s": d["compute_s"],
            "peak_rss_bytes": peak_rss(),
            "budget_bytes": self.plan.budget,
            "cache_slots": self.plan.cache_slots,
            "total_experts": self.plan.total_experts,
            "direct_io": self.experts_source.direct_io,
            "load_s": self.load_s,
        }


def _snapshot(counters) -> dict:
    return dict(vars(counters))


__all__ = ["Engine", "Options", "Result", "Step", "load"]
