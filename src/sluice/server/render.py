"""Chat templates rendered in a worker process that is killed at a time limit.

A chat template is code that comes with the model: a loop of ``range(100000)`` inside
another runs for hours, and a Python thread running it can neither be stopped nor let the
event loop go. So templates run in one small persistent process (``python
chat_template.py``: the standard library and jinja2, not torch), one render at a time. A
render past ``timeout`` seconds kills the process; the next render starts a new one. The
process also has a cap on its address space (``RLIMIT_AS``) and every render a cap on
the characters it may output.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

from .. import chat_template

WORKER = Path(chat_template.__file__)
START_TIMEOUT = 30.0  # seconds for a new worker to be ready (python + jinja2 imported)
WORKER_MEMORY = 256 << 20  # the worker's address-space cap (its resident size stays far below)


class RenderError(Exception):
    """A render failed. ``kind``: template_error, too_long, memory, timeout, worker, closed."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


class TemplateWorker:
    """One worker process running one template; ``render`` is blocking and thread-safe."""

    def __init__(self, template: str, special: dict, *, max_memory: int = WORKER_MEMORY):
        self.template = template
        self.special = special
        self.max_memory = max_memory
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._closed = False
        self.restarts = 0  # workers killed (time limit) or lost

    # -- process management --

    def _start(self, timeout: float) -> None:
        """A new worker: started (``START_TIMEOUT``), then set up with the template (``timeout``:
        compiling is the template's work too)."""
        args = [sys.executable]
        if sys.version_info >= (3, 11):
            args.append("-P")  # not the script's folder on sys.path: nothing of Sluice shadows the stdlib
        args.append(str(WORKER))
        self._proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, close_fds=True)
        try:
            self._receive(START_TIMEOUT, "starting the chat template worker")  # {"ready": true}
        except RenderError as e:
            raise RenderError(f"the chat template worker did not start: {e}", "worker") from None
        reply = self._exchange({"template": self.template, "special": self.special, "max_memory": self.max_memory},
                               timeout, "compiling the chat template")
        if "error" in reply:
            self._kill()
            raise RenderError(reply["error"], reply.get("kind", "template_error"))

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            proc.kill()
        except OSError:
            pass
        proc.wait()
        for f in (proc.stdin, proc.stdout):
            try:
                f.close()
            except OSError:
                pass

    def interrupt(self) -> None:
        """Refuse further renders and kill the worker without waiting (signal-safe); a render in
        progress ends with ``RenderError(kind="closed")``."""
        self._closed = True
        proc = self._proc
        if proc is not None:
            try:
                proc.kill()  # a render waiting on it sees end-of-file at once
            except OSError:
                pass

    def close(self) -> None:
        self.interrupt()
        with self._lock:
            self._kill()

    # -- one exchange --

    def _exchange(self, job: dict, timeout: float, what: str = "rendering the chat template") -> dict:
        try:
            chat_template.write_frame(self._proc.stdin, job)
        except (OSError, ValueError, AttributeError):
            raise self._lost() from None
        return self._receive(timeout, what)

    def _receive(self, timeout: float, what: str) -> dict:
        """The worker's next reply; kills it past ``timeout`` seconds."""
        import json

        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        buf = bytearray()
        need = 4
        size = None
        while len(buf) < need:
            left = deadline - time.monotonic()
            if left <= 0:
                self.restarts += 1
                self._kill()
                if self._closed:
                    raise RenderError("the server is shutting down", "closed")
                raise RenderError(f"{what} took more than {timeout:g} s; stopped", "timeout")
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            try:
                chunk = os.read(fd, max(need - len(buf), 1 << 16))
            except OSError:
                chunk = b""
            if not chunk:
                raise self._lost()
            buf += chunk
            if size is None and len(buf) >= 4:
                size = int.from_bytes(buf[:4], "big")
                need = 4 + size
        return json.loads(bytes(buf[4:need]))

    def _lost(self) -> RenderError:
        proc = self._proc
        status = proc.poll() if proc is not None else None
        self.restarts += 1
        self._kill()
        if self._closed:
            return RenderError("the server is shutting down", "closed")
        return RenderError(f"the chat template worker exited (status {status}) while rendering", "worker")

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True, limit: int | None = None,
               timeout: float = 5.0) -> str:
        with self._lock:
            if self._closed:
                raise RenderError("the server is shutting down", "closed")
            if self._proc is None or self._proc.poll() is not None:
                self._kill()
                self._start(timeout)
            reply = self._exchange({"messages": messages, "add_generation_prompt": add_generation_prompt,
                                    "limit": limit}, timeout)
        if "error" in reply:
            raise RenderError(reply["error"], reply.get("kind", "template_error"))
        return reply["text"]
