"""``sluice chat``: an interactive terminal chat with the model's own chat template.

Each turn renders the whole conversation with the template and generates with
``reuse_prefix=True``, so only the new tokens of a turn are prefilled: the KV cache of the
previous turn (its prompt and the reply) is kept. Replies stream as they are generated.
Commands: ``/reset`` (new conversation), ``/exit`` (or end of input), ``/help``.
Ctrl-C during a reply stops that reply and keeps the conversation as it was before it.
When the conversation no longer fits the context, ``trim_conversation`` drops its oldest
turns (the chat says so); a model's ``chat_stop_strings`` end its replies.
"""

from __future__ import annotations

import sys
from typing import TextIO

from .errors import SluiceError

HELP = "commands: /reset (start a new conversation), /exit (quit), /help"


class ConversationTooLong(SluiceError):
    """Even the newest message alone does not leave room for a reply in the context."""


def reply_room(max_context: int, max_new_tokens: int | None = None) -> int:
    """Tokens kept free for the reply when trimming: max_new_tokens, at most a quarter of the context."""
    quarter = max(1, max_context // 4)
    return quarter if max_new_tokens is None else max(1, min(max_new_tokens, quarter))


def trim_conversation(tokenizer, messages: list[dict], max_prompt_tokens: int,
                      add_generation_prompt: bool = True) -> tuple[list[dict], list[int], int]:
    """Drop the oldest turns of ``messages`` until the rendered prompt has at most ``max_prompt_tokens``.

    Leading system messages are always kept; a turn is a user message and everything after it up to
    the next user message, and the newest turn is never dropped. Returns ``(kept messages, their
    prompt token ids, how many messages were dropped)``. Raises ``ConversationTooLong`` when the
    system messages and the newest turn alone do not fit.
    """
    def encode(msgs: list[dict]) -> list[int]:
        return tokenizer.encode(tokenizer.render_chat(msgs, add_generation_prompt=add_generation_prompt),
                                add_special_tokens=False)

    n_system = 0
    while n_system < len(messages) and messages[n_system].get("role") == "system":
        n_system += 1
    system, rest = list(messages[:n_system]), list(messages[n_system:])
    starts = [i for i, m in enumerate(rest) if m.get("role") == "user"] or [0]
    if starts[0] != 0:
        starts.insert(0, 0)
    for cut in starts:
        kept = system + rest[cut:]
        ids = encode(kept)
        if len(ids) <= max_prompt_tokens:
            return kept, ids, cut
    raise ConversationTooLong(f"the newest message alone needs {len(ids)} prompt tokens, more than the "
                              f"{max_prompt_tokens} this context leaves beside room for a reply")


def turn_stats_line(stats: dict, finish_reason: str | None = None, max_new_tokens: int | None = None) -> str:
    from .text import limit_note

    line = (f"[sluice] prompt {stats['prompt_tokens']} tokens ({stats['reused_prefix_tokens']} reused) | "
            f"generated {stats['generated_tokens']} | prefill {stats['prefill_tok_s']:.1f} tok/s | "
            f"decode {stats['decode_tok_s']:.2f} tok/s | hit rate {100 * stats['hit_rate']:.1f}%")
    cut = limit_note(finish_reason, stats.get("generated_tokens"), max_new_tokens)
    return f"{line} | {cut}" if cut else line


def chat_loop(engine, *, system: str | None = None, gen_kwargs: dict | None = None, stdin: TextIO | None = None,
              stdout: TextIO | None = None, stderr: TextIO | None = None, prompt: str | None = None,
              show_stats: bool = True, name: str | None = None) -> int:
    """Run the conversation until ``/exit`` or end of input. ``prompt`` is shown before each user line.

    ``stdin``/``stdout``/``stderr`` default to the process's streams as they are at the call."""
    stdin = sys.stdin if stdin is None else stdin
    stdout = sys.stdout if stdout is None else stdout
    stderr = sys.stderr if stderr is None else stderr
    tok = engine.tokenizer
    if tok is None or not tok.chat_template:
        raise SluiceError(f"{engine.path}: this model has no chat template (no chat_template.jinja, and "
                          "tokenizer_config.json has no chat_template); use `sluice run` instead")
    gen_kwargs = dict(gen_kwargs or {})
    stops = list(gen_kwargs.pop("stop", None) or [])
    stops += [x for x in tok.chat_stop_strings if x not in stops]
    room = reply_room(engine.max_context, gen_kwargs.get("max_new_tokens"))
    base = [{"role": "system", "content": system}] if system else []
    messages = list(base)
    name = name or getattr(engine, "model_id", None) or engine.path.name
    print(f"[sluice] chatting with {name}, context {engine.max_context} tokens ({HELP})", file=stderr, flush=True)
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
        try:
            turn, ids, dropped = trim_conversation(tok, messages + [{"role": "user", "content": text}],
                                                   engine.max_context - room)
        except ConversationTooLong as e:
            print(f"[sluice] {e} (context {engine.max_context} tokens): not sent; write a shorter message",
                  file=stderr, flush=True)
            continue
        if dropped:
            print(f"[sluice] the conversation no longer fits the context of {engine.max_context} tokens: "
                  f"dropped its oldest {dropped} message{'s' if dropped != 1 else ''}", file=stderr, flush=True)
        reply, stats, finish = [], {}, None
        gen = engine.stream(ids, reuse_prefix=True, stop=stops or None, **gen_kwargs)
        try:
            for step in gen:
                reply.append(step.text_delta)
                stdout.write(step.text_delta)
                stdout.flush()
                if step.finish_reason:
                    stats, finish = step.stats, step.finish_reason
        except KeyboardInterrupt:
            gen.close()
            stdout.write("\n")
            print("[sluice] reply interrupted (not kept in the conversation)", file=stderr, flush=True)
            continue
        stdout.write("\n")
        stdout.flush()
        messages = turn + [{"role": "assistant", "content": "".join(reply)}]
        if show_stats and stats:
            print(turn_stats_line(stats, finish, gen_kwargs.get("max_new_tokens")), file=stderr, flush=True)
    return 0


def chat_command(args, engine_options: dict, gen_kwargs: dict) -> int:
    from . import load

    engine = load(args.model, memory=args.memory, revision=args.revision, **engine_options)
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
