"""Rendering a model's chat template (Jinja, as transformers' ``apply_chat_template`` does).

This module imports nothing of Sluice (nor torch), so it also runs on its own as the
server's template worker process: ``python chat_template.py`` reads render jobs on stdin
and writes results on stdout, each a 4-byte big-endian length and a JSON object. The
server kills that process when a render runs past its time limit (a template is code: a
Python thread running it could not be stopped) and starts a new one.
"""

from __future__ import annotations

import json
from datetime import datetime


class RenderTooLong(Exception):
    """The rendered text passed the character limit given to ``render``."""


def _token_text(v) -> str | None:
    if isinstance(v, dict):
        return v.get("content")
    return v if isinstance(v, str) else None


def special_tokens(config: dict) -> dict[str, str | None]:
    """The ``*_token`` entries of tokenizer_config.json, as the template sees them."""
    return {k: _token_text(v) for k, v in config.items() if isinstance(k, str) and k.endswith("_token")}


def compile_template(template: str):
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(msg):
        raise jinja2.exceptions.TemplateError(msg)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent,
                                                                                  ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render(template, messages: list[dict], add_generation_prompt: bool, special: dict,
           limit: int | None = None) -> str:
    """Render ``messages``; ``template`` is its source or ``compile_template``'s result.

    With ``limit``, stops with ``RenderTooLong`` as soon as the text passes ``limit``
    characters (the template's output is produced piece by piece, never all at once).
    """
    if isinstance(template, str):
        template = compile_template(template)
    kwargs = dict(messages=messages, add_generation_prompt=add_generation_prompt, **special)
    if limit is None:
        return template.render(**kwargs)
    parts, n = [], 0
    for piece in template.generate(**kwargs):
        n += len(piece)
        if n > limit:
            raise RenderTooLong(f"the chat template's output passed {limit} characters")
        parts.append(piece)
    return "".join(parts)


# -- the worker process (run as a script by sluice.server.render) ------------------------------


def _read_frame(f) -> dict | None:
    head = f.read(4)
    if len(head) < 4:
        return None
    n = int.from_bytes(head, "big")
    data = f.read(n)
    if len(data) < n:
        return None
    return json.loads(data)


def write_frame(f, obj: dict) -> None:
    """One frame of the worker protocol: a 4-byte big-endian length, then the JSON object."""
    data = json.dumps(obj, ensure_ascii=False).encode("utf-8", "surrogatepass")
    f.write(len(data).to_bytes(4, "big") + data)
    f.flush()


def _describe(e: BaseException) -> str:
    import jinja2

    if isinstance(e, jinja2.exceptions.TemplateSyntaxError):
        return f"syntax error in line {e.lineno}: {e.message}"
    if isinstance(e, jinja2.exceptions.TemplateError):
        return str(e) or type(e).__name__
    return f"{type(e).__name__}: {e}"


def _die_with_parent() -> None:
    """Linux: be killed when the server goes, even in the middle of a render that never ends."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError, TypeError):
        pass


def _worker_main() -> int:
    import sys

    if sys.platform.startswith("linux"):
        _die_with_parent()
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    import jinja2  # noqa: F401  (imported before saying ready: the parent's time limits are the template's)

    write_frame(stdout, {"ready": True})
    template, special = None, {}
    while True:
        try:
            job = _read_frame(stdin)
        except (ValueError, MemoryError):
            return 1
        if job is None:
            return 0
        try:
            if "template" in job:  # set up: the template, its special tokens, a memory cap
                if job.get("max_memory"):
                    try:
                        import resource

                        cap = int(job["max_memory"])
                        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
                    except (ImportError, ValueError, OSError):
                        pass
                special = job.get("special") or {}
                template = None
                template = compile_template(job["template"])
                write_frame(stdout, {"ok": True})
                continue
            if template is None:
                write_frame(stdout, {"error": "no template", "kind": "template_error"})
                continue
            text = render(template, job["messages"], bool(job.get("add_generation_prompt", True)), special,
                          job.get("limit"))
            write_frame(stdout, {"text": text})
        except RenderTooLong as e:
            write_frame(stdout, {"error": str(e), "kind": "too_long"})
        except MemoryError:
            write_frame(stdout, {"error": "the chat template ran out of memory", "kind": "memory"})
        except RecursionError:
            write_frame(stdout, {"error": "the chat template recursed too deeply", "kind": "template_error"})
        except Exception as e:  # noqa: BLE001  (jinja2 errors, raise_exception(), errors inside the template)
            try:
                write_frame(stdout, {"error": _describe(e), "kind": "template_error"})
            except MemoryError:
                return 1


if __name__ == "__main__":
    raise SystemExit(_worker_main())
