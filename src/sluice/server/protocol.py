"""OpenAI wire format: request models (validated strictly) and response builders.

Requests are parsed with ``strict=True``: a string where a number belongs is a 400, not a
silent conversion. Unknown fields are ignored (clients send many), but fields whose
non-default value would change the output and that Sluice does not implement
(``n > 1``, penalties, ``logit_bias``, tools, ...) are refused with a 400 naming the field.
Extensions beyond the OpenAI API: ``top_k``, ``ignore_eos``, ``stop_token_ids``.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..validate import MAX_SEED as SEED_MAX  # the API's own limits: what the sampler's generator accepts
from ..validate import MIN_SEED as SEED_MIN
from ..validate import MAX_LOGPROBS, MIN_TEMPERATURE

MAX_STOP = 16
MAX_STOP_CHARS = 1024  # per stop string: held-back text is matched against it at every token
MAX_STOP_TOKEN_IDS = 1024


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingRequest(_Strict):
    """Fields common to completions and chat completions."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)  # extension (0 disables)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension
    ignore_eos: bool = False  # extension
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if isinstance(v, list) and len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        for s in [v] if isinstance(v, str) else (v or []):
            if len(s) > MAX_STOP_CHARS:
                raise ValueError(f"a stop string of {len(s)} characters; at most {MAX_STOP_CHARS}")
        return v

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v):
        if v is not None and 0 < v < MIN_TEMPERATURE:
            raise ValueError(f"{v!r} is too small to sample with: use 0 (greedy) or at least {MIN_TEMPERATURE:g}")
        return v

    @field_validator("seed")
    @classmethod
    def _seed(cls, v):
        if v is not None and not SEED_MIN <= v <= SEED_MAX:
            raise ValueError(f"{v} is out of range: a seed is between -2**63 and 2**64 - 1")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids(cls, v):
        if v is not None and len(v) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"{len(v)} stop token ids; at most {MAX_STOP_TOKEN_IDS}")
        return v

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) for a requested feature Sluice does not implement, else None."""
        if self.n != 1:
            return "n", f"n={self.n} is not supported: Sluice returns one choice per request (n=1)"
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                return name, f"{name} is not supported (only 0 or absent)"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        return None


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self):
        if self.suffix:
            return "suffix", "suffix (insertion) is not supported"
        if self.best_of not in (None, 1):
            return "best_of", "best_of other than 1 is not supported"
        if self.echo and self.logprobs is not None:
            return "echo", "echo together with logprobs (prompt log-probabilities) is not supported"
        return super().unsupported()

    def single_prompt(self) -> str | list[int]:
        """The one prompt of the request; batches of several prompts are refused."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ValueError("batched prompts are not supported: send one prompt per request")
            return p[0]
        return p


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # name, tool_call_id, ... reach the template
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def for_template(self) -> dict:
        msg = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            texts = []
            for part in self.content:
                if part.type != "text" or part.text is None:
                    raise ValueError(f"content part of type {part.type!r} is not supported: Sluice runs the "
                                     "text model only (images, video and audio are refused, even for a "
                                     "multimodal checkpoint)")
                texts.append(part.text)
            msg["content"] = "".join(texts)
        elif self.content is None:
            msg["content"] = ""
        return msg


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None
    response_format: dict | None = None

    def unsupported(self):
        if self.tools:
            return "tools", "tools (function calling) are not supported"
        if self.response_format and self.response_format.get("type", "text") != "text":
            return "response_format", "only response_format {\"type\": \"text\"} is supported"
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        return super().unsupported()

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def n_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def validation_message(err: ValidationError) -> tuple[str, str | None]:
    """A one-line message and the offending top-level parameter of a pydantic error."""
    e = err.errors()[0]
    if e["type"] == "json_invalid":
        return f"request body is not valid JSON: {e['msg']}", None
    loc = [str(x) for x in e["loc"] if not (isinstance(x, str) and ("[" in x or x in ("str", "int", "bool")))]
    if not loc:
        if e["type"] == "model_type":
            return "the request body must be a JSON object", None
        return f"request body: {e['msg']}", None
    where = loc[0] + "".join(f"[{x}]" if x.isdigit() else f".{x}" for x in loc[1:])
    if e["type"] == "missing":
        return f"missing required parameter '{where}'", loc[0]
    msg = e["msg"].removeprefix("Value error, ")
    return f"invalid value for '{where}': {msg}", loc[0]


# -- responses ---------------------------------------------------------------------------------


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, stats: dict | None) -> dict:
    stats = stats or {}
    u = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": int(stats.get("reused_prefix_tokens", 0))},
    }
    if stats:
        u["sluice"] = {k: v for k, v in stats.items() if isinstance(v, (int, float, bool, str))}
    return u


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE: the printable character standing for each byte -> that byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_LEVEL = _byte_level_decoder()
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenText:
    """Token id -> (text, UTF-8 bytes) for log-probability entries.

    A token holding part of a multi-byte character has no text of its own (it decodes to
    U+FFFD); its ``bytes`` are then recovered from the vocabulary entry (byte-level BPE or
    ``<0xHH>`` byte tokens), so clients can join the bytes of consecutive tokens.
    """

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self._raw = getattr(getattr(tokenizer, "_tok", None), "id_to_token", None)

    def text(self, token_id: int) -> str:
        return self.tok.token_text(token_id) if self.tok is not None else f"<{token_id}>"

    def bytes(self, token_id: int) -> list[int]:
        text = self.text(token_id)
        if "\ufffd" in text and self._raw is not None:
            raw = self._raw(token_id) or ""
            m = _BYTE_TOKEN.fullmatch(raw)
            if m:
                return [int(m.group(1), 16)]
            if raw and all(ch in _BYTE_LEVEL for ch in raw):
                return [_BYTE_LEVEL[ch] for ch in raw]
        return list(text.encode("utf-8"))


def chat_logprobs(steps_lp: list[tuple[int, float, list[tuple[int, float]] | None]], tt: TokenText) -> dict:
    """``choices[].logprobs`` of a chat completion: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    content = []
    for token, lp, top in steps_lp:
        content.append({
            "token": tt.text(token), "logprob": lp, "bytes": tt.bytes(token),
            "top_logprobs": [{"token": tt.text(t), "logprob": v, "bytes": tt.bytes(t)} for t, v in (top or [])],
        })
    return {"content": content, "refusal": None}


def completion_logprobs(steps_lp: list[tuple[int, float, list[tuple[int, float]] | None]], offsets: list[int],
                        tt: TokenText) -> dict:
    """``choices[].logprobs`` of a (legacy) completion: parallel lists."""
    tops = []
    for _, _, top in steps_lp:
        d: dict[str, float] = {}
        for t, v in top or []:
            d.setdefault(tt.text(t), v)
        tops.append(d)
    return {
        "tokens": [tt.text(t) for t, _, _ in steps_lp],
        "token_logprobs": [lp for _, lp, _ in steps_lp],
        "top_logprobs": tops,
        "text_offset": offsets,
    }
