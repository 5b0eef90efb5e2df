"""The OpenAI-compatible server, driven by the official ``openai`` client against live uvicorn.

Each server runs in a background thread of this process on a loopback socket bound to a
free port. Ordering is made deterministic with a ``Gate`` around the engine's forward pass
(hold the engine mid-generation, fail it, let it go) and by polling ``/metrics``, never by
sleeping for an assumed duration. Expected outputs come from a separate engine on the same
model, run without prefix reuse.
"""

from __future__ import annotations

import errno
import json
import random
import re
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

import sluice
from serve_process import spawn_serve, wait_for
from sluice.errors import ExpertReadError

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from live_server import CTX, ENGINE_KW, MODEL, Gate, LiveServer, error_of, parse_metrics, req_key  # noqa: E402


# -- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ref(chat_model):
    """The oracle: a separate engine, never reusing a prefix."""
    return sluice.load(chat_model, **ENGINE_KW)


@pytest.fixture(scope="module")
def srv(chat_model):
    s = LiveServer(sluice.load(chat_model, **ENGINE_KW), max_queue=1, max_body_bytes=64 << 10)
    yield s
    s.stop()


@pytest.fixture
def gate(srv):
    g = Gate(srv.engine)
    yield g
    g.remove()


@pytest.fixture(scope="module")
def client(srv):
    return srv.client()


def chat_ids(engine, messages) -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.render_chat(messages), add_special_tokens=False)


HELLO = [{"role": "user", "content": "def hello():"}]


# -- endpoints ---------------------------------------------------------------------------------


def test_models_and_health(srv, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-17")
    h = httpx.get(srv.url + "/health").json()
    assert h["status"] == "ok" and h["model"] == MODEL and h["running"] == 0


def test_completion_matches_engine(client, ref):
    r = client.completions.create(model=MODEL, prompt="import os\n", max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    want = ref.generate("import os\n", max_new_tokens=8, ignore_eos=True)
    assert r.object == "text_completion" and r.model == MODEL and len(r.choices) == 1
    assert r.choices[0].text == want.text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(ref.encode("import os\n"))
    assert r.usage.completion_tokens == 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8
    # token ids work as a prompt too, and ``echo`` prepends the prompt
    ids = ref.encode("import os\n")
    r2 = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0, echo=True,
                                   extra_body={"ignore_eos": True})
    assert r2.choices[0].text == ref.decode(ids) + want.text


def test_chat_matches_engine(client, ref):
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_completion_tokens=10, temperature=0,
                                       extra_body={"ignore_eos": True})
    ids = chat_ids(ref, HELLO)
    want = ref.generate(ids, max_new_tokens=10, ignore_eos=True)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 10


def test_streaming_chat_reassembles(client):
    kw = dict(model=MODEL, messages=HELLO, max_tokens=12, temperature=0.9, top_p=0.95, seed=11,
              extra_body={"ignore_eos": True, "top_k": 40})
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert len({c.id for c in chunks}) == 1 and all(c.object == "chat.completion.chunk" for c in chunks)
    # completions stream the same way
    ckw = dict(model=MODEL, prompt="for i in", max_tokens=12, temperature=0.9, seed=3,
               extra_body={"ignore_eos": True})
    whole = client.completions.create(**ckw).choices[0].text
    assert "".join(c.choices[0].text for c in client.completions.create(stream=True, **ckw)) == whole


def test_seed_reproducible(client):
    kw = dict(model=MODEL, messages=HELLO, max_tokens=16, temperature=1.0, extra_body={"ignore_eos": True})
    a = client.chat.completions.create(seed=7, **kw).choices[0].message.content
    b = client.chat.completions.create(seed=7, **kw).choices[0].message.content
    c = client.chat.completions.create(seed=8, **kw).choices[0].message.content
    assert a == b and a != c


def test_stop_strings(client, ref):
    full = ref.generate("class A:\n", max_new_tokens=24, ignore_eos=True).text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop.strip() and stop in full
    want = full[: full.index(stop)]
    r = client.completions.create(model=MODEL, prompt="class A:\n", max_tokens=24, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt="class A:\n", max_tokens=24, temperature=0,
                                            stop=stop, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_logprobs(client, ref):
    r = client.completions.create(model=MODEL, prompt="return", max_tokens=5, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    want = list(ref.stream("return", max_new_tokens=5, ignore_eos=True, logprobs=3))
    lp = r.choices[0].logprobs
    assert lp.tokens == [ref.tokenizer.token_text(s.token_id) for s in want]
    assert lp.token_logprobs == pytest.approx([s.logprob for s in want], abs=1e-4)
    assert all(len(t) <= 3 for t in lp.top_logprobs) and len(lp.text_offset) == 5
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)

    c = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=2, extra_body={"ignore_eos": True})
    content = c.choices[0].logprobs.content
    assert len(content) == 4
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 2
        assert item.top_logprobs[0].token == item.token  # greedy takes the most likely token
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob)
        assert isinstance(item.bytes, list)
    assert b"".join(bytes(i.bytes) for i in content).decode("utf-8", "replace") == c.choices[0].message.content
    # streamed: every token brings its logprob entry
    chunks = list(client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, temperature=0,
                                                 logprobs=True, stream=True, extra_body={"ignore_eos": True}))
    streamed = [i for ch in chunks if ch.choices and ch.choices[0].logprobs for i in ch.choices[0].logprobs.content]
    assert [i.token for i in streamed] == [i.token for i in content]


# -- queueing, cancellation, failures ----------------------------------------------------------


def test_queue_full_gives_429(srv, client, gate):
    before = srv.metrics()
    gate.hold(0)  # the engine stops at its next forward pass
    results = {}

    def call(name):
        results[name] = client.completions.create(model=MODEL, prompt="x = 1", max_tokens=3, temperature=0,
                                                  extra_body={"ignore_eos": True})

    a = threading.Thread(target=call, args=("a",))
    a.start()
    wait_for(lambda: gate.blocked == 1, what="the first request on the engine")
    b = threading.Thread(target=call, args=("b",))
    b.start()
    wait_for(lambda: srv.metrics()["sluice_queue_depth"] == 1, what="the second request queued")
    resp = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "y", "max_tokens": 2})
    assert resp.status_code == 429
    assert int(resp.headers["retry-after"]) >= 1
    err = error_of(resp)
    assert err["code"] == "queue_full" and err["type"] == "rate_limit_error"
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
    gate.release()
    a.join(30)
    b.join(30)
    assert results["a"].choices[0].text == results["b"].choices[0].text
    after = srv.metrics()
    assert after[req_key("completions", 429)] - before.get(req_key("completions", 429), 0) == 1
    assert after["sluice_queue_depth"] == 0 and after["sluice_requests_running"] == 0


def test_cancel_by_closing_stream(srv, client, gate, ref):
    before = srv.metrics()
    gate.hold(3)  # prefill and two decode steps, then the engine waits
    stream = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=200, temperature=0,
                                            stream=True, logprobs=True, extra_body={"ignore_eos": True})
    it = iter(stream)
    assert next(it).choices[0].delta.role == "assistant"
    assert next(it).choices[0].logprobs.content  # the first token
    stream.close()
    # the server notices the disconnect while the engine is still held mid-generation
    wait_for(lambda: srv.metrics().get(req_key("chat_completions", 499), 0)
             > before.get(req_key("chat_completions", 499), 0), what="the disconnect")
    gate.release()
    wait_for(lambda: srv.metrics()["sluice_generations_total{outcome=\"cancelled\"}"]
             > before["sluice_generations_total{outcome=\"cancelled\"}"], what="the cancelled generation")
    after = srv.metrics()
    assert after["sluice_requests_running"] == 0
    assert after["sluice_generated_tokens_total"] - before["sluice_generated_tokens_total"] <= 4  # not 200
    # the engine is free and clean: the next request gives the reference answer
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == ref.generate(chat_ids(ref, HELLO), max_new_tokens=6,
                                                        ignore_eos=True).text


def test_cancel_while_queued_frees_the_place(srv, client, gate):
    before = srv.metrics()
    gate.hold(0)
    done = {}
    a = threading.Thread(target=lambda: done.setdefault("a", client.completions.create(
        model=MODEL, prompt="a", max_tokens=2, temperature=0, extra_body={"ignore_eos": True})))
    a.start()
    wait_for(lambda: gate.blocked == 1, what="the first request on the engine")
    body = json.dumps({"model": MODEL, "prompt": "b", "max_tokens": 50, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", srv.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    wait_for(lambda: srv.metrics()["sluice_queue_depth"] == 1, what="the second request queued")
    sock.close()
    wait_for(lambda: srv.metrics()["sluice_queue_depth"] == 0, what="the queue place freed")
    # while the first still runs, the freed place takes a new request instead of a 429
    c = threading.Thread(target=lambda: done.setdefault("c", client.completions.create(
        model=MODEL, prompt="c", max_tokens=2, temperature=0, extra_body={"ignore_eos": True})))
    c.start()
    wait_for(lambda: srv.metrics()["sluice_queue_depth"] == 1, what="the third request queued")
    gate.release()
    a.join(30)
    c.join(30)
    assert done["a"].choices[0].finish_reason == "length" and done["c"].choices[0].finish_reason == "length"
    after = srv.metrics()
    assert after[req_key("completions", 499)] - before.get(req_key("completions", 499), 0) == 1
    assert req_key("completions", 429) not in after or \
        after[req_key("completions", 429)] == before.get(req_key("completions", 429), 0)


def test_disconnect_cancels_running_non_streaming_request(srv, gate):
    before = srv.metrics()
    gate.hold(0)
    body = json.dumps({"model": MODEL, "messages": HELLO, "max_tokens": 100, "ignore_eos": True}).encode()
    sock = socket.create_connection(("127.0.0.1", srv.port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    wait_for(lambda: gate.blocked == 1, what="the request on the engine")
    sock.close()
    wait_for(lambda: srv.metrics().get(req_key("chat_completions", 499), 0)
             > before.get(req_key("chat_completions", 499), 0), what="the disconnect")
    gate.release()
    cancelled = 'sluice_generations_total{outcome="cancelled"}'
    wait_for(lambda: srv.metrics()[cancelled] > before[cancelled], what="the cancelled generation")
    after = srv.metrics()
    assert after["sluice_requests_running"] == 0
    assert after["sluice_generated_tokens_total"] - before["sluice_generated_tokens_total"] <= 1


class FailingReads:
    """Makes the engine's expert reads fail with EIO (a real I/O error, in the real read path) while armed."""

    def __init__(self, engine):
        self.source = engine.experts.source
        self.orig = self.source.file
        self.armed = False
        self.failed = 0
        outer = self

        class File:
            def __init__(self, f):
                self.f = f

            def read_aligned(self, buf, offset):
                if outer.armed:
                    outer.failed += 1
                    raise OSError(errno.EIO, "Input/output error")
                return self.f.read_aligned(buf, offset)

            def __getattr__(self, name):
                return getattr(self.f, name)

        self.source.file = lambda path: File(self.orig(path))

    def remove(self):
        self.source.file = self.orig


def test_io_error_gives_500_and_server_goes_on(srv, client, ref):
    faults = FailingReads(srv.engine)
    prompt = "import os, sys, json\nfrom pathlib import Path\n\nclass Config:\n    def __init__(self, path):"
    try:
        faults.armed = True
        with pytest.raises(openai.InternalServerError) as exc:
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
        assert faults.failed > 0
        err = exc.value.body
        assert err["type"] == "server_error" and err["code"] == "generation_failed"
        assert "Input/output error" in err["message"] and "expert" in err["message"]
    finally:
        faults.remove()
    assert httpx.get(srv.url + "/health").json()["status"] == "ok"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == ref.generate(prompt, max_new_tokens=6, ignore_eos=True).text


def test_failure_in_generation_gives_500_and_server_goes_on(srv, client, gate, ref):
    gate.fail(ExpertReadError("simulated I/O error reading layer 1 expert 3"))
    with pytest.raises(openai.InternalServerError) as exc:
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, temperature=0)
    assert exc.value.status_code == 500
    err = exc.value.body
    assert err["type"] == "server_error" and "simulated I/O error" in err["message"]
    # mid-stream: the stream carries an error event, then ends
    gate.fail(ExpertReadError("simulated I/O error mid-stream"), after=2)
    got = []
    with pytest.raises(openai.APIError, match="simulated I/O error mid-stream"):
        for chunk in client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=20, temperature=0,
                                                    stream=True, logprobs=True, extra_body={"ignore_eos": True}):
            got.append(chunk)
    assert len(got) >= 2
    m = srv.metrics()
    assert m["sluice_generations_total{outcome=\"failed\"}"] >= 2
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == ref.generate(chat_ids(ref, HELLO), max_new_tokens=6,
                                                        ignore_eos=True).text


# -- prefix reuse ------------------------------------------------------------------------------


def test_prefix_reuse_growing_chat(srv, client, ref):
    first = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "import sys"}]
    r1 = client.chat.completions.create(model=MODEL, messages=first, max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})
    ids1 = chat_ids(ref, first)
    want1 = ref.generate(ids1, max_new_tokens=8, ignore_eos=True)
    assert r1.choices[0].message.content == want1.text
    before = srv.metrics()

    second = first + [{"role": "assistant", "content": r1.choices[0].message.content},
                      {"role": "user", "content": "def main():"}]
    r2 = client.chat.completions.create(model=MODEL, messages=second, max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})
    ids2 = chat_ids(ref, second)
    want2 = ref.generate(ids2, max_new_tokens=8, ignore_eos=True)  # from scratch
    assert r2.choices[0].message.content == want2.text  # same output as without reuse
    # the engine kept the first prompt and reply (all but the last token, never fed back)
    kept = ids1 + want1.token_ids[:-1]
    common = next((i for i, (a, b) in enumerate(zip(kept, ids2)) if a != b), min(len(kept), len(ids2)))
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert cached == min(common, len(ids2) - 1) and cached >= len(ids1) - 1
    assert r2.usage.model_extra["sluice"]["reused_prefix_tokens"] == cached
    assert r2.usage.prompt_tokens == len(ids2)
    after = srv.metrics()
    assert after["sluice_reused_prefix_tokens_total"] - before["sluice_reused_prefix_tokens_total"] == cached
    assert after["sluice_prefilled_tokens_total"] - before["sluice_prefilled_tokens_total"] == len(ids2) - cached


def test_metrics_format(srv):
    text = httpx.get(srv.url + "/metrics").text
    assert httpx.get(srv.url + "/metrics").headers["content-type"].startswith("text/plain; version=0.0.4")
    m = parse_metrics(text)
    for name in ("sluice_queue_depth", "sluice_queue_capacity", "sluice_requests_running",
                 "sluice_prompt_tokens_total", "sluice_prefilled_tokens_total", "sluice_reused_prefix_tokens_total",
                 "sluice_generated_tokens_total", "sluice_prefill_tokens_per_second",
                 "sluice_decode_tokens_per_second", "sluice_expert_cache_hit_rate", "sluice_bytes_read_total",
                 "sluice_expert_cache_lookups_total", "sluice_expert_cache_hits_total"):
        assert name in m and f"# TYPE {name} " in text, name
    assert m[req_key("chat_completions", 200)] > 0 and m[req_key("completions", 200)] > 0
    assert m["sluice_generated_tokens_total"] > 0 and m["sluice_bytes_read_total"] > 0
    assert 0 < m["sluice_expert_cache_hit_rate"] <= 1 and m["sluice_decode_tokens_per_second"] > 0
    assert m["sluice_queue_capacity"] == 1


# -- auth, limits, bad input -------------------------------------------------------------------


def test_auth(chat_model):
    s = LiveServer(sluice.load(chat_model, **ENGINE_KW), api_key="sekrit")
    try:
        with pytest.raises(openai.AuthenticationError):
            s.client(api_key="wrong").models.list()
        r = httpx.post(s.url + "/v1/chat/completions", json={"model": MODEL, "messages": HELLO})
        assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"
        assert httpx.get(s.url + "/metrics").status_code == 401
        assert httpx.get(s.url + "/health").status_code == 200  # liveness stays open
        ok = s.client(api_key="sekrit").chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
        assert ok.choices[0].finish_reason in ("stop", "length")
        assert s.metrics(Authorization="Bearer sekrit")["sluice_generations_total{outcome=\"completed\"}"] == 1
    finally:
        s.stop()


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (b'{"model": "tiny-chat"}', 400, "messages"),
    (b'{"messages": [{"role": "user", "content": "hi"}]}', 400, "model"),
    (b'{"model": "tiny-chat", "messages": "hi"}', 400, "messages"),
    (b'{"model": "tiny-chat", "messages": [{"role": "wizard", "content": "hi"}]}', 400, "messages"),
    (b'{"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}', 400,
     "temperature"),
    (b'{"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}', 400,
     "max_tokens"),
    (b'{"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "5"}', 400,
     "max_tokens"),
    (b'{"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "n": 2}', 400, "n"),
    (b'{"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "top_p": 0}', 400, "top_p"),
    (b'{"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "stream": "yes"}', 400, "stream"),
    (b'{"model": "gpt-17", "messages": [{"role": "user", "content": "hi"}]}', 404, "model"),
])
def test_bad_chat_requests(srv, body, status, param):
    r = httpx.post(srv.url + "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = error_of(r)
    assert err["param"] == param
    assert err["type"] == "invalid_request_error"


def test_limits(srv, client, ref):
    long_prompt = list(range(3, 3 + CTX))
    r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": long_prompt, "max_tokens": 2})
    assert r.status_code == 400 and error_of(r)["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="context"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 400}])
    r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "x" * (70 << 10)})
    assert r.status_code == 413 and error_of(r)["code"] == "request_too_large"
    r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": ["a", "b"]})
    assert r.status_code == 400 and error_of(r)["param"] == "prompt"
    r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": [1, 2, 99999]})
    assert r.status_code == 400 and "vocabulary" in error_of(r)["message"]
    r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": ""})
    assert r.status_code == 400
    assert httpx.get(srv.url + "/v1/nowhere").status_code == 404
    assert error_of(httpx.get(srv.url + "/v1/completions"))["code"] == "method_not_allowed"
    # max_tokens beyond the context is capped: finish_reason "length" at the context's end
    prompt = list(range(3, 3 + CTX - 4))
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=100, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "length"


def test_chat_without_template_is_400(text_model):
    s = LiveServer(sluice.load(text_model, **ENGINE_KW))
    try:
        with pytest.raises(openai.BadRequestError) as exc:
            s.client().chat.completions.create(model=MODEL, messages=HELLO)
        assert exc.value.body["code"] == "no_chat_template" and "chat template" in exc.value.body["message"]
        ok = s.client().completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert ok.choices[0].finish_reason in ("stop", "length")
    finally:
        s.stop()


# -- load ------------------------------------------------------------------------------------


def test_load_with_cancellations(chat_model, ref):
    """200 requests from 6 threads, seeded random kinds and cancellations; zero 5xx; healthy after."""
    s = LiveServer(sluice.load(chat_model, **ENGINE_KW), max_queue=2)
    n_requests, n_clients = 200, 6
    counter = iter(range(n_requests))
    lock = threading.Lock()
    tally = {"completed": 0, "429": 0, "cancelled": 0, "5xx": 0, "other": []}

    def count(key, detail=None):
        with lock:
            if key == "other":
                tally["other"].append(detail)
            else:
                tally[key] += 1

    def check_usage(u, n_tokens):
        assert u.prompt_tokens > 0 and u.completion_tokens == n_tokens
        assert u.total_tokens == u.prompt_tokens + u.completion_tokens

    def one(cl: openai.OpenAI, rng: random.Random, i: int):
        chat, stream = rng.random() < 0.5, rng.random() < 0.6
        cancel_after = rng.randint(1, 3) if stream and rng.random() < 0.3 else None
        max_tokens = rng.randint(1, 6)
        kw = dict(model=MODEL, max_tokens=max_tokens, temperature=rng.choice([0, 0.8]), seed=i,
                  extra_body={"ignore_eos": rng.random() < 0.7})
        if chat:
            kw["messages"] = [{"role": "user", "content": rng.choice(["hi", "def f():", "import os"])}]
            call = cl.chat.completions.create
        else:
            kw["prompt"] = rng.choice(["x = ", "class A:", "for i in"])
            call = cl.completions.create
        try:
            if not stream:
                r = call(**kw)
                c = r.choices[0]
                assert c.finish_reason in ("stop", "length")
                text = c.message.content if chat else c.text
                assert isinstance(text, str)
                check_usage(r.usage, r.usage.completion_tokens)
                assert 1 <= r.usage.completion_tokens <= max_tokens
                count("completed")
                return
            chunks = []
            st = call(stream=True, stream_options={"include_usage": True}, **kw)
            for ch in st:
                chunks.append(ch)
                if cancel_after is not None and len(chunks) >= cancel_after:
                    st.close()
                    count("cancelled")
                    return
            finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
            assert finals in (["stop"], ["length"]), finals
            assert chunks[-1].usage is not None and 1 <= chunks[-1].usage.completion_tokens <= max_tokens
            count("completed")
        except openai.RateLimitError:
            count("429")
        except openai.InternalServerError:
            count("5xx")
        except Exception as e:  # noqa: BLE001  (counted and reported)
            count("other", f"{type(e).__name__}: {e}")

    def worker(k: int):
        cl = s.client()
        rng = random.Random(1000 + k)
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            one(cl, rng, i)

    t0 = time.monotonic()
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(n_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    wall = time.monotonic() - t0
    try:
        assert not any(t.is_alive() for t in threads), "load test did not finish in time"
        print(f"\nload: {n_requests} requests, {tally['completed']} completed, {tally['429']} x 429, "
              f"{tally['cancelled']} cancelled, {tally['5xx']} x 5xx, wall {wall:.1f} s")
        assert tally["other"] == []
        assert tally["5xx"] == 0
        assert tally["completed"] + tally["429"] + tally["cancelled"] == n_requests
        assert tally["completed"] > 0 and tally["cancelled"] > 0
        wait_for(lambda: (lambda m: m["sluice_requests_running"] == 0 and m["sluice_queue_depth"] == 0)(s.metrics()),
                 what="the server to go idle")
        m = s.metrics()
        assert not any(k.startswith("sluice_requests_total") and re.search(r'status="5\d\d"', k) for k in m)
        assert httpx.get(s.url + "/health").json()["status"] == "ok"
        r = s.client().chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6, temperature=0,
                                               extra_body={"ignore_eos": True})
        assert r.choices[0].message.content == ref.generate(chat_ids(ref, HELLO), max_new_tokens=6,
                                                            ignore_eos=True).text
    finally:
        s.stop()


# -- the command line and packaging ------------------------------------------------------------


def test_serve_command(chat_model):
    """``sluice serve`` as a user runs it: up, answering, stopped by Ctrl-C with exit status 0."""
    import signal

    proc, url = spawn_serve(chat_model, "--memory", "2GiB", "--threads", "1", "--max-context", "128", "--no-progress",
                            "--model-name", "m", "--log-level", "warning", timeout=60)
    try:
        cl = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        r = cl.chat.completions.create(model="m", messages=HELLO, max_tokens=3)
        assert r.choices[0].finish_reason in ("stop", "length")
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert f"serving 'm' on {url}/v1" in err


def test_library_never_imports_server():
    code = ("import sys, sluice; bad = [m for m in sys.modules if m.split('.')[0] in ('fastapi', 'uvicorn', "
            "'starlette') or m.startswith('sluice.server')]; print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_missing_server_extra_is_explained(monkeypatch):
    import importlib.util

    from sluice.errors import SluiceError
    from sluice.server import require_dependencies

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else real(name, *a))
    with pytest.raises(SluiceError, match=r"needs uvicorn.*pip install 'sluice\[server\]'"):
        require_dependencies()
