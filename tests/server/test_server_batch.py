"""The server with ``--parallel 4``: concurrent requests share the engine's steps, each answered
as if alone; beyond four running and ``--max-queue`` waiting, 429; ``/metrics`` shows the batch.
Driven by the official ``openai`` client against live uvicorn (the harness of test_server.py)."""

from __future__ import annotations

import threading

import httpx
import pytest

import sluice
from serve_process import wait_for
from live_server import CTX, MODEL, Gate, LiveServer, error_of, req_key

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

ENGINE_KW = dict(memory="2GiB", threads=1, max_context=CTX, cache_experts=6, progress=False)
PROMPTS = ["import os\n", "def hello():", "class Point:", "for i in range(10):"]


class StepGate(Gate):
    """``Gate`` around the engine's ``runner.step`` (one call per scheduler step, however the
    runner computes it): hold the engine before its next step, let it go."""

    def __init__(self, engine):  # not super().__init__: that wraps model.forward
        self.model = engine.runner
        self.orig = engine.runner.step
        self.cond = threading.Condition()
        self.budget = None
        self.fail_after = None
        self.fail_with = None
        self.blocked = 0
        self.model.step = self._forward

    def remove(self) -> None:
        self.release()
        del self.model.step  # the class's method again


@pytest.fixture(scope="module")
def srv(chat_model):
    s = LiveServer(sluice.load(chat_model, parallel=4, **ENGINE_KW), max_queue=1)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def ref(chat_model):
    eng = sluice.load(chat_model, parallel=1, **ENGINE_KW)
    yield eng
    eng.close()


def test_four_concurrent_requests_share_steps_and_answer_as_alone(srv, ref):
    client = srv.client()
    assert srv.metrics()["sluice_parallel"] == 4
    before = srv.metrics()
    gate = StepGate(srv.engine)
    gate.hold(0)  # the engine stops at its first forward: the others join the batch behind it
    out: dict = {}

    def call(i):
        p = PROMPTS[i]
        if i % 2:  # half of them streamed
            chunks = client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True})
            out[i] = "".join(c.choices[0].text for c in chunks if c.choices)
        else:
            out[i] = client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0,
                                               extra_body={"ignore_eos": True}).choices[0].text

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    try:
        for t in threads:
            t.start()
        wait_for(lambda: srv.metrics()["sluice_requests_running"] == 4, what="four requests on the engine")
        assert srv.metrics()["sluice_queue_depth"] == 0
        # a fifth waits in the queue (--max-queue 1), a sixth is refused
        fifth = threading.Thread(target=lambda: out.setdefault(4, client.completions.create(
            model=MODEL, prompt="x = 1", max_tokens=2, temperature=0, extra_body={"ignore_eos": True})))
        fifth.start()
        wait_for(lambda: srv.metrics()["sluice_queue_depth"] == 1, what="the fifth request queued")
        resp = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "y", "max_tokens": 2})
        assert resp.status_code == 429 and error_of(resp)["code"] == "queue_full"
    finally:
        gate.remove()
    for t in threads:
        t.join(60)
    fifth.join(60)
    for i, p in enumerate(PROMPTS):
        assert out[i] == ref.generate(p, max_new_tokens=8, ignore_eos=True).text, p
    assert out[4].choices[0].finish_reason == "length"
    after = srv.metrics()
    steps = after["sluice_engine_steps_total"] - before["sluice_engine_steps_total"]
    stepped = after["sluice_batched_sequences_total"] - before["sluice_batched_sequences_total"]
    assert stepped / steps > 2  # five generations of 8 and 2 tokens, most steps shared by four
    assert 1 <= after["sluice_batch_size"] <= 4
    assert after["sluice_queue_waits_total"] - before["sluice_queue_waits_total"] == 5
    assert after["sluice_requests_running"] == 0 and after["sluice_queue_depth"] == 0
    union = after["sluice_expert_union_total"] - before["sluice_expert_union_total"]
    alone = after["sluice_expert_sequence_union_total"] - before["sluice_expert_sequence_union_total"]
    assert 0 < union < alone  # shared steps read and compute each expert once for all their sequences


def test_metrics_name_the_batch_and_the_expert_union(srv):
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    for name in ("sluice_parallel", "sluice_batch_size", "sluice_engine_steps_total", "sluice_batched_sequences_total",
                 "sluice_expert_union_size", "sluice_expert_union_total", "sluice_expert_sequence_union_total",
                 "sluice_queue_waits_total", "sluice_engine_bytes_read_total"):
        assert f"# TYPE {name} " in text


def test_a_cancelled_stream_leaves_the_batch_and_the_others_finish(srv, ref):
    client = srv.client()
    before = srv.metrics()
    gate = StepGate(srv.engine)
    gate.hold(0)
    out: dict = {}

    def full(i):
        out[i] = client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=12, temperature=0,
                                           extra_body={"ignore_eos": True}).choices[0].text

    def cut():
        stream = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=200, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        out[1] = next(iter(stream)).choices[0].text
        gate.hold(0)  # the engine stops at its next forward while ...
        stream.close()  # ... the client goes away after its first token

    threads = [threading.Thread(target=full, args=(0,)), threading.Thread(target=cut),
               threading.Thread(target=full, args=(2,))]
    try:
        for t in threads:
            t.start()
        wait_for(lambda: srv.metrics()["sluice_requests_running"] == 3, what="three requests on the engine")
        gate.release()
        threads[1].join(60)
        gone = req_key("completions", 499)
        wait_for(lambda: srv.metrics().get(gone, 0) == before.get(gone, 0) + 1, what="the disconnect")
    finally:
        gate.remove()
    for t in threads:
        t.join(60)
    for i in (0, 2):
        assert out[i] == ref.generate(PROMPTS[i], max_new_tokens=12, ignore_eos=True).text
    cancelled = 'sluice_generations_total{outcome="cancelled"}'
    wait_for(lambda: srv.metrics()[cancelled] == before[cancelled] + 1, what="the cut stream cancelled")
    after = srv.metrics()
    assert after["sluice_requests_running"] == 0
    done = 'sluice_generations_total{outcome="completed"}'
    assert after[done] - before[done] == 2  # the cut one did not run to its 200 tokens
