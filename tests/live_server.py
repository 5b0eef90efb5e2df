"""A live OpenAI-compatible server in a background thread of the test process, and the
helpers the server tests share (``tests/server/``, ``tests/hostile/``, ``tests/storage/``)."""

from __future__ import annotations

import socket
import threading

import httpx
import openai

from serve_process import wait_for

MODEL = "tiny-chat"
CTX = 256
# a cache of 6 of the 16 experts: requests really stream experts from disk
# one generation at a time: the queue tests below hold the engine with one request running
ENGINE_KW = dict(memory="2GiB", threads=1, max_context=CTX, cache_experts=6, progress=False, parallel=1)


# -- harness -----------------------------------------------------------------------------------


class Gate:
    """Wraps ``engine.model.forward`` (every forward pass of a step): hold the engine after
    ``allow`` more passes, or make a pass fail."""

    def __init__(self, engine):
        self.model = engine.model
        self.orig = engine.model.forward
        self.cond = threading.Condition()
        self.budget: int | None = None  # None: open
        self.fail_after: int | None = None
        self.fail_with: BaseException | None = None
        self.blocked = 0
        self.model.forward = self._forward

    def _forward(self, *args, **kwargs):
        with self.cond:
            if self.fail_after is not None:
                if self.fail_after == 0:
                    self.fail_after = None
                    raise self.fail_with
                self.fail_after -= 1
            self.blocked += 1
            self.cond.notify_all()
            while self.budget is not None and self.budget <= 0:
                self.cond.wait()
            self.blocked -= 1
            if self.budget is not None:
                self.budget -= 1
        return self.orig(*args, **kwargs)

    def hold(self, allow: int = 0) -> None:
        with self.cond:
            self.budget = allow

    def release(self) -> None:
        with self.cond:
            self.budget = None
            self.cond.notify_all()

    def fail(self, exc: BaseException, after: int = 0) -> None:
        with self.cond:
            self.fail_with, self.fail_after = exc, after

    def remove(self) -> None:
        self.release()
        self.fail_after = None
        self.model.forward = self.orig


class LiveServer:
    """uvicorn serving ``create_app(engine, ...)`` in a thread, on a free loopback port."""

    def __init__(self, engine, **app_kwargs):
        import uvicorn

        from sluice.server.app import create_app

        self.engine = engine
        self.app = create_app(engine, model_name=MODEL, **app_kwargs)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started or not self.thread.is_alive(), what="server start")
        assert self.server.started

    def client(self, **kw) -> openai.OpenAI:
        kw.setdefault("api_key", "none")
        return openai.OpenAI(base_url=self.url + "/v1", max_retries=0, timeout=60, **kw)

    def metrics(self, **headers) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", headers=headers, timeout=10).text
        return parse_metrics(text)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        assert not self.thread.is_alive()


def parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out




def req_key(endpoint: str, status: int) -> str:
    return f'sluice_requests_total{{endpoint="{endpoint}",status="{status}"}}'


def error_of(resp: httpx.Response) -> dict:
    body = resp.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]
