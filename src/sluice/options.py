"""What ``sluice.load()`` accepts besides the path and the budget: ``Options`` and its nested
settings (``experts.lookahead.PrefetchOptions`` for the lookahead, ``DebugOptions`` for tests).
``validate.options`` checks every value before ``load`` builds them."""

from __future__ import annotations

from dataclasses import dataclass, field

from .experts.lookahead import PrefetchOptions

DEFAULT_MAX_CONTEXT = 4096
DEFAULT_PREFILL_CHUNK = 512


@dataclass
class DebugOptions:
    """Test-only switches (``Options.debug``)."""

    # fill the spine stream buffers with 0xFF bytes (NaN in every float dtype) before their first
    # real fill, so a family that derives tensors from streamed weights at build time gives NaN
    # logits (the rule in spine.py); costs the buffers' memory up front
    poison_stream_buffers: bool = False


@dataclass
class Options:
    """Everything ``load()`` accepts besides the path and budget, with its default."""

    cache_experts: int | None = None
    max_context: int | None = None
    threads: int | None = None
    reader_threads: int = 4
    cache_policy: str = "lfru"
    # the router lookahead's prefetch: True/False (on/off with the defaults) or its settings
    prefetch: bool | PrefetchOptions = True
    # read the experts the token ids decide (hash-routed layers: DeepSeek-V4) as soon as a step's
    # ids are known, before their layers run (experts/certain.py); results never depend on it
    certain_reads: bool = True
    huge_pages: bool = True  # transparent huge pages for read buffers: ~1.7-2x O_DIRECT throughput here
    direct_io: bool | None = None  # None: probe O_DIRECT, fall back to buffered
    ca_bundle: str | None = None  # a model at an https:// URL: PEM file of extra CA certificates to trust
    allow_unversioned_remote: bool = False  # read a URL whose server sends neither ETag nor Last-Modified
    disk_cache: int | str | None = None  # a model at a URL: keep what is fetched in a local disk tier of this size
    disk_cache_dir: str | None = None  # the disk tier's directory (None: storage.disk_tier.default_dir())
    verify_reads: bool = True  # CRC32 of every expert record and streamed spine layer read from a container
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    # sequences run at once, each with KV/state for max_context (None: min(4, the budget's))
    parallel: int | None = None
    progress: bool = True
    trace_routing: str | None = None  # write each decode token's routing to this JSONL file
    # the row store's cache of streamed table rows (bytes or a size string); None: the planner's
    # choice (tables resident when they fit in a tenth of the budget above the floor). Setting it streams.
    row_cache: int | str | None = None
    max_resident_layers: int | None = None  # stream the spine of the other layers (None: the planner decides)
    moe_top_k: int | None = None  # lossy
    prefer_cached: float = 0.0  # lossy
    debug: DebugOptions = field(default_factory=DebugOptions)  # test-only switches
    # experts on a Ray cluster (docs/scale-out.md): "auto" or the cluster's address; None: this process
    ray: str | None = None
    expert_workers: int | None = None  # Ray expert workers (None: one per node of the cluster)
    worker_memory: int | str | None = None  # each worker's budget (None: a safe share of its machine's memory)
    replicate_hot: int = 0  # per MoE layer, the N most-routed experts may also run on a second worker
    ray_timeout: float = 60.0  # seconds to reach the cluster, and to place and start the workers
    # each MoE layer's worker calls through one Ray compiled graph (False: one plain actor call per worker)
    ray_compiled: bool = True

    def __post_init__(self):
        # a bool stands for the default settings, on or off (``load`` checks the value first)
        if isinstance(self.prefetch, bool):
            self.prefetch = PrefetchOptions.of(self.prefetch)


__all__ = ["DEFAULT_MAX_CONTEXT", "DEFAULT_PREFILL_CHUNK", "DebugOptions", "Options", "PrefetchOptions"]
