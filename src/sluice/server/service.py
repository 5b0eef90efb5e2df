"""Request preparation: limits, the chat template worker, tokenization, parameters.

Everything a request goes through before it waits for the engine: its body read under a
memory reservation, parsed, checked, rendered (chat, in the template worker process) and
tokenized (in a thread); see ``limits`` for the bounds. ``Service`` also holds what the
routes share: the engine, its scheduler, metrics and the API key.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor

from fastapi import Request
from starlette.requests import ClientDisconnect

from . import limits as L
from . import protocol as P
from .render import RenderError, TemplateWorker
from .serving import APIError, GenParams, Job, Metrics, Scheduler

DEFAULT_MAX_BODY = 4 << 20
PROBE = [{"role": "user", "content": "Hello!"}]  # rendered once at start-up: a template must take it
TEMPLATE_TIMEOUT = 5.0  # seconds one render may take before its worker is killed
BODY_TIMEOUT = 60.0  # seconds a request body may take to arrive (408 beyond)
WAIT_TIMEOUT = 60.0  # seconds a request may wait for request memory (429 beyond)


class ClientGone(Exception):
    """The client went away before its request was read."""


class Service:
    """Everything the routes share: the engine, its scheduler, metrics, limits."""

    def __init__(self, engine, *, model_name: str, api_key: str | None = None, max_queue: int = 8,
                 max_body_bytes: int = DEFAULT_MAX_BODY, reuse_prefix: bool = True,
                 template_timeout: float = TEMPLATE_TIMEOUT, request_memory: int | None = None):
        self.engine = engine
        self.model_name = model_name
        from .bind import check_api_key

        self.api_key = check_api_key(api_key)  # "" is refused, not read as "no key"
        self.max_body_bytes = max_body_bytes
        self.metrics = Metrics(model_name)
        self.scheduler = Scheduler(engine, max_queue, self.metrics, reuse_prefix=reuse_prefix)
        self.token_text = P.TokenText(engine.tokenizer)
        self.created = P.now()
        self.template_timeout = template_timeout
        self.body_timeout = BODY_TIMEOUT
        self.wait_timeout = WAIT_TIMEOUT
        ctx = engine.max_context
        self.vocab = engine.desc.vocab
        tok = engine.tokenizer
        self.longest_token = L.longest_token_chars(tok) if tok is not None else 0
        self.max_prompt_chars = ctx * self.longest_token
        self.max_values = L.MIN_VALUES + ctx
        if request_memory is None:  # half the engine's safety margin under the budget
            plan = getattr(engine, "plan", None)
            request_memory = max(plan.margin_bytes // 2, 16 << 20) if plan is not None else 64 << 20
        self.memory = L.RequestMemory(request_memory)
        self.renderer: TemplateWorker | None = None
        # renders wait for the one worker here, not in the default executor that tokenization uses
        self._render_pool = ThreadPoolExecutor(1, thread_name_prefix="sluice-render")
        self.chat_refused: str | None = None
        if tok is not None and tok.chat_template:
            self._probe_template(tok)

    def _probe_template(self, tok) -> None:
        """Render a one-message conversation: a template that fails it, runs past the time limit or
        leaves no room in the context is refused (chat answers 400 ``chat_template_refused``)."""
        from ..chat_template import special_tokens

        self.renderer = TemplateWorker(tok.chat_template, special_tokens(tok.config))
        why = None
        try:
            text = self.renderer.render(PROBE, limit=self.max_prompt_chars, timeout=self.template_timeout)
            n = len(tok.encode(text, add_special_tokens=False))
            if n >= self.engine.max_context:
                why = (f"it renders a one-message conversation to {n} tokens, which leaves no room in the "
                       f"context of {self.engine.max_context} tokens")
        except RenderError as e:
            why = {"too_long": f"it renders a one-message conversation to more than {self.max_prompt_chars} "
                               "characters, more than the context can hold"}.get(e.kind, str(e))
        if why is not None:
            self.chat_refused = f"this model's chat template was refused at start-up: {why}"
            self.renderer.close()
            self.renderer = None

    def begin_shutdown(self) -> None:
        """Stop taking work (callable from a signal handler): streams end with an error event."""
        self.scheduler.stop()
        if self.renderer is not None:
            self.renderer.interrupt()

    def close(self) -> None:
        self.scheduler.close()
        if self.renderer is not None:
            self.renderer.close()
        self._render_pool.shutdown(wait=False)

    def record(self, endpoint: str, status: int, job: Job | None = None) -> None:
        """Count one answered request (once per job, however its end was noticed)."""
        if job is not None:
            if job.recorded:
                return
            job.recorded = True
        self.metrics.request(endpoint, status)

    # -- request preparation --

    def cost(self, body_bytes: int) -> int:
        """Estimated peak bytes of reading, parsing, rendering and tokenizing a body of this size."""
        ctx = self.engine.max_context
        values = min(self.max_values, body_bytes // 2 + 1)
        text = min(body_bytes, self.max_prompt_chars)
        counting = (L.TOKENIZER_BYTES_PER_CHAR + L.TOKENIZER_BYTES_PER_TOKEN) * min(text, L.COUNT_CHUNK_CHARS)
        tokenize = max(counting, L.TOKENIZER_BYTES_PER_CHAR * text + L.TOKENIZER_BYTES_PER_TOKEN * min(text, 2 * ctx))
        return L.BODY_FACTOR * body_bytes + L.VALUE_BYTES * values + tokenize

    async def read_body(self, request: Request) -> tuple[bytes, int]:
        """The body, read after its estimated cost is reserved; returns (body, bytes reserved)."""
        limit = self.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise APIError(413, f"request body of {length} bytes exceeds the limit of {limit} bytes (--max-body)",
                           code="request_too_large")
        expect = int(length) if length is not None and length.isdigit() else limit
        need = self.cost(expect)
        if need > self.memory.capacity:
            raise APIError(413, f"a request body of {expect} bytes would take ~{need >> 20} MiB to prepare; "
                                f"this server sets aside {self.memory.capacity >> 20} MiB of its --memory budget "
                                "for requests: send a smaller one", code="request_too_large")
        try:
            await asyncio.wait_for(self.memory.acquire(need), self.wait_timeout)
        except asyncio.TimeoutError:
            raise APIError(429, f"the server is busy preparing other requests ({self.memory.used >> 20} of "
                                f"{self.memory.capacity >> 20} MiB of request memory in use); retry later",
                           "rate_limit_error", code="server_busy", headers={"Retry-After": "1"}) from None

        async def read() -> bytes:
            chunks, n = [], 0
            async for chunk in request.stream():
                n += len(chunk)
                if n > limit:
                    raise APIError(413, f"request body exceeds the limit of {limit} bytes (--max-body)",
                                   code="request_too_large")
                chunks.append(chunk)
            return b"".join(chunks)

        try:
            try:
                body = await asyncio.wait_for(read(), self.body_timeout)
            except asyncio.TimeoutError:
                raise APIError(408, f"the request body did not arrive within {self.body_timeout:g} s",
                               code="request_timeout") from None
            values = L.json_values(body, self.max_values)
            if values > self.max_values:
                raise APIError(413, f"request body holds more than {self.max_values} JSON values (strings, numbers, "
                                    "arrays, objects); this server takes at most that many", code="too_many_values")
        except ClientDisconnect:
            self.memory.release(need)
            raise ClientGone() from None
        except BaseException:
            self.memory.release(need)
            raise
        return body, need

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f"the model '{name}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")

    def check_supported(self, req) -> None:
        bad = req.unsupported()
        if bad:
            raise APIError(400, bad[1], param=bad[0], code="unsupported_parameter")

    def check_ids(self, ids: list[int], param: str) -> None:
        bad = next((i for i in ids if not 0 <= i < self.vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} in '{param}' is outside the vocabulary (0..{self.vocab - 1})",
                           param=param, code="invalid_value")

    def _too_long(self, what: str, param: str) -> APIError:
        return APIError(400, f"{what}, more than this server's context of {self.engine.max_context} tokens can "
                             "hold (prompt + completion); shorten it", param=param, code="context_length_exceeded")

    async def tokenize(self, text: str, *, add_special_tokens: bool, param: str) -> list[int]:
        """Token ids of ``text``, computed in a thread; text clearly over the context is refused first."""
        tok = self.engine.tokenizer
        if tok is None:
            raise APIError(400, "this model has no tokenizer: send the prompt as a list of token ids",
                           param=param, code="no_tokenizer")
        if len(text) > self.max_prompt_chars:
            raise self._too_long(f"the prompt has {len(text)} characters (no token of this vocabulary is longer "
                                 f"than {self.longest_token})", param)
        ctx = self.engine.max_context
        if len(text) > L.COUNT_CHUNK_CHARS:
            n = await asyncio.to_thread(L.count_tokens_over, tok, text, 2 * ctx)
            if n > 2 * ctx:
                raise self._too_long(f"the prompt has more than {2 * ctx} tokens", param)
        return await asyncio.to_thread(tok.encode, text, add_special_tokens)

    async def render_chat(self, messages: list[dict]) -> str:
        tok = self.engine.tokenizer
        if tok is None or not tok.chat_template:
            raise APIError(400, f"the model '{self.model_name}' has no chat template (tokenizer_config.json has no "
                                "chat_template): use /v1/completions instead", param="messages",
                           code="no_chat_template")
        if self.chat_refused is not None or self.renderer is None:
            raise APIError(400, f"{self.chat_refused or 'the chat template is not available'}: use /v1/completions "
                                "instead", param="messages", code="chat_template_refused")
        try:
            render = functools.partial(self.renderer.render, messages, limit=self.max_prompt_chars,
                                       timeout=self.template_timeout)
            return await asyncio.get_running_loop().run_in_executor(self._render_pool, render)
        except RenderError as e:
            if e.kind == "too_long":
                raise self._too_long(f"the conversation renders to more than {self.max_prompt_chars} characters",
                                     "messages") from None
            if e.kind == "closed":
                raise APIError(503, "the server is shutting down", "server_error", code="shutting_down") from None
            if e.kind == "worker":
                raise APIError(500, str(e), "server_error", code="chat_template_worker") from None
            code = "chat_template_timeout" if e.kind == "timeout" else "chat_template_error"
            raise APIError(400, f"the chat template refused these messages: {e}", param="messages",
                           code=code) from None

    def params(self, req, prompt_ids: list[int], max_tokens: int | None, n_logprobs: int | None) -> GenParams:
        ctx = self.engine.max_context
        param = "messages" if hasattr(req, "messages") else "prompt"
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", param=param, code="empty_prompt")
        if len(prompt_ids) >= ctx:
            raise APIError(400, f"the prompt has {len(prompt_ids)} tokens, which leaves no room in this server's "
                                f"context of {ctx} tokens (prompt + completion); shorten it", param=param,
                           code="context_length_exceeded")
        if req.stop_token_ids:
            self.check_ids(req.stop_token_ids, "stop_token_ids")
        room = ctx - len(prompt_ids)
        return GenParams(
            prompt_ids=prompt_ids,
            max_new_tokens=min(max_tokens, room) if max_tokens is not None else room,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            seed=req.seed,
            stop=req.stop_list(),
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            logprobs=n_logprobs,
        )
