"""The ``sluice`` command line. Thin: parse, call the public API, print."""

from __future__ import annotations

import argparse
import json
import os
import sys

from . import __version__
from .cli_args import int_arg, positive_size_arg
from .cli_flags import (add_disk_cache_args, add_engine_args, add_model_arg, add_sampling_args, add_unversioned_arg,
                        engine_options)
from .errors import InvalidArgumentError, SluiceError
from .units import format_size, parse_size


_size = positive_size_arg
_count = int_arg(0)


def stats_line(stats: dict, finish_reason: str | None = None, max_new_tokens: int | None = None) -> str:
    """The one-line summary printed after a run; says so when a limit cut the output."""
    line = (
        f"[sluice] prefill {stats['prefill_tok_s']:.1f} tok/s | decode {stats['decode_tok_s']:.2f} tok/s | "
        f"hit rate {100 * stats['hit_rate']:.1f}% | read {stats['bytes_read'] / 1e9:.2f} GB | "
        f"peak RSS {format_size(stats['peak_rss_bytes'])} (budget {format_size(stats['budget_bytes'])}) | "
        f"cache {stats['cache_slots']}/{stats['total_experts']} experts | "
        f"{'O_DIRECT' if stats['direct_io'] else 'buffered I/O'}"
    )
    if stats.get("disk_tier_hits") or stats.get("disk_tier_misses"):  # memory -> disk tier -> remote
        line += (f" | disk tier {stats['disk_tier_hits']} hits ({stats['disk_tier_bytes_read'] / 1e9:.2f} GB), "
                 f"{stats['disk_tier_misses']} misses, fetched {stats['remote_bytes_read'] / 1e9:.2f} GB")
    from .lossy import summary
    from .text import limit_note

    if summary(stats.get("lossy") or {}):
        line += f" | {summary(stats['lossy'])}"

    cut = limit_note(finish_reason, stats.get("generated_tokens"), max_new_tokens)
    return f"{line} | {cut}" if cut else line


def generate_and_print(engine, prompt, args, echo: str | None = None) -> int:
    """Stream the text to stdout (after ``echo``, the prompt, if given), ending with a newline,
    then the stats line on stderr; with --json one JSON object instead."""
    kwargs = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                  top_k=args.top_k, seed=args.seed, stop=args.stop or None, ignore_eos=args.ignore_eos,
                  speculate=not args.no_speculate)
    if args.json:
        r = engine.generate(prompt, **kwargs)
        print(json.dumps({"model": engine.model_id, "token_ids": r.token_ids, "text": r.text,
                          "finish_reason": r.finish_reason,
                          "stats": r.stats}))
        return 0
    stats, finish = {}, None
    if echo:
        sys.stdout.write(echo)
    for step in engine.stream(prompt, **kwargs):
        sys.stdout.write(step.text_delta)
        sys.stdout.flush()
        if step.finish_reason:
            stats, finish = step.stats, step.finish_reason
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(stats_line(stats, finish, args.max_new_tokens), file=sys.stderr)
    return 0


def cmd_run(args) -> int:
    from . import load

    from contextlib import closing, nullcontext

    from .cli_prompt import precheck

    source = what = None  # a prompt file or stdin: read in pieces bounded by the context
    if args.prompt is None and args.prompt_file is None:
        if sys.stdin.isatty():
            raise SluiceError("give a prompt with --prompt TEXT, --prompt-file FILE, or on stdin")
        source, what = sys.stdin, "stdin"
    elif args.prompt_file is not None:
        what = f"--prompt-file {args.prompt_file}"
        try:
            source = open(args.prompt_file, encoding="utf-8")
        except OSError as e:
            raise InvalidArgumentError(f"{what}: {e.strerror or e}") from None
    prompt = args.prompt
    owned = closing(source) if source is not None and source is not sys.stdin else nullcontext()
    with owned:
        if not args.chat:  # a local model's prompt that cannot fit is refused before the weights load
            got = precheck(args.model, prompt, source=source, what=what, revision=args.revision,
                           max_context=args.max_context)
            if source is not None and got is not None:
                prompt, source = got, None
        # closed however the run ends (an error, ^C): its disk tier is released, not held to process exit
        return _run_loaded(args, load, prompt, source, what)


def _run_loaded(args, load, prompt, source, what) -> int:
    from .cli_prompt import read_source

    with load(args.model, memory=args.memory, revision=args.revision, **engine_options(args)) as engine:
        if source is not None:
            prompt = read_source(source, what, engine.tokenizer, engine.max_context)
        echo = prompt if args.echo else None
        if args.chat:
            if engine.tokenizer is None:
                raise SluiceError(f"{args.model}: no tokenizer, so no chat template")
            text = engine.tokenizer.render_chat([{"role": "user", "content": prompt}])
            prompt = engine.tokenizer.encode(text, add_special_tokens=False)
            echo = text if args.echo else None
            args.stop = list(args.stop or []) + [x for x in engine.tokenizer.chat_stop_strings if x not in args.stop]
        return generate_and_print(engine, prompt, args, echo=echo)


def cmd_inspect(args) -> int:
    from .model_report import inspect_model, render_inspect

    report = inspect_model(args.model, memory=args.memory, max_context=args.max_context, revision=args.revision,
                           ca_bundle=args.ca_bundle, parallel=args.parallel, disk_cache=args.disk_cache,
                           disk_cache_dir=args.disk_cache_dir, progress=True,
                           allow_unversioned_remote=args.allow_unversioned_remote)  # stderr, on a terminal only
    print(json.dumps(report, indent=2) if args.json else render_inspect(report))
    return 0


def cmd_cache(args) -> int:
    from .storage import local_cache

    try:
        got = (local_cache.clear(args.disk_cache_dir, args.model) if args.action == "clear"
               else local_cache.survey(args.disk_cache_dir))
        error = None
    except SluiceError as e:
        got, error = getattr(e, "cache_report", None), e
        if got is None:
            raise
    for note in got.notes:
        print(f"sluice: note: {note}", file=sys.stderr)
    print(json.dumps(got.report, indent=2) if args.json else "\n".join(got.lines))
    for warning in got.warnings:
        print(f"sluice: warning: {warning}", file=sys.stderr)
    if error is not None:
        raise error
    return 0


def cmd_convert(args) -> int:
    from .convert import convert

    out = convert(args.model, args.output, experts=args.experts, spine=args.spine, progress=not args.no_progress,
                  force=args.force, allow_unversioned_remote=args.allow_unversioned_remote)
    print(f"wrote {out}", file=sys.stderr)
    return 0


def cmd_check(args) -> int:
    from .check import check_container

    report = check_container(args.model, progress=not args.no_progress)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for e in report["errors"]:
            print(f"BAD  {e}")
        status = "OK" if report["ok"] else f"{len(report['errors'])} error(s)"
        print(f"{report['path']}: {report['spine_groups']} spine groups, {report['records']} expert records: {status}")
    return 0 if report["ok"] else 1


def cmd_bench(args) -> int:
    from . import bench

    opts = engine_options(args)
    opts.pop("moe_top_k", None)
    opts.pop("prefer_cached", None)
    if args.what == "io":
        report = bench.bench_io(args.model, memory=args.memory, new_tokens=args.tokens, **opts)
    elif args.what == "lossy":
        if args.moe_top_k is None and not args.prefer_cached:
            raise SluiceError("sluice bench lossy needs --moe-top-k N and/or --prefer-cached BIAS")
        report = bench.bench_lossy(args.model, args.prompt, new_tokens=args.tokens, memory=args.memory,
                                   moe_top_k=args.moe_top_k, prefer_cached=args.prefer_cached, **opts)
    else:
        report = bench.bench_spec(args.model, args.prompt, new_tokens=args.tokens, memory=args.memory, **opts)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for key, value in report.items():
        if key in ("stats", "plan"):
            continue
        print(f"{key:>28}: {json.dumps(value) if isinstance(value, (dict, list)) else value}")
    return 0


def cmd_demo(args) -> int:
    from .demo import run_demo

    return run_demo(args, engine_options(args), generate_and_print)


def _sampling_kwargs(args) -> dict:
    return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                top_k=args.top_k, seed=args.seed, stop=args.stop or None, ignore_eos=args.ignore_eos)


def cmd_serve(args) -> int:
    from .server import serve_command

    return serve_command(args, engine_options(args))


def cmd_chat(args) -> int:
    from .chat import chat_command

    return chat_command(args, engine_options(args), _sampling_kwargs(args))

def cmd_trace_replay(args) -> int:
    from .replay import run_cli

    return run_cli(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sluice",
        description="Run Mixture-of-Experts language models larger than memory: the spine stays in memory, "
                    "routed experts stream from disk through a bounded cache. Greedy output matches Hugging Face "
                    "transformers token for token.",
    )
    p.add_argument("--version", action="version", version=f"sluice {__version__}")
    p.add_argument("--debug", action="store_true", help="show the Python traceback of an error")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    r = sub.add_parser("run", help="generate text from a model",
                       description="Generate text, streaming it as it is produced, then print a stats line "
                                   "(prefill and steady-state decode tok/s, expert cache hit rate, bytes read, "
                                   "peak RSS) on stderr. --json prints one JSON object instead.")
    add_model_arg(r)
    r.add_argument("--prompt", "-p", default=None, metavar="TEXT", help="prompt text (or --prompt-file, or stdin)")
    r.add_argument("--prompt-file", default=None, metavar="FILE", help="read the prompt from this file")
    r.add_argument("--chat", action="store_true",
                   help="wrap the prompt as a user message in the chat template (and stop at the model's "
                        "chat_stop_strings, if any)")
    r.add_argument("--echo", action="store_true",
                   help="print the prompt before the generated text (with --chat: the rendered template)")
    r.add_argument("--json", action="store_true",
                   help='print {"model", "token_ids", "text", "finish_reason", "stats"} as one JSON object')
    add_sampling_args(r)
    add_engine_args(r)
    r.set_defaults(func=cmd_run)

    d = sub.add_parser("demo", help="run the shipped trained MoE with a small expert cache (or a large synthetic one)",
                       description="By default runs the small Mixture-of-Experts model that ships with Sluice "
                                   "(Qwen3-MoE layout, trained on Python's standard library) on a Python prompt, "
                                   "with an expert cache that holds a quarter of its experts, and prints the text and "
                                   "the streaming stats. --synthetic SIZE instead writes a random-weight Qwen3-MoE "
                                   "checkpoint of that size into a cache directory once and runs it under a memory "
                                   "budget well below its size (scale runs: the text is meaningless there).")
    d.add_argument("--synthetic", type=_size, default=None, metavar="SIZE",
                   help="run a synthetic random-weight model of about SIZE (e.g. 2GB) instead of the trained one")
    d.add_argument("--family", choices=["qwen3_moe", "mixtral", "deepseek_v4", "qwen4_exp"], default="qwen3_moe",
                   help="with --synthetic: the model's shape (default qwen3_moe; deepseek_v4: hash-routed first "
                        "layers, whose experts are read from the token ids before they run; qwen4_exp: "
                        "Qwen3.8-Flash-Next's n-gram tables, ~0.5 GB of them, read by row from the token ids)")
    d.add_argument("--cache-dir", default=None, help="where synthetic demo models are kept (default ~/.cache/sluice)")
    d.add_argument("--prompt", "-p", default=None, metavar="TEXT",
                   help="prompt text (default 'def fibonacci(n):\\n'; with --synthetic a fixed English sentence)")
    d.add_argument("--json", action="store_true", help="print one JSON object instead of text and a stats line")
    add_sampling_args(d)
    d.set_defaults(max_new_tokens=96)
    add_engine_args(d)
    d.set_defaults(func=cmd_demo)

    c = sub.add_parser("convert", help="pack a Hugging Face directory into a Sluice container",
                       description="Writes a container directory: manifest.json, spine.bin (each layer's spine "
                                   "tensors contiguous and 4096-aligned) and one expert bank per MoE layer with one "
                                   "4096-aligned, CRC-protected record per expert, so one expert is one read. "
                                   "Reads the source tensor by tensor (small memory); writes to OUTPUT.partial "
                                   "and renames when complete.")
    c.add_argument("model", help="Hugging Face model directory, or an s3://, http:// or https:// URL of one (the "
                                 "remote extra); 'demo' and repo ids in the local Hugging Face cache are found too")
    c.add_argument("output", help="container directory to write (an existing container there is replaced only "
                                  "with --force; any other existing path is refused)")
    c.add_argument("--force", action="store_true", help="replace an existing Sluice container at OUTPUT")
    c.add_argument("--experts", default=None, metavar="FORMAT",
                   help="expert format (default: the checkpoint's own, exact): f32, bf16, f16 (casts); "
                        "LOSSY quantized formats: int8 (8 bits/weight, per-row scales), q4 (4.5 bits, groups "
                        "of 32), mxfp4 (4.25 bits, OCP microscaling FP4), rvq3 (3 bits, residual vector "
                        "quantization), fp4 (mxfp4's bytes in DeepSeek-V4's layout); fp8 keeps block-scaled "
                        "FP8 checkpoints as they are. Measured quality "
                        "and speed: docs/quantization.md")
    c.add_argument("--spine", default=None, metavar="FORMAT",
                   help="spine format (default: stored, as the checkpoint has it, exact); LOSSY: int8 stores the "
                        "embedding, the head and every attention / shared-expert / dense projection as int8 with "
                        "one scale per row (norms, biases and routers stay as stored), about a quarter of their "
                        "bytes resident, the rest goes to the expert cache; results are flagged lossy. Quality: "
                        "docs/quantization.md")
    c.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_unversioned_arg(c)
    c.set_defaults(func=cmd_convert)

    k = sub.add_parser("check", help="verify every CRC of a container",
                       description="Reads every spine group and expert record of a container and checks their "
                                   "CRC32 and headers. Exit status 1 if anything is corrupt.")
    k.add_argument("model", help="container directory")
    k.add_argument("--json", action="store_true", help="print the report as JSON")
    k.add_argument("--no-progress", action="store_true", help="no progress bar")
    k.set_defaults(func=cmd_check)

    b = sub.add_parser("bench", help="measure: I/O roofline, lossy switches, speculative decoding",
                       description="io: raw random-read bandwidth at the expert record size, measured in the same "
                                   "run as a cold decode, and the decode speed as a ratio to that I/O roofline with "
                                   "the time split. lossy: greedy agreement with the exact output, teacher-forced "
                                   "top-1 agreement and logit divergence of --moe-top-k / --prefer-cached beside "
                                   "the speedup. spec: decode with and without n-gram speculation (identical "
                                   "tokens required), tokens per forward.")
    b.add_argument("what", choices=["io", "lossy", "spec"], help="what to measure")
    b.add_argument("model", help="Hugging Face model directory or container (or a model named as for sluice run: "
                                 "'demo', a cached repo id, an s3:// or http(s):// URL)")
    b.add_argument("--prompt", "-p", default="def fibonacci(n):\n", metavar="TEXT", help="prompt (lossy, spec)")
    b.add_argument("--tokens", type=int_arg(1), default=64, metavar="N", help="tokens to generate per arm (default 64)")
    b.add_argument("--json", action="store_true", help="print the report as JSON")
    add_engine_args(b)
    b.set_defaults(func=cmd_bench)

    i = sub.add_parser("inspect", help="describe a model: family, sizes, memory floor, cache per budget")
    add_model_arg(i)
    i.add_argument("--memory", type=_size, default=None, metavar="SIZE", help="also show the plan for this budget")
    i.add_argument("--max-context", type=int_arg(1), default=None, metavar="N",
                   help="context the KV cache is sized for")
    i.add_argument("--parallel", type=int_arg(1, 1 << 16), default=None, metavar="N",
                   help="sequences at once, each with KV/state for --max-context (default: min(4, what each budget "
                        "allows))")
    i.add_argument("--json", action="store_true", help="print the report as JSON")
    i.add_argument("--ca-bundle", default=None, metavar="PEM",
                   help="a model at an https:// URL: a PEM file of extra CA certificates to trust")
    add_unversioned_arg(i)
    add_disk_cache_args(i)
    i.set_defaults(func=cmd_inspect)

    dc = sub.add_parser("cache", help="list or clear what Sluice keeps of remote models: the disk tier "
                        "(--disk-cache) and the metadata cache",
                        description="Covers the local disk tier of remote models (--disk-cache-dir, default "
                                    "$XDG_CACHE_HOME/sluice/disk-tier) and the metadata cache (copies of remote "
                                    "models' config, index, manifest, tokenizer files and safetensors headers, "
                                    "$XDG_CACHE_HOME/sluice/meta). list: the tier's entries grouped by model URL, "
                                    "with their sizes and recorded hits, and the totals; the metadata cache's files "
                                    "and bytes. clear: remove every entry and copy, or only MODEL's. Only files "
                                    "they made are removed; a directory that is not a disk tier is refused.")
    dc.add_argument("action", choices=["list", "clear"], help="what to do")
    dc.add_argument("model", nargs="?", default=None,
                    help="clear: only this model's entries and metadata copies (its URL, as listed)")
    dc.add_argument("--disk-cache-dir", default=None, metavar="DIR",
                    help="the disk tier's directory (default $XDG_CACHE_HOME/sluice/disk-tier)")
    dc.add_argument("--json", action="store_true", help="print the report as JSON")
    dc.set_defaults(func=cmd_cache)

    s = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                       description="Serve /v1/models, /v1/completions and /v1/chat/completions (streaming or not), "
                                   "/health and /metrics. Up to --parallel generations run at once, in one batch; "
                                   "more requests wait in a bounded queue (429 beyond it); a growing conversation "
                                   "reuses the KV cache of its previous turn. Needs the server extra: "
                                   "pip install 'sluice[server]'.")
    add_model_arg(s)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int_arg(0, 65535), default=8000, help="port (default 8000)")
    s.add_argument("--api-key", default=os.environ.get("SLUICE_API_KEY"), metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                        "(default: $SLUICE_API_KEY, which keeps the key out of the process list)")
    s.add_argument("--max-queue", type=_count, default=8, metavar="N",
                   help="requests that may wait while --parallel generate; more get 429 (default 8)")
    s.add_argument("--model-name", default=None, metavar="NAME",
                   help="the model id clients send (default: the repo id, 'sluice-demo' for demo, "
                        "else the directory name)")
    s.add_argument("--max-body", type=_size, default=parse_size("4MiB"), metavar="SIZE",
                   help="largest request body (default 4MiB)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="server log level (default info)")
    add_engine_args(s, serving=True)
    s.set_defaults(func=cmd_serve)

    c = sub.add_parser("chat", help="chat with a model in the terminal",
                       description="An interactive chat using the model's own chat template. Replies stream as "
                                   "they are generated; each turn prefills only its new tokens (the previous "
                                   "turn's KV cache is reused). When the conversation outgrows the context, the "
                                   "oldest turns are dropped (with a notice). The model needs a chat template "
                                   "(the demo model has one: sluice chat demo). Commands: /reset, /exit, /help.")
    add_model_arg(c)
    c.add_argument("--system", default=None, metavar="TEXT", help="system message")
    c.add_argument("--no-stats", action="store_true", help="no stats line after each reply")
    add_sampling_args(c)
    c.set_defaults(max_new_tokens=512)
    add_engine_args(c)
    c.set_defaults(func=cmd_chat)

    t = sub.add_parser("trace-replay", help="replay a routing trace through the cache policies and Belady's optimum",
                       description="Replay an expert-routing trace (JSONL, one {\"tok\", \"layers\"} object per "
                                   "decode token) through the engine's cache policies and Belady's optimal policy, "
                                   "and print hit rates per capacity, with one cache per layer and with one global "
                                   "cache of the same total size. See docs/cache-policy.md.")
    t.add_argument("trace", nargs="?", default=None, help="routing trace file (JSONL)")
    t.add_argument("--synthetic", default=None, metavar="SPEC",
                   help="replay a seeded synthetic trace instead, e.g. 'tokens=1000,zipf=1.1,seed=0' "
                        "(fields: layers experts top_k tokens zipf reuse drift segment seed)")
    t.add_argument("--capacity", default=None, metavar="C[,C...]",
                   help="cache sizes in experts per layer (the global cache gets layers x C slots); "
                        "default: 1, 1.5, 2, 3, 4 and 6 times top-k")
    t.add_argument("--policy", action="append", default=None, metavar="SPEC",
                   help="policy to replay, repeatable: lru, lfru, or NAME:KEY=VALUE,... e.g. "
                        "lfru:half_life=32,history=false (default: lru and lfru; Belady is always added)")
    t.add_argument("--scope", choices=["both", "layer", "global"], default="both",
                   help="one cache per layer, one global cache, or both (default)")
    t.add_argument("--semantics", choices=["engine", "sequential"], default="engine",
                   help="engine: a layer's experts are looked up, then pinned while its misses are fetched "
                        "(default); sequential: each access fetched on its own, only it pinned")
    t.add_argument("--predictions", choices=["off", "hint", "prefetch"], default="off",
                   help="for traces that record the lookahead's predictions (--trace-routing writes them): also "
                        "replay each policy with them: hint (the policy hears them, nothing is read ahead) or "
                        "prefetch (read ahead, as the engine does; such a read completes at once in the replay)")
    t.add_argument("--tokens", default=None, metavar="START:STOP", help="replay only these tokens (0-based slice)")
    t.add_argument("--sequence", type=int_arg(0), default=None, metavar="N",
                   help="a trace of several sequences (--parallel): replay only sequence N's rows, as if it ran "
                        "alone (default: every step's rows together, as the engine looked them up)")
    t.add_argument("--pins", default=None, metavar="FILE",
                   help="also replay each policy with these experts pinned (a sluice-pins-v1 file)")
    t.add_argument("--write-pins", default=None, metavar="FILE",
                   help="write the trace's --pin-count most used experts as a pin list")
    t.add_argument("--pin-count", type=int_arg(1), default=None, metavar="N",
                   help="how many experts --write-pins keeps")
    t.add_argument("--json", action="store_true", help="print the results as one JSON object")
    t.set_defaults(func=cmd_trace_replay)
    for sp in sub.choices.values():
        sp.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show the Python traceback of an error")
    return p


EXIT_ERROR = 1  # the run failed: a bad model, file or budget, an I/O error
EXIT_USAGE = 2  # the command line is wrong: a bad flag value (argparse's status too)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status. A user error prints ``sluice: error: ...`` (no
    traceback; ``--debug`` shows one): status 2 for an invalid argument, 1 for anything else."""
    import warnings

    warnings.formatwarning = lambda msg, *a, **k: f"sluice: warning: {msg}\n"
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: usage errors (status 2, message printed), --help, --version
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    if not getattr(args, "command", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("\nsluice: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - every error ends as one line (the traceback with --debug)
        if args.debug:
            raise
        from .storage.urls import mask  # a URL's password and known secrets never reach the terminal

        if isinstance(e, InvalidArgumentError):
            print(f"sluice: error: {mask(str(e))}", file=sys.stderr)
            return EXIT_USAGE
        if isinstance(e, (SluiceError, ValueError, OSError)):
            print(f"sluice: error: {mask(str(e))}", file=sys.stderr)
            return EXIT_ERROR
        print(f"sluice: internal error: {type(e).__name__}: {e} (a bug in sluice, not in your input: "
              "rerun with --debug for the traceback and report it)", file=sys.stderr)
        return EXIT_ERROR
    except (SystemExit, GeneratorExit):
        raise
    except BaseException as e:  # a native library's panic (pyo3's PanicException is a BaseException)
        if args.debug:
            raise
        from .errors import describe_panic

        print(f"sluice: error: {describe_panic(e)}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
