"""Hostile requests and hostile models against the HTTP server.

Every case asserts the status, an error in OpenAI's shape whose message names the problem
(and ``param`` where one field is at fault), and that the server logged no traceback. A
hostile chat template (nested ``range(100000)`` loops, a flood of output, a memory hog) or
a 4 MB prompt must not delay ``/health``; the subprocess server's peak RSS under
``--memory`` stays under it with oversized requests, and SIGTERM during a hostile render
stops it at once.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import signal
import socket
import sys
import threading
import time

import httpx
import pytest

import sluice
from conftest import BASELINE, MiB

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from serve_process import spawn_serve, wait_for  # noqa: E402
from live_server import LiveServer, error_of, req_key  # noqa: E402

MODEL = "tiny-chat"
CTX = 256
KEY = "hostile-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ENGINE_KW = dict(memory="2GiB", threads=1, max_context=CTX, progress=False)
HI = [{"role": "user", "content": "hi"}]

# Slow, huge, greedy or refusing for some message contents; an ordinary chat template otherwise.
HOSTILE_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['content'] == 'loop forever' %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
    "{% endfor %}{% endif %}"
    "{% if m['content'] == 'flood' %}{% for i in range(100000) %}{{ 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx' }}"
    "{% endfor %}{% endif %}"
    "{% if m['content'] == 'eat memory' %}{{ ('x' * 10000000000) | length }}{% endif %}"
    "{% if m['content'] == 'refuse' %}{{ raise_exception('this template refuses the word refuse') }}{% endif %}"
    "{{ bos_token }}{{ m['role'] }}\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}{{ bos_token }}assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def hostile_model(chat_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("hostile") / "qwen3-hostile"
    shutil.copytree(chat_model, path)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = HOSTILE_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


class Tracebacks(logging.Handler):
    """Collects log records that carry a traceback (what the server would print as one)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.seen: list[str] = []

    def emit(self, record):
        text = self.format(record)
        if record.exc_info or "Traceback" in text:
            self.seen.append(text)


@pytest.fixture(scope="module")
def srv(hostile_model):
    s = LiveServer(sluice.load(hostile_model, **ENGINE_KW), api_key=KEY, max_queue=2, template_timeout=1.0)
    watch = Tracebacks()
    names = ["", "uvicorn", "uvicorn.error", "uvicorn.access", "sluice", "sluice.server"]
    for n in names:
        logging.getLogger(n).addHandler(watch)
    s.watch = watch
    yield s
    for n in names:
        logging.getLogger(n).removeHandler(watch)
    s.stop()


@pytest.fixture
def post(srv):
    """POST to the server; after the test, no traceback may have been logged."""
    before = len(srv.watch.seen)

    def call(path, body=None, *, json_body=None, headers=None, **kw):
        h = dict(AUTH)
        h.update(headers or {})
        if json_body is not None:
            body = json.dumps(json_body).encode()
            h.setdefault("Content-Type", "application/json")
        return httpx.post(srv.url + path, content=body, headers=h, timeout=60, **kw)

    yield call
    assert srv.watch.seen[before:] == []


def expect_error(resp, status: int, *, param=None, code=None, words=()):
    assert resp.status_code == status, resp.text
    err = error_of(resp)
    assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    for w in words:
        assert w.lower() in err["message"].lower(), err
    assert "Traceback" not in resp.text
    return err


def chat(**fields):
    return {"model": MODEL, "messages": HI, **fields}


def completion(**fields):
    return {"model": MODEL, "prompt": "x = ", "max_tokens": 2, **fields}


# -- bodies that are not what they should be ---------------------------------------------------

BAD_BODIES = {
    "not_json": (b"{not json", None, ("not valid JSON",)),
    "json_array": (b"[1, 2]", None, ("JSON object",)),
    "invalid_utf8": (b'{"model": "tiny-chat", "messages": [{"role": "user", "content": "\xff\xfe"}]}', None,
                     ("JSON",)),
    "empty_body": (b"", None, ("JSON",)),
    "messages_not_a_list": (b'{"model": "tiny-chat", "messages": "hi"}', "messages", ("messages",)),
    "unknown_role": (b'{"model": "tiny-chat", "messages": [{"role": "wizard", "content": "hi"}]}', "messages",
                     ("role",)),
    "image_content_part": (b'{"model": "tiny-chat", "messages": [{"role": "user", "content": '
                           b'[{"type": "image_url", "image_url": {"url": "x"}}]}]}', "messages",
                           ("image_url", "text model only")),
    "video_content_part": (b'{"model": "tiny-chat", "messages": [{"role": "user", "content": [{"type": "text", '
                           b'"text": "what is this?"}, {"type": "video_url", "video_url": {"url": "x"}}]}]}',
                           "messages", ("video_url", "images, video")),
    "image_part_qwen_style": (b'{"model": "tiny-chat", "messages": [{"role": "user", "content": '
                              b'[{"type": "image", "image": "x.png"}]}]}', "messages", ("'image'", "text model only")),
    "model_not_a_string": (b'{"model": 7, "messages": [{"role": "user", "content": "hi"}]}', "model", ("model",)),
}


@pytest.mark.parametrize("case", list(BAD_BODIES))
def test_bad_body(post, case):
    body, param, words = BAD_BODIES[case]
    expect_error(post("/v1/chat/completions", body, headers={"Content-Type": "application/json"}), 400,
                 param=param, words=words)


# -- values out of range or of the wrong type --------------------------------------------------

BAD_VALUES = {
    "temperature_1e-300": (dict(temperature=1e-300), "temperature", ("too small",)),
    "temperature_string": (dict(temperature="hot"), "temperature", ("number",)),
    "temperature_above_2": (dict(temperature=3), "temperature", ("2",)),
    "temperature_infinity": (b"Infinity", "temperature", ("temperature",)),
    "temperature_nan": (b"NaN", "temperature", ("temperature",)),
    "top_p_zero": (dict(top_p=0), "top_p", ("greater than 0",)),
    "seed_overflow": (dict(seed=1 << 64), "seed", ("out of range",)),
    "seed_negative_overflow": (dict(seed=-(1 << 63) - 1), "seed", ("out of range",)),
    "seed_string": (dict(seed="7"), "seed", ("integer",)),
    "max_tokens_zero": (dict(max_tokens=0), "max_tokens", ("greater than or equal to 1",)),
    "max_tokens_negative": (dict(max_tokens=-5), "max_tokens", ("greater than or equal to 1",)),
    "max_tokens_float": (dict(max_tokens=2.5), "max_tokens", ("integer",)),
    "n_2": (dict(n=2), "n", ("n=2",)),
    "n_bool": (dict(n=True), "n", ("integer",)),
    "logprobs_21": (dict(logprobs=True, top_logprobs=21), "top_logprobs", ("20",)),
    "stop_too_long": (dict(stop="s" * 5000), "stop", ("5000 characters",)),
    "stop_too_many": (dict(stop=[str(i) for i in range(17)]), "stop", ("16",)),
    "stop_token_id_out_of_range": (dict(stop_token_ids=[5, 10 ** 6]), "stop_token_ids", ("1000000", "vocabulary")),
    "stream_string": (dict(stream="yes"), "stream", ("boolean",)),
}


@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_bad_value(post, case):
    fields, param, words = BAD_VALUES[case]
    if isinstance(fields, bytes):  # a JSON extension (Infinity, NaN) that json.dumps would not write
        body = b'{"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "temperature": ' + \
            fields + b"}"
        resp = post("/v1/chat/completions", body, headers={"Content-Type": "application/json"})
    else:
        resp = post("/v1/chat/completions", json_body=chat(**fields))
    expect_error(resp, 400, param=param, words=words)


BAD_PROMPTS = {
    "echo_token_id_negative": (dict(prompt=[5, -1], echo=True), ("-1", "vocabulary")),
    "echo_token_id_1e12": (dict(prompt=[5, 10 ** 12], echo=True), ("1000000000000", "vocabulary")),
    "token_id_2_to_the_70": (dict(prompt=[1 << 70]), (str(1 << 70), "vocabulary")),
    "token_id_float": (dict(prompt=[5, 1e12]), ("prompt",)),
    "batched_prompts": (dict(prompt=["a", "b"]), ("batched",)),
    "empty_prompt": (dict(prompt=""), ("empty",)),
    "prompt_over_context": (dict(prompt=list(range(3, 3 + CTX))), ("context",)),
}


@pytest.mark.parametrize("case", list(BAD_PROMPTS))
def test_bad_prompt(post, case):
    fields, words = BAD_PROMPTS[case]
    expect_error(post("/v1/completions", json_body=completion(**fields)), 400, param="prompt", words=words)


def test_huge_max_tokens_is_capped_at_the_context(post):
    prompt = list(range(3, 3 + CTX - 3))
    r = post("/v1/completions", json_body=completion(prompt=prompt, max_tokens=10 ** 30, temperature=0,
                                                     ignore_eos=True))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == 3 and body["choices"][0]["finish_reason"] == "length"


# -- sizes -------------------------------------------------------------------------------------


def test_body_over_limit_with_length(post):
    r = post("/v1/completions", json_body=completion(prompt="x" * (5 << 20)))
    expect_error(r, 413, code="request_too_large", words=("exceeds the limit", "--max-body"))


def test_body_over_limit_chunked(post):
    def chunks():  # no Content-Length: the limit applies as the body arrives
        yield b'{"model": "tiny-chat", "prompt": "'
        for _ in range(80):
            yield b"y" * (64 << 10)
        yield b'"}'

    r = post("/v1/completions", chunks(), headers={"Content-Type": "application/json"})
    expect_error(r, 413, code="request_too_large", words=("exceeds the limit",))


def test_too_many_json_values(post):
    body = b'{"model": "tiny-chat", "messages": [' + b",".join([b'{"role":"user","content":""}'] * 100_000) + b"]}"
    expect_error(post("/v1/chat/completions", body, headers={"Content-Type": "application/json"}), 413,
                 code="too_many_values", words=("JSON values",))


def test_deeply_nested_json(post):
    body = b'{"model": "tiny-chat", "messages": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    r = post("/v1/chat/completions", body, headers={"Content-Type": "application/json"})
    assert r.status_code in (400, 413), r.text
    assert "JSON" in error_of(r)["message"]


def test_huge_prompt_does_not_block_health(srv, post):
    text = random_text((4 << 20) - 64, seed=0)
    worst = health_latency_during(srv, lambda: post("/v1/completions", json_body=completion(prompt=text)),
                                  check=lambda r: expect_error(r, 400, param="prompt", code="context_length_exceeded",
                                                               words=("characters", "context")))
    print(f"\n/health during a 4 MB prompt: slowest answer {worst * 1000:.0f} ms")
    assert worst < 1.0, f"/health took {worst:.2f} s during a 4 MB prompt"


def test_long_prompt_is_counted_in_pieces(post, monkeypatch):
    import sluice.server.limits as limits

    monkeypatch.setattr(limits, "COUNT_CHUNK_CHARS", 1024)  # so a prompt within the character bound is counted
    r = post("/v1/completions", json_body=completion(prompt=random_text(5000, seed=2)))
    expect_error(r, 400, param="prompt", code="context_length_exceeded", words=(f"more than {2 * CTX} tokens",))


def test_huge_chat_message(post):
    r = post("/v1/chat/completions", json_body=chat(messages=[{"role": "user", "content": "word " * 400_000}]))
    expect_error(r, 400, param="messages", code="context_length_exceeded", words=("context",))


def random_text(n: int, seed: int) -> str:
    """``n`` random letters and spaces (a tokenizer makes ~one token per two characters of it)."""
    table = bytes(b"abcdefghij klmnop"[i % 17] for i in range(256))
    return random.Random(seed).randbytes(n).translate(table).decode()


def health_latency_during(srv, request, check) -> float:
    """Runs ``request`` in a thread while polling /health; returns the slowest /health answer."""
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", request()))
    t.start()
    worst = 0.0
    with httpx.Client(timeout=10) as hc:
        while t.is_alive():
            t0 = time.monotonic()
            assert hc.get(srv.url + "/health").status_code == 200
            worst = max(worst, time.monotonic() - t0)
            time.sleep(0.02)
    t.join()
    check(out["r"])
    return worst


# -- hostile chat template ---------------------------------------------------------------------


def test_template_nested_loops_are_stopped(srv, post):
    t0 = time.monotonic()
    worst = health_latency_during(
        srv, lambda: post("/v1/chat/completions",
                          json_body=chat(messages=[{"role": "user", "content": "loop forever"}])),
        check=lambda r: expect_error(r, 400, param="messages", code="chat_template_timeout", words=("took more than",)))
    assert time.monotonic() - t0 < 10
    print(f"\n/health during a hostile render: slowest answer {worst * 1000:.0f} ms")
    assert worst < 1.0, f"/health took {worst:.2f} s during a hostile render"
    ok = post("/v1/chat/completions", json_body=chat(max_tokens=2))  # a new worker serves the next request
    assert ok.status_code == 200, ok.text


def test_template_output_flood(post):
    r = post("/v1/chat/completions", json_body=chat(messages=[{"role": "user", "content": "flood"}]))
    expect_error(r, 400, param="messages", code="context_length_exceeded", words=("renders to more than",))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the worker's address-space cap is enforced on Linux")
def test_template_memory_hog(post):
    r = post("/v1/chat/completions", json_body=chat(messages=[{"role": "user", "content": "eat memory"}]))
    expect_error(r, 400, param="messages", code="chat_template_error", words=("memory",))


def test_template_raise_exception(post):
    r = post("/v1/chat/completions", json_body=chat(messages=[{"role": "user", "content": "refuse"}]))
    expect_error(r, 400, param="messages", code="chat_template_error", words=("refuses the word refuse",))


# -- auth, disconnects -------------------------------------------------------------------------


@pytest.mark.parametrize("header", [None, "Bearer wrong", "Basic aG9zdGlsZS1rZXk=", "Bearer"])
def test_auth_refused(srv, post, header):
    h = {"Authorization": header} if header is not None else {}
    r = httpx.post(srv.url + "/v1/chat/completions", json=chat(), headers=h, timeout=10)
    expect_error(r, 401, code="invalid_api_key", words=("API key",))


def test_client_leaves_mid_upload_is_499(srv, post):
    before = srv.metrics(**AUTH)
    sock = socket.create_connection(("127.0.0.1", srv.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 100000\r\n\r\n"
                 b'{"model": "tiny-chat", "prompt": "' + b"z" * 5000)
    time.sleep(0.2)  # let the server start reading the body
    sock.close()
    wait_for(lambda: srv.metrics(**AUTH).get(req_key("completions", 499), 0)
             > before.get(req_key("completions", 499), 0), what="the departure counted as 499")
    after = srv.metrics(**AUTH)
    assert after.get(req_key("completions", 500), 0) == before.get(req_key("completions", 500), 0)


def test_body_that_never_arrives_is_408(srv):
    service = srv.app.state.service
    service.body_timeout = 0.5
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 1000\r\n\r\n{")
            reply = b""
            while b"}}" not in reply:
                data = sock.recv(65536)
                if not data:
                    break
                reply += data
    finally:
        service.body_timeout = 60.0
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), reply
    err = json.loads(body)["error"]
    assert err["code"] == "request_timeout" and "did not arrive" in err["message"]


def test_request_memory_exhausted_is_429(srv, post):
    pool = srv.app.state.service.memory
    service = srv.app.state.service
    service.wait_timeout = 0.3
    pool.used = pool.capacity  # as if other requests held all of it
    try:
        r = post("/v1/completions", json_body=completion())
    finally:
        pool.release(pool.capacity)
        service.wait_timeout = 60.0
    err = expect_error(r, 429, code="server_busy", words=("request memory", "retry later"))
    assert err["type"] == "rate_limit_error" and r.headers["retry-after"] == "1"
    assert pool.used == 0


# -- the start-up probe --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def probe_engine(chat_model):
    return sluice.load(chat_model, **ENGINE_KW)


@pytest.mark.parametrize("template, words", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", ("took more than",)),
    ("{% for m in messages %}{{ m.content }", ("syntax error",)),
    ("{{ raise_exception('no') }}", ("no",)),
    ("{% for i in range(3000) %}word {% endfor %}", ("more than", "characters")),
])
def test_startup_probe_refuses_template(probe_engine, template, words):
    tok = probe_engine.tokenizer
    saved = tok.chat_template
    tok.chat_template = template
    try:
        s = LiveServer(probe_engine, template_timeout=0.5)
    finally:
        tok.chat_template = saved
    try:
        refused = s.app.state.service.chat_refused
        assert refused and all(w in refused for w in words), refused
        r = httpx.post(s.url + "/v1/chat/completions", json=chat(), timeout=10)
        expect_error(r, 400, param="messages", code="chat_template_refused", words=("refused at start-up",) + words)
        ok = httpx.post(s.url + "/v1/completions", json=completion(), timeout=30)
        assert ok.status_code == 200, ok.text
    finally:
        s.stop()


# -- shutdown ----------------------------------------------------------------------------------


def test_shutdown_ends_open_stream_with_error_event(probe_engine):
    from live_server import Gate

    s = LiveServer(probe_engine)
    gate = Gate(probe_engine)
    try:
        gate.hold(3)
        lines = []
        with httpx.stream("POST", s.url + "/v1/completions", timeout=30,
                          json=completion(max_tokens=100, stream=True, ignore_eos=True, temperature=0,
                                          logprobs=1)) as r:
            it = r.iter_lines()
            while len([x for x in lines if x.startswith("data:")]) < 2:
                lines.append(next(it))
            s.app.state.service.begin_shutdown()  # what SIGINT/SIGTERM do first
            gate.release()
            lines.extend(it)
        data = [x[len("data: "):] for x in lines if x.startswith("data: ")]
        assert data[-1] == "[DONE]"
        err = json.loads(data[-2])["error"]
        assert err["code"] == "shutting_down" and "shutting down" in err["message"]
    finally:
        gate.remove()
        s.stop()


# -- a real `sluice serve` process: memory, responsiveness, signals ----------------------------


def vm_hwm(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_serve_process_memory_health_and_sigterm(hostile_model):
    budget = max(450 * MiB, -(-(BASELINE + 170 * MiB) // (10 * MiB)) * 10 * MiB)
    proc, url = spawn_serve(hostile_model, "--memory", f"{budget // MiB}MiB", "--threads", "1", "--max-context",
                            str(CTX), "--no-progress", "--model-name", MODEL, "--log-level", "warning")
    try:
        # oversized requests, several at once: 4 MB prompts, 4 MB chat messages, 100,000 messages, token lists
        text = random_text((4 << 20) - 1024, seed=1)
        bodies = [json.dumps(completion(prompt=text)).encode(), json.dumps(completion(prompt=text)).encode(),
                  json.dumps(chat(messages=[{"role": "user", "content": text}])).encode(),
                  b'{"model": "tiny-chat", "messages": [' + b",".join([b'{"role":"user","content":""}'] * 130_000)
                  + b"]}",
                  b'{"model": "tiny-chat", "prompt": [' + b",".join([b"7"] * 1_900_000) + b"]}"]
        statuses = {}

        def send(i, body):
            r = httpx.post(url + ("/v1/chat/completions" if b"messages" in body else "/v1/completions"),
                           content=body, headers={"Content-Type": "application/json"}, timeout=60)
            statuses[i] = (r.status_code, error_of(r)["code"])

        threads = [threading.Thread(target=send, args=(i, b)) for i, b in enumerate(bodies)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        del bodies, text
        assert statuses == {0: (400, "context_length_exceeded"), 1: (400, "context_length_exceeded"),
                            2: (400, "context_length_exceeded"), 3: (413, "too_many_values"),
                            4: (413, "too_many_values")}, statuses
        ok = httpx.post(url + "/v1/chat/completions", json=chat(max_tokens=3), timeout=30)
        assert ok.status_code == 200, ok.text
        peak = vm_hwm(proc.pid)
        workers = children(proc.pid)
        worker_peak = max((vm_hwm(w) for w in workers), default=0)
        print(f"\nserve --memory {budget // MiB}MiB: peak RSS {peak / MiB:.0f} MiB after oversized requests; "
              f"template worker peak RSS {worker_peak / MiB:.0f} MiB")
        assert peak < budget, f"peak RSS {peak / MiB:.0f} MiB over --memory {budget // MiB}MiB"

        # a hostile render (5 s limit in `sluice serve`): /health stays quick; SIGTERM stops the server at once
        box = {}
        t = threading.Thread(target=lambda: box.setdefault("r", httpx.post(
            url + "/v1/chat/completions", json=chat(messages=[{"role": "user", "content": "loop forever"}]),
            timeout=30)))
        t.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        assert httpx.get(url + "/health", timeout=5).status_code == 200
        assert time.monotonic() - t0 < 1.0
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
        stopped = time.monotonic() - t0
        t.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert stopped < 4.0, f"SIGTERM took {stopped:.1f} s"
    assert proc.returncode == 0, err
    assert "server stopped" in err
    assert "Traceback" not in err and "Traceback" not in out, err
    r = box.get("r")
    assert r is not None and r.status_code == 503 and error_of(r)["code"] == "shutting_down", r and r.text
    for w in workers:  # the template worker went with the server
        assert not os.path.exists(f"/proc/{w}") or open(f"/proc/{w}/status").read().find("State:\tZ") >= 0


# -- helpers measured directly ---------------------------------------------------------------


def test_json_values_bound():
    from sluice.server.limits import json_values

    samples = [{"a": [1, 2, 3], "b": "x,y[z{"}, ["\\\"", "\\", {"k": None}], {"messages": [{"role": "user"}] * 50}]
    for obj in samples:
        body = json.dumps(obj).encode()
        true = count_values(obj)
        assert true <= json_values(body, 10 ** 9) <= true + 2 * len(body) // 3 + 2
    assert json_values(b"[" + b"1," * 10_000 + b"1]", 100) > 100


def count_values(obj) -> int:
    if isinstance(obj, dict):
        return 1 + sum(1 + count_values(v) for v in obj.values())
    if isinstance(obj, list):
        return 1 + sum(count_values(v) for v in obj)
    return 1


def test_count_tokens_stops_early(text_model):
    from sluice.server.limits import count_tokens_over, split_for_counting
    from sluice.tokenizer import Tokenizer

    tok = Tokenizer(text_model)
    text = "def f(x):\n    return x + 1\n" * 20_000
    assert "".join(split_for_counting(text)) == text
    n = count_tokens_over(tok, text, 1000)
    assert 1000 < n < 1000 + 20_000  # stopped after the piece that passed the limit
    small = "def f(x):\n    return x + 1\n" * 3000
    exact = len(tok.encode(small, add_special_tokens=False))
    assert abs(count_tokens_over(tok, small, 10 ** 9) - exact) <= exact // 100 + 2
