"""The HTTP side: FastAPI routes of the OpenAI-compatible API, SSE streaming, auth, limits.

Built on the public engine API only: requests become ``GenParams`` (prompt token ids plus
``Engine.stream`` arguments), run by the ``Scheduler``'s worker thread; this module turns
the steps it posts into OpenAI responses or server-sent events.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..engine import Step
from . import protocol as P
from . import webchat
from .serving import APIError, Failed, GenParams, Job, QueueFull, ShuttingDown, error_for_exception
from .service import DEFAULT_MAX_BODY, TEMPLATE_TIMEOUT, ClientGone, Service

log = logging.getLogger("sluice.server")

CLIENT_CLOSED = 499  # status recorded (never sent) when the client went away first


# -- response formatting -----------------------------------------------------------------------


class _Format:
    """Accumulates steps of one generation and renders OpenAI objects (whole or chunked)."""

    chunk_object = ""

    def __init__(self, service: Service, params: GenParams, id_prefix: str, include_usage: bool):
        self.s = service
        self.params = params
        self.id = P.new_id(id_prefix)
        self.created = P.now()
        self.include_usage = include_usage
        self.text: list[str] = []
        self.lps: list[tuple[int, float, list | None]] = []
        self.offsets: list[int] = []
        self.length = 0
        self.finish: str | None = None
        self.stats: dict = {}
        self.tokens = 0

    def add(self, step: Step) -> None:
        self.tokens += 1
        if self.params.logprobs is not None:
            self.lps.append((step.token_id, step.logprob, step.top_logprobs))
            self.offsets.append(self.length)
        self.text.append(step.text_delta)
        self.length += len(step.text_delta)
        if step.finish_reason:
            self.finish, self.stats = step.finish_reason, step.stats

    def usage(self) -> dict:
        return P.usage(len(self.params.prompt_ids), self.tokens, self.stats)

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.s.model_name}


class CompletionFormat(_Format):
    chunk_object = "text_completion"

    def __init__(self, service, params, include_usage, echo_text: str = ""):
        super().__init__(service, params, "cmpl", include_usage)
        self.echo = echo_text
        self.length = len(echo_text)

    def _lp(self, lps, offsets):
        return P.completion_logprobs(lps, offsets, self.s.token_text) if self.params.logprobs is not None else None

    def response(self) -> dict:
        return {**self._head("text_completion"), "choices": [{
            "index": 0, "text": self.echo + "".join(self.text), "logprobs": self._lp(self.lps, self.offsets),
            "finish_reason": self.finish}], "usage": self.usage()}

    def _chunk(self, text: str, lps, offsets, finish=None) -> dict:
        c = {**self._head(self.chunk_object), "choices": [{
            "index": 0, "text": text, "logprobs": self._lp(lps, offsets), "finish_reason": finish}]}
        if self.include_usage:
            c["usage"] = None
        return c

    def first_chunks(self) -> list[dict]:
        return [self._chunk(self.echo, [], [])] if self.echo else []

    def step_chunks(self, step: Step) -> list[dict]:
        n = len(self.lps)
        self.add(step)
        if not step.text_delta and self.params.logprobs is None and not step.finish_reason:
            return []  # text held back (partial character, possible stop string): nothing to say yet
        return [self._chunk(step.text_delta, self.lps[n:], self.offsets[n:], step.finish_reason)]


class ChatFormat(_Format):
    chunk_object = "chat.completion.chunk"

    def _lp(self, lps):
        return P.chat_logprobs(lps, self.s.token_text) if self.params.logprobs is not None else None

    def response(self) -> dict:
        return {**self._head("chat.completion"), "choices": [{
            "index": 0, "message": {"role": "assistant", "content": "".join(self.text), "refusal": None},
            "logprobs": self._lp(self.lps), "finish_reason": self.finish}], "usage": self.usage()}

    def _chunk(self, delta: dict, lps, finish=None) -> dict:
        c = {**self._head(self.chunk_object), "choices": [{
            "index": 0, "delta": delta, "logprobs": self._lp(lps) if lps else None, "finish_reason": finish}]}
        if self.include_usage:
            c["usage"] = None
        return c

    def first_chunks(self) -> list[dict]:
        return [self._chunk({"role": "assistant", "content": ""}, [])]

    def step_chunks(self, step: Step) -> list[dict]:
        n = len(self.lps)
        self.add(step)
        out = []
        if step.text_delta or self.lps[n:]:
            out.append(self._chunk({"content": step.text_delta}, self.lps[n:]))
        if step.finish_reason:
            out.append(self._chunk({}, [], step.finish_reason))
        return out


def _usage_chunk(fmt: _Format, obj: str) -> dict:
    return {**fmt._head(obj), "choices": [], "usage": fmt.usage()}


# -- HTTP plumbing -----------------------------------------------------------------------------


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(P.error_body(e.message, e.type, e.param, e.code), status_code=e.status, headers=e.headers)


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class _EventStream(StreamingResponse):
    """A streaming response that runs ``on_close`` however it ends (finished, disconnected, cancelled)."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _watch_disconnect(request: Request, job: Job, service: Service) -> None:
    """Cancel ``job`` (in the queue or running) as soon as the client goes away."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.disconnected = True
            service.scheduler.cancel(job)
            service.record(job.endpoint, CLIENT_CLOSED, job)
            return


def create_app(engine, *, model_name: str, api_key: str | None = None, max_queue: int = 8,
               max_body_bytes: int = DEFAULT_MAX_BODY, reuse_prefix: bool = True,
               template_timeout: float = TEMPLATE_TIMEOUT, request_memory: int | None = None) -> FastAPI:
    """The ASGI app serving ``engine``. Starts its engine worker on startup, stops it on shutdown.

    A chat template is probed here (``app.state.service.chat_refused`` says why it was refused).
    """
    from contextlib import asynccontextmanager

    service = Service(engine, model_name=model_name, api_key=api_key, max_queue=max_queue,
                      max_body_bytes=max_body_bytes, reuse_prefix=reuse_prefix, template_timeout=template_timeout,
                      request_memory=request_memory)

    @asynccontextmanager
    async def lifespan(app):
        service.scheduler.start()
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, service.close)

    app = FastAPI(title="Sluice", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.service = service

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return _error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        msg = f"{request.method} {request.url.path}: {e.detail}"
        return _error_response(APIError(e.status_code, msg, code=code))

    @app.exception_handler(Exception)
    async def _internal(request, e: Exception):
        log.exception("internal error")
        return _error_response(APIError(500, f"internal error: {type(e).__name__}", "server_error"))

    def authorize(request: Request) -> None:
        if service.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), service.api_key.encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           "authentication_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    def parse(model_cls, body: bytes):
        try:
            return model_cls.model_validate_json(body or b"")
        except ValidationError as e:
            msg, param = P.validation_message(e)
            raise APIError(400, msg, param=param, code="invalid_value" if param else "invalid_json") from None

    async def run(request: Request, endpoint: str, params: GenParams, fmt: _Format, stream: bool) -> Response:
        """Queue the generation; answer it whole, or as server-sent events."""
        job = Job(params, asyncio.get_running_loop(), endpoint)
        request.state.job = job
        try:
            service.scheduler.submit(job)
        except QueueFull:
            waiting, _ = service.scheduler.depth()
            raise APIError(429, f"the server is busy: one generation running and {waiting} waiting "
                                f"(--max-queue {service.scheduler.max_queue}); retry later",
                           "rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(service.scheduler.retry_after())}) from None
        except ShuttingDown:
            raise APIError(503, "the server is shutting down", "server_error", code="shutting_down") from None
        watcher = asyncio.create_task(_watch_disconnect(request, job, service))

        def settle(ev) -> Step | None:
            """The step an event brings, or raise the error it stands for; None if the client went away."""
            if isinstance(ev, Step):
                return ev
            if isinstance(ev, Failed):
                raise error_for_exception(ev.error)
            if job.disconnected:
                return None
            raise APIError(503, "the server is shutting down", "server_error", code="shutting_down")

        try:
            step = settle(await job.events.get())  # for a stream too: errors before the first token get a status
            if step is not None and not stream:
                while True:
                    fmt.add(step)
                    if step.finish_reason:
                        break
                    step = settle(await job.events.get())
                    if step is None:
                        break
        except BaseException:
            service.scheduler.cancel(job)
            raise
        finally:
            watcher.cancel()
        if step is None:
            service.record(endpoint, CLIENT_CLOSED, job)
            return Response(status_code=CLIENT_CLOSED)  # nobody is listening
        if not stream:
            service.record(endpoint, 200, job)
            return JSONResponse(fmt.response())
        return _stream(endpoint, job, fmt, step)

    def _stream(endpoint: str, job: Job, fmt: _Format, first: Step) -> Response:
        obj = fmt.chunk_object
        outcome = {"status": None}

        async def events():
            for c in fmt.first_chunks():
                yield _sse(c)
            ev = first
            while True:
                if isinstance(ev, Step):
                    for c in fmt.step_chunks(ev):
                        yield _sse(c)
                    if ev.finish_reason:
                        if fmt.include_usage:
                            yield _sse(_usage_chunk(fmt, obj))
                        yield b"data: [DONE]\n\n"
                        outcome["status"] = 200
                        return
                else:
                    if isinstance(ev, Failed):
                        err = error_for_exception(ev.error)
                    else:
                        err = APIError(503, "the server is shutting down", "server_error", code="shutting_down")
                    yield _sse(P.error_body(err.message, err.type, err.param, err.code))
                    yield b"data: [DONE]\n\n"
                    outcome["status"] = err.status
                    return
                ev = await job.events.get()

        def on_close():
            status = outcome["status"]
            if status is None:  # the client went away (or the server is stopping) mid-stream
                job.disconnected = True
                service.scheduler.cancel(job)
                status = CLIENT_CLOSED
            service.record(endpoint, status, job)

        return _EventStream(events(), on_close)

    async def guarded(request: Request, endpoint: str, handler) -> Response:
        """Record errors answered before a generation starts."""
        try:
            return await handler()
        except ClientGone:  # left mid-upload: nobody to answer
            service.record(endpoint, CLIENT_CLOSED, getattr(request.state, "job", None))
            return Response(status_code=CLIENT_CLOSED)
        except APIError as e:
            service.record(endpoint, e.status, getattr(request.state, "job", None))
            raise
        except Exception:
            service.record(endpoint, 500, getattr(request.state, "job", None))
            raise

    # -- routes --

    @app.get("/")
    async def chat_page():
        """The browser chat page; it needs no API key (it asks for one when the API answers 401)."""
        body, headers = webchat.page()
        return Response(body, media_type="text/html; charset=utf-8", headers=headers)

    async def chat_script(request: Request):
        """The chat page's scripts (no API key either)."""
        body, headers = webchat.script(request.url.path.rsplit("/", 1)[-1])
        return Response(body, media_type="text/javascript; charset=utf-8", headers=headers)

    for name in webchat.SCRIPTS:
        app.add_api_route("/" + name, chat_script, methods=["GET"], include_in_schema=False)

    @app.get("/health")
    async def health():
        waiting, running = service.scheduler.depth()
        ok = service.scheduler.alive
        body = {"status": "ok" if ok else "unavailable", "model": service.model_name, "queue_depth": waiting,
                "running": running, "max_queue": service.scheduler.max_queue}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics(request: Request):
        authorize(request)
        waiting, running = service.scheduler.depth()
        totals = service.engine.totals() if hasattr(service.engine, "totals") else None
        workers = getattr(service.engine.experts, "worker_counters", None)  # experts on Ray workers
        text = service.metrics.render(waiting, running, service.scheduler.max_queue, batch=service.scheduler.batch(),
                                      parallel=service.scheduler.parallel, totals=totals,
                                      workers=workers() if workers is not None else None)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card() -> dict:
        return {"id": service.model_name, "object": "model", "created": service.created, "owned_by": "sluice",
                "max_model_len": service.engine.max_context}

    @app.get("/v1/models")
    async def list_models(request: Request):
        authorize(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(request: Request, model_id: str):
        authorize(request)
        service.check_model(model_id)
        return model_card()

    async def prepare(request: Request, model_cls, build):
        """Read and parse the body under its memory reservation; ``build(req)`` -> (params, format, stream)."""
        authorize(request)
        body, reserved = await service.read_body(request)
        try:
            req = parse(model_cls, body)
            del body
            service.check_model(req.model)
            service.check_supported(req)
            return await build(req)
        finally:
            service.memory.release(reserved)

    async def build_completion(req):
        try:
            prompt = req.single_prompt()
        except ValueError as e:
            raise APIError(400, str(e), param="prompt", code="unsupported_parameter") from None
        if isinstance(prompt, str):
            ids = await service.tokenize(prompt, add_special_tokens=True, param="prompt") if prompt else []
            echo = prompt
        else:
            ids = list(prompt)
            service.check_ids(ids, "prompt")
            echo = service.engine.decode(ids) if req.echo and len(ids) < service.engine.max_context else ""
        params = service.params(req, ids, req.max_tokens, req.logprobs)
        include_usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)
        return params, CompletionFormat(service, params, include_usage, echo if req.echo else ""), req.stream

    async def build_chat(req):
        try:
            messages = [m.for_template() for m in req.messages]
        except ValueError as e:
            raise APIError(400, str(e), param="messages", code="unsupported_parameter") from None
        text = await service.render_chat(messages)
        del messages
        ids = await service.tokenize(text, add_special_tokens=False, param="messages")
        params = service.params(req, ids, req.max_new_tokens(), req.n_logprobs())
        # the chat format's own end-of-reply text (tokenizer_config.json "chat_stop_strings")
        params.stop += [x for x in service.engine.tokenizer.chat_stop_strings if x not in params.stop]
        include_usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)
        return params, ChatFormat(service, params, "chatcmpl", include_usage), req.stream

    @app.post("/v1/completions")
    async def completions(request: Request):
        async def handle():
            params, fmt, stream = await prepare(request, P.CompletionRequest, build_completion)
            return await run(request, "completions", params, fmt, stream)

        return await guarded(request, "completions", handle)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        async def handle():
            params, fmt, stream = await prepare(request, P.ChatCompletionRequest, build_chat)
            return await run(request, "chat_completions", params, fmt, stream)

        return await guarded(request, "chat_completions", handle)

    return app


def serve(engine, *, host: str = "127.0.0.1", port: int = 8000, model_name: str, api_key: str | None = None,
          max_queue: int = 8, max_body_bytes: int = DEFAULT_MAX_BODY, log_level: str = "info",
          sock=None) -> None:
    """Serve ``engine`` until interrupted (blocking); ``sock``: an already listening socket
    (``bind.bind``) to serve on instead of binding ``host:port``."""
    import sys

    import uvicorn

    from ..storage.interrupt import interrupt_reads, resume_reads

    app = create_app(engine, model_name=model_name, api_key=api_key, max_queue=max_queue,
                     max_body_bytes=max_body_bytes)
    service: Service = app.state.service
    if service.chat_refused:
        print(f"sluice: warning: {service.chat_refused}; /v1/chat/completions answers 400 "
              "(chat_template_refused), /v1/completions works", file=sys.stderr)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # SIGINT/SIGTERM: end open streams (error event, [DONE]) at once
            interrupt_reads("the server is shutting down")  # remote reads in flight stop too (storage/interrupt.py)
            service.begin_shutdown()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    # uvicorn shuts down gracefully on SIGTERM, then raises it again: stop here instead of dying by it
    import signal
    import threading

    class _Terminated(BaseException):
        pass

    def _terminated(sig, frame):
        raise _Terminated()

    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminated) if main else None
    try:
        Server(config).run(sockets=[sock] if sock is not None else None)
    except _Terminated:
        pass
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
        resume_reads()
