"""``sluice chat``: an interactive terminal chat with the model's own chat template.

Each turn renders the whole conversation with the template and generates with
``reuse_prefix=True``, so only the new tokens of a turn are prefilled: the KV cache of the
previous turn (its prompt and the reply) is kept. Replies stream as they are generated.
Commands: ``/reset`` (new conversation), ``/exit`` (or end of input), ``/help``.
Ctrl-C during a reply stops that reply and keeps the conversation as it was before it.
"""

from __future__ import annotations

import sys
from typing import TextIO

from .errors import SluiceError

HELP = "commands: /reset (start a new conversation), /exit (quit), /help"


def turn_stats_line(stats: dict) -> str:
    return (f"[sluice] prompt {stats['prompt_tokens']} tokens ({stats['reused_prefix_tokens']} reused) | "
            f"generated {stats['generated_tokens']} | prefill {stats['prefill_tok_s']:.1f} tok/s | "
            f"decode {stats['decode_tok_s']:.2f} tok/s | hit rate {100 * stats['hit_rate']:.1f}%")


def chat_loop(engine, *, system: str | None = None, gen_kwargs: dict | None = None, stdin: TextIO = sys.stdin,
              stdout: TextIO = sys.stdout, stderr: TextIO = sys.stderr, prompt: str | None = None,
              show_stats: bool = True) -> int:
    """Run the conversation until ``/exit`` or end of input. ``prompt`` is shown before each user line."""
    tok = engine.tokenizer
    if tok is None or not tok.chat_template:
        raise SluiceError(f"{engine.path}: this model has no chat template (tokenizer_config.json has no "
                          "chat_template); use `sluice run` instead")
    gen_kwargs = dict(gen_kwargs or {})
    base = [{"role": "system", "content": system}] if system else []
    messages = list(base)
    print(f"[sluice] chatting with {engine.path.name} ({HELP})", file=stderr, flush=True)
    while True:
        try:
            if prompt is not None and stdin is sys.stdin and stdout is sys.stdout:
                line = input(prompt) + "\n"  # line editing (readline) in a terminal
            else:
                if prompt:
                    stdout.write(prompt)
                    stdout.flush()
                line = stdin.readline()
        except EOFError:
            line = ""
        except KeyboardInterrupt:
            stdout.write("\n")
            break
        if not line:  # end of input
            break
        text = line.rstrip("\n")
        command = text.strip()
        if not command:
            continue
        if command in ("/exit", "/quit"):
            break
        if command == "/reset":
            messages = list(base)
            print("[sluice] new conversation", file=stderr, flush=True)
            continue
        if command == "/help" or (command.startswith("/") and " " not in command):
            print(f"[sluice] {HELP}", file=stderr, flush=True)
            continue
        turn = messages + [{"role": "user", "content": text}]
        ids = tok.encode(tok.render_chat(turn, add_generation_prompt=True), add_special_tokens=False)
        if len(ids) >= engine.max_context:
            print(f"[sluice] the conversation ({len(ids)} tokens) no longer fits the context of "
                  f"{engine.max_context} tokens: /reset to start a new one", file=stderr, flush=True)
            continue
        reply, stats = [], {}
        gen = engine.stream(ids, reuse_prefix=True, **gen_kwargs)
        try:
            for step in gen:
                reply.append(step.text_delta)
                stdout.write(step.text_delta)
                stdout.flush()
                if step.finish_reason:
                    stats = step.stats
        except KeyboardInterrupt:
            gen.close()
            stdout.write("\n")
            print("[sluice] reply interrupted (not kept in the conversation)", file=stderr, flush=True)
            continue
        stdout.write("\n")
        stdout.flush()
        messages = turn + [{"role": "assistant", "content": "".join(reply)}]
        if show_stats and stats:
            print(turn_stats_line(stats), file=stderr, flush=True)
    return 0


def chat_command(args, engine_options: dict, gen_kwargs: dict) -> int:
    from . import load

    engine = load(args.model, memory=args.memory, **engine_options)
    interactive = sys.stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
    try:
        return chat_loop(engine, system=args.system, gen_kwargs=gen_kwargs, prompt="> " if interactive else None,
                         show_stats=not args.no_stats)
    finally:
        engine.close()
