"""The command line's flag groups that several commands share: the engine's options (memory,
cache, prefetch, reads, remote stores, Ray), the model argument and the generation flags; and
``engine_options``, which turns the parsed flags into ``sluice.load`` options."""

from __future__ import annotations

import argparse

from .cli_args import float_arg, int_arg, positive_size_arg, seed_arg, temperature_arg, top_p_arg

size_arg = positive_size_arg
count_arg = int_arg(0)


def add_engine_args(p: argparse.ArgumentParser, serving: bool = False) -> None:
    """The memory and I/O flags; ``serving``: the command runs many sequences at once (serve), so
    --parallel defaults to what the budget allows; the others run one and default to 1."""
    g = p.add_argument_group("memory and I/O")
    g.add_argument("--memory", type=size_arg, default=None, metavar="SIZE",
                   help="peak memory budget, e.g. 8GiB (binary) or 8GB (decimal). Covers the Python/torch "
                        "baseline, spine, KV cache, buffers and expert cache. Default: 85%% of available memory "
                        "(cgroup limits respected). Below the model's floor Sluice refuses to start and says why.")
    g.add_argument("--cache-experts", type=int_arg(1), default=None, metavar="N",
                   help="expert cache size in experts (overrides the size derived from --memory)")
    g.add_argument("--cache-policy", choices=["lfru", "lru", "ulfru"], default="lfru",
                   help="expert cache eviction: lfru (decayed hotness, default), lru, or ulfru (lfru that "
                        "learns which layers' slots pay; docs/cache-policy.md)")
    g.add_argument("--max-context", type=int_arg(1), default=None, metavar="N",
                   help="longest sequence (prompt + output); the KV cache is reserved for it "
                        "(default: min(model limit, 4096))")
    g.add_argument("--parallel", type=int_arg(1, 1 << 16), default=None if serving else 1, metavar="N",
                   help="sequences generated at once (requests in one batch; more wait in the queue), each with "
                        "KV/state for --max-context reserved in --memory (default: min(4, what the budget allows "
                        "without streaming more of the spine))" if serving else
                        "sequences that may run at once, each with KV/state for --max-context reserved in --memory "
                        "(default 1: this command runs one; more would only take expert cache)")
    g.add_argument("--threads", type=int_arg(1, 1024), default=None, metavar="N",
                   help="compute threads (default: all cores)")
    g.add_argument("--reader-threads", type=int_arg(1, 1024), default=4, metavar="N",
                   help="parallel expert reads (default 4)")
    g.add_argument("--no-prefetch", action="store_true",
                   help="disable router lookahead (reading the next layer's predicted experts early)")
    g.add_argument("--no-certain-reads", action="store_true",
                   help="do not read the experts the token ids decide (hash-routed layers, DeepSeek-V4) before "
                        "their layers run; they are then read when their layer asks (results are the same)")
    g.add_argument("--verify-reads", dest="verify_reads", action="store_true", default=True,
                   help="check the CRC32 of every expert record and streamed spine layer read from a container "
                        "(the default)")
    g.add_argument("--no-verify-reads", dest="verify_reads", action="store_false",
                   help="skip those CRC32 checks (saves a little CPU; corruption then goes undetected)")
    g.add_argument("--no-huge-pages", action="store_true",
                   help="do not ask for transparent huge pages for the expert cache and read buffers")
    g.add_argument("--buffered-io", action="store_true",
                   help="never use O_DIRECT (buffered reads that drop their pages from the page cache)")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")
    g.add_argument("--ca-bundle", default=None, metavar="PEM",
                   help="a model at an https:// URL: a PEM file of extra CA certificates to trust "
                        "(TLS verification is always on)")
    add_unversioned_arg(g)
    add_disk_cache_args(g)
    g.add_argument("--trace-routing", default=None, metavar="FILE",
                   help="write every decode token's expert routing (its sequence and engine step), router weights, "
                        "router probabilities and lookahead predictions to FILE (JSONL, the format sluice "
                        "trace-replay reads)")
    ray = p.add_argument_group("experts on a Ray cluster (docs/scale-out.md; the ray extra)")
    ray.add_argument("--ray", default=None, metavar="auto|ADDRESS",
                     help="compute the experts on Ray actors: auto (RAY_ADDRESS, else a cluster this user started "
                          "here, else a new local one, said so) or a cluster's HOST:PORT. "
                          "--memory is then this process's budget (spine, KV, buffers; no expert cache). "
                          "Run Ray on a private network only")
    ray.add_argument("--expert-workers", type=int_arg(1, 4096), default=None, metavar="N",
                     help="expert workers (Ray actors) to start (default: one per node)")
    ray.add_argument("--worker-memory", type=size_arg, default=None, metavar="SIZE",
                     help="each expert worker's memory budget, its expert cache included (default: a safe share "
                          "of its machine's available memory)")
    ray.add_argument("--ray-timeout", type=float_arg(0.0, lo_open=True), default=60.0, metavar="S",
                     help="seconds to wait for the cluster to answer and for the expert workers to be placed and "
                          "started, with a line on stderr every 5 s, before failing with the cause (default 60)")
    ray.add_argument("--replicate-hot", type=int_arg(0), default=0, metavar="N",
                     help="per MoE layer, the N most-routed experts may also run on a second worker (load "
                          "balance and failover; exact either way)")
    ray.add_argument("--ray-plain-calls", action="store_true",
                     help="send each MoE layer's requests as plain Ray actor calls, one per worker, instead of "
                          "through one compiled graph of all workers (the default; docs/scale-out.md has both "
                          "measured; exact either way)")
    lossy = p.add_argument_group("lossy speed switches (outputs differ from the model's; off by default)")
    lossy.add_argument("--moe-top-k", type=int_arg(1), default=None, metavar="N",
                       help="LOSSY: route each token to only N experts (fewer than the model was trained with)")
    lossy.add_argument("--prefer-cached", type=float_arg(0.0), default=0.0, metavar="BIAS",
                       help="LOSSY: add BIAS to the router scores of experts already in memory when choosing "
                            "experts (mixing weights stay the model's own), trading fidelity for fewer reads")


def add_unversioned_arg(g) -> None:
    g.add_argument("--allow-unversioned-remote", action="store_true",
                   help="a model at a URL whose server sends neither ETag nor Last-Modified: read it anyway. "
                        "Such a store cannot guarantee consistency: a file replaced while or between runs goes "
                        "unnoticed (refused by default)")


def add_disk_cache_args(g) -> None:
    g.add_argument("--disk-cache", type=size_arg, default=None, metavar="SIZE",
                   help="a model at a URL: keep what is fetched (expert records, spine, headers) in a local disk "
                        "tier of at most SIZE, shared by processes, read back with O_DIRECT and checked by CRC "
                        "(default: no disk tier)")
    g.add_argument("--disk-cache-dir", default=None, metavar="DIR",
                   help="the disk tier's directory (default $XDG_CACHE_HOME/sluice/disk-tier, i.e. "
                        "~/.cache/sluice/disk-tier); a new or empty directory, or one a tier made")


def engine_options(args) -> dict:
    return dict(cache_experts=args.cache_experts, cache_policy=args.cache_policy, max_context=args.max_context,
                threads=args.threads, reader_threads=args.reader_threads, prefetch=not args.no_prefetch,
                certain_reads=not args.no_certain_reads,
                verify_reads=args.verify_reads, moe_top_k=args.moe_top_k, prefer_cached=args.prefer_cached,
                trace_routing=args.trace_routing, huge_pages=not args.no_huge_pages,
                direct_io=False if args.buffered_io else None, progress=not args.no_progress,
                ca_bundle=args.ca_bundle, parallel=args.parallel, disk_cache=args.disk_cache,
                allow_unversioned_remote=args.allow_unversioned_remote,
                disk_cache_dir=args.disk_cache_dir, ray=args.ray, expert_workers=args.expert_workers,
                worker_memory=args.worker_memory, replicate_hot=args.replicate_hot,
                ray_timeout=args.ray_timeout, ray_compiled=not args.ray_plain_calls)


def add_model_arg(p: argparse.ArgumentParser) -> None:
    """The positional MODEL and --revision: a directory, a container, 'demo' or a cached repo id."""
    from .resolve import MODEL_HELP, REVISION_HELP

    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--revision", default=None, metavar="REV", help=REVISION_HELP)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("generation")
    g.add_argument("--max-new-tokens", type=int_arg(1), default=128, metavar="N",
                   help="tokens to generate (default 128)")
    g.add_argument("--temperature", type=temperature_arg, default=0.0, metavar="T",
                   help="0 = greedy, exact (default 0)")
    g.add_argument("--top-p", type=top_p_arg, default=1.0, metavar="P", help="nucleus sampling mass (default 1.0: off)")
    g.add_argument("--top-k", type=int_arg(0), default=0, metavar="K",
                   help="sample among the k most likely tokens (default 0: off)")
    g.add_argument("--seed", type=seed_arg, default=None, metavar="N", help="random seed for sampling")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop when this text is generated (repeatable); it is not included in the output")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens")
    g.add_argument("--no-speculate", action="store_true",
                   help="turn off lossless n-gram speculative decoding (on by default for greedy decoding; "
                        "it never changes the tokens, sampling never speculates)")
