"""Experts sharded over Ray actors (``--ray``, sluice/cluster/): exact, and surviving a lost worker.

A local Ray cluster of three logical nodes on this host (``ray.cluster_utils.Cluster``), pinned
to 127.0.0.1, dashboard off, usage reporting off. Tiny models of three families (a hybrid one,
qwen3_next, among them): logits ``torch.equal`` to one process for a prefill chunk and for
token-by-token decoding with 1, 2 and 3 workers, with and without replicated hot experts; every
worker computes experts; a worker killed mid-generation gives ``WorkerLostError`` (or, with
replicas, the same tokens) and the next request succeeds. A mixed step of three sequences and
``Engine.generate([p1, p2])`` give one process's logits and tokens, and the same routing counters.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import time

import pytest
import torch

from sluice import load
from sluice.errors import ExpertReadError, InvalidArgumentError
from sluice.server.serving import Metrics

HAVE_RAY = importlib.util.find_spec("ray") is not None  # imported by the fixture, after its environment

SKIP_REASONS = {"no_ray": 'ray is not installed (pip install -e ".[ray]")'}

FAMILIES = ["qwen3_next", "deepseek_v3", "mixtral"]  # hybrid, grouped top-4 of 16, sliding window
PROMPT = [5, 17, 42, 99, 7, 130, 61, 18, 220, 3, 77, 150]
DECODE = 4  # the last tokens of PROMPT run one at a time (the decode path: one row per layer)
COMMON = dict(progress=False, cache_experts=6, max_context=64)


@pytest.fixture(scope="module")
def cluster():
    """Three logical Ray nodes on 127.0.0.1 (head + 2), this process connected as the driver."""
    if not HAVE_RAY:
        pytest.skip(SKIP_REASONS["no_ray"])
    env = {"RAY_USAGE_STATS_ENABLED": "0",
           # every node and the driver on loopback, never the host's routable address (read when ray
           # is first imported)
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import ray
    from ray.cluster_utils import Cluster

    node = dict(num_cpus=1, node_ip_address="127.0.0.1", object_store_memory=80 << 20)
    c = Cluster(initialize_head=True, head_node_args=dict(node, include_dashboard=False))
    for _ in range(2):
        c.add_node(**node)
    ray.init(address=c.address, logging_level="WARNING", log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def logits_of(eng) -> torch.Tensor:
    """Prefill logits of PROMPT[:-DECODE] (all positions), then DECODE tokens one by one."""
    run, slot = eng.runner.run, eng.slot
    slot.rewind(0)
    n = len(PROMPT) - DECODE
    out = [run(slot, PROMPT[:n], 0, last_n=n)]
    for i in range(n, len(PROMPT)):
        out.append(run(slot, [PROMPT[i]], i, last_n=1, decoding=True))
    return torch.cat(out)


def lookahead_of(eng, before) -> tuple[int, int]:
    """The lookahead's (predictions checked, hits) since the counters ``before``."""
    d = eng.totals() - before
    return d.lookahead_predictions, d.lookahead_hits


@pytest.fixture(scope="module")
def single(family_models):
    """One process's logits per family: the reference (and its lookahead counts, in ``lookahead``)."""
    out = {}
    for fam in FAMILIES:
        with load(family_models.hf(fam), "2GiB", **COMMON) as eng:
            before = eng.totals()
            out[fam] = logits_of(eng)
            LOOKAHEAD[fam] = lookahead_of(eng, before)
    return out


LOOKAHEAD: dict[str, tuple[int, int]] = {}  # family -> one process's lookahead (predictions, hits), by ``single``


def use(eng, workers: int, replicate_hot: int) -> None:
    """Route this engine's layers over its first ``workers`` workers (a fresh placement)."""
    from sluice.cluster.placement import Placement

    eng.experts.placement = Placement(eng.desc.moe_layers, eng.desc.n_experts, workers, replicate_hot)


WORKERS = {"qwen3_next": 3, "deepseek_v3": 2, "mixtral": 1}  # engines started with 3, 2 and 1 workers


@pytest.mark.parametrize("family", FAMILIES)
def test_bit_identical_to_one_process(family, family_models, cluster, single):
    n = WORKERS[family]
    with load(family_models.hf(family), "2GiB", ray="auto", expert_workers=n, **COMMON) as eng:
        assert len(eng.experts.workers) == n
        assert eng.cache is None and eng.plan.cache_slots == 0  # the driver holds no expert cache
        before = eng.totals()
        assert torch.equal(logits_of(eng), single[family]), f"{family}: {n} workers"
        # one compiled graph of all workers carried every layer's requests
        assert (eng.experts.graph_builds, eng.experts.graph_fallbacks) == (1, 0)
        # the lookahead's one-layer-ahead predictions are checked as one process checks them
        assert lookahead_of(eng, before) == LOOKAHEAD[family] and LOOKAHEAD[family][0] > 0
        eng.experts.compiled = False  # plain actor calls: the same bits
        assert torch.equal(logits_of(eng), single[family]), f"{family}: {n} workers, plain calls"
        eng.experts.compiled = True
        # then the same workers under other placements: the first 1..n of them, replicated hot experts
        for workers, hot in [(w, 0) for w in range(1, n)] + [(w, h) for w in range(2, n + 1)
                                                             for h in (2, eng.desc.n_experts)]:
            use(eng, workers, hot)
            assert torch.equal(logits_of(eng), single[family]), f"{family}: {workers} workers, replicate_hot={hot}"
        if n > 1:  # the hot experts re-chosen from the measured routing counts
            use(eng, n, 2)
            logits_of(eng)
            for _ in range(16):
                eng.experts.begin(None)
            pl = eng.experts.placement
            assert pl.hot(eng.desc.moe_layers[0]) == sorted(pl.counts[0].topk(2).indices.tolist())
            assert torch.equal(logits_of(eng), single[family])
        stats = eng.experts.worker_stats()
        assert all(s["experts_computed"] > 0 and s["rows_computed"] > 0 for s in stats), stats
        counted = eng.experts.worker_counters()  # the driver's own count, what /metrics shows
        assert all(p["experts_computed_total"] > 0 and p["calls_total"] > 0 for p in counted), counted
        text = Metrics("m").render(0, 0, 1, workers=counted)
        assert f'sluice_expert_worker_rows_computed_total{{worker="{n - 1}"}}' in text
        c = eng.totals()
        assert c.expert_lookups > 0 and c.bytes_read > 0 and c.demand_reads > 0


def test_decoding_layers_packed_on_the_fewest_workers():
    """A replicated expert of a decoding layer goes to a worker the layer calls anyway (fewer round
    trips); a prefill layer balances rows as before."""
    from sluice.cluster.placement import Placement

    pl = Placement([0], 8, workers=4, replicate_hot=8)  # every expert on its home and the next worker
    rows = {1: 1, 2: 1, 5: 1}  # candidates (home first): [1, 2], [2, 3], [1, 2]
    assert pl.assign(0, rows, count=False) == {1: 1, 2: 2, 5: 1}  # balanced by rows: two workers
    assert pl.assign(0, rows, count=False, pack=True) == {1: 2, 2: 2, 5: 2}  # one worker holds them all
    pl = Placement([0], 8, workers=4, replicate_hot=2)  # experts 0 and 1 replicated
    rows = {0: 1, 1: 1, 3: 1}  # candidates [0, 1], [1, 2], [3]
    packed = pl.assign(0, rows, count=False, pack=True)
    assert Placement.calls(packed) == 2 and packed[3] == 3 and packed[0] == packed[1] == 1
    pl = Placement([0], 8, workers=4, replicate_hot=0)  # nothing replicated: packing changes nothing
    assert pl.assign(0, rows, count=False, pack=True) == pl.assign(0, rows, count=False)


def test_prefer_cached_refused(family_models, cluster):
    """Refused before any worker starts."""
    with pytest.raises(InvalidArgumentError, match="cannot be used with --ray"):
        load(family_models.hf("mixtral"), "2GiB", ray="auto", prefer_cached=0.5, **COMMON)


def _kill_during(eng, pid: int, after: int, **gen):
    """Generate, SIGKILL worker ``pid`` after ``after`` tokens; (tokens, error, seconds to the error)."""
    tokens, t_kill = [], None
    try:
        for step in eng.stream(PROMPT, max_new_tokens=12, ignore_eos=True, speculate=False, **gen):
            tokens.append(step.token_id)
            if len(tokens) == after:
                os.kill(pid, signal.SIGKILL)
                t_kill = time.monotonic()
    except ExpertReadError as e:
        return tokens, e, time.monotonic() - t_kill
    return tokens, None, None


def test_worker_killed_mid_generation(family_models, cluster):
    from sluice.cluster.errors import WorkerLostError

    path = family_models.hf("mixtral")
    with load(path, "2GiB", **COMMON) as eng:
        expected = eng.generate(PROMPT, max_new_tokens=12, ignore_eos=True, speculate=False).token_ids
    with load(path, "2GiB", ray="auto", expert_workers=2, **COMMON) as eng:
        pid = eng.experts.info[0]["pid"]
        tokens, err, seconds = _kill_during(eng, pid, 3)
        assert isinstance(err, WorkerLostError), err
        assert "expert worker" in str(err) and "restarts" in str(err)
        assert seconds < 10, f"a dead worker took {seconds:.1f} s to notice"
        assert tokens == expected[: len(tokens)]
        # the driver keeps serving: Ray restarts the worker, the next request runs on it
        again = eng.generate(PROMPT, max_new_tokens=12, ignore_eos=True, speculate=False).token_ids
        assert again == expected
        assert eng.experts.worker_stats()[0]["pid"] != pid
        # the graph lost with the worker, rebuilt over the restarted one
        assert eng.experts.graph_fallbacks >= 1 and eng.experts.graph_builds >= 2
        # every expert with a replica: the lost worker's experts are retried there, the tokens unchanged
        use(eng, 2, eng.desc.n_experts)
        tokens, err, _ = _kill_during(eng, eng.experts.worker_stats()[1]["pid"], 3)
        assert err is None and tokens == expected
        assert eng.experts.retries >= 1


def test_cli_run_with_ray_auto(text_model, cluster):
    """``sluice run --ray auto`` finds the cluster through RAY_ADDRESS and gives one process's tokens."""
    import json
    import subprocess
    import sys

    args = [text_model, "--prompt", "def f():", "--max-new-tokens", "6", "--ignore-eos", "--memory", "2GiB",
            "--cache-experts", "6", "--json"]
    with load(text_model, "2GiB", progress=False, cache_experts=6) as eng:
        expected = eng.generate("def f():", max_new_tokens=6, ignore_eos=True).token_ids
    out = subprocess.run([sys.executable, "-m", "sluice.cli", "run", *map(str, args), "--ray", "auto",
                          "--expert-workers", "1"], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, RAY_ADDRESS=cluster.address))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["token_ids"] == expected
    assert "RAY_ADDRESS" in out.stderr and "1 expert worker(s)" in out.stderr


def test_without_ray_installed_a_clear_error(monkeypatch):
    """No ray module: ``--ray`` says what to install (this test runs without ray too)."""
    import sys

    from sluice.cluster.connect import require_ray
    from sluice.cluster.errors import RayUnavailableError

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(RayUnavailableError, match=r'pip install "sluice\[ray\]"'):
        require_ray()


def test_worker_with_other_bits_refused(family_models, cluster):
    """A worker whose signature differs from the driver's (here: another model at the path it opens)
    is refused at start, naming what differs; a worker budget too small for one expert says so."""
    from sluice.cluster.errors import ClusterError, WorkerMismatchError
    from sluice.cluster.model import open_experts, signature
    from sluice.cluster.provider import RayExperts

    mine = open_experts(str(family_models.hf("mixtral")))
    with pytest.raises(WorkerMismatchError, match=r"model: driver '\w+', worker '\w+'"):
        RayExperts(str(family_models.hf("qwen3_next")), signature(mine.checkpoint), mine.moe_layers, mine.n_experts,
                   workers=1, worker_memory=None, worker_opts={"cache_experts": 4})
    with pytest.raises(ClusterError, match=r"could not start: BudgetError: expert worker 0: --worker-memory 1\.00 MiB "
                                           r".*raise --worker-memory"):
        RayExperts(str(family_models.hf("mixtral")), signature(mine.checkpoint), mine.moe_layers, mine.n_experts,
                   workers=1, worker_memory=1 << 20)


# -- several sequences in one step (the runner's batching) --------------------------------------

MIXED_CHUNK = 4  # prefill_chunk: sequence a's 10-token prefill runs as chunks of 4, 4, 2
# counters that follow from the routing alone, so --ray counts them as one process does; hits,
# misses, reads, evictions and bytes depend on which cache holds what (the driver's one cache vs
# the workers' several) and are not compared
SAME_COUNTERS = ("forwards", "tokens_forwarded", "expert_union", "expert_seq_union", "expert_compute_calls",
                 "expert_lookups", "prefill_lookups")


def mixed_step(eng):
    """One step of three sequences (as tests/runtime/test_mixed_batch.py): a prefills 10 tokens, b decodes
    one token after its 7-token context, c verifies a token and a draft of 3 after its 6-token
    context. Returns (per-sequence logits, the counters the step moved)."""
    from sluice.runner import SeqState, SeqWork

    runner = eng.runner
    pa, pb, pc = PROMPT[:10], PROMPT[2:9], PROMPT[5:11]
    a, b, c = (SeqState(eng.model.new_state(COMMON["max_context"]), i) for i in range(3))
    runner.run(b, pb[:-1], 0, last_n=0)
    runner.run(c, pc[:-1], 0, last_n=0)
    before = runner.counters()
    res = runner.step([SeqWork(a, pa, 0, last_n=3), SeqWork(b, pb[-1:], len(pb) - 1, decoding=True),
                       SeqWork(c, pc[-1:] + [11, 12, 13], len(pc) - 1, last_n=4, decoding=True)])
    return [r.logits for r in res], runner.counters() - before


def test_mixed_step_and_batched_generate_as_one_process(family_models, cluster):
    """A mixed three-sequence step under --ray gives one process's logits bit for bit and the same
    routing counters (union, per-sequence unions, compute calls, decode and prefill lookups by
    segment); ``Engine.generate([p1, p2])`` (the scheduler batching two sequences) gives one
    process's tokens and counters."""
    path = family_models.hf("qwen3_next")
    prompts = [PROMPT, PROMPT[3:] + [9, 8]]
    gen = dict(max_new_tokens=5, ignore_eos=True, speculate=False)
    opts = dict(COMMON, prefill_chunk=MIXED_CHUNK, prefetch=False)
    with load(path, "2GiB", **opts) as eng:
        want, want_d = mixed_step(eng)
        before = eng.totals()
        want_gen = [r.token_ids for r in eng.generate(prompts, **gen)]
        want_gen_d = eng.totals() - before
    with load(path, "2GiB", ray="auto", expert_workers=2, **opts) as eng:
        got, d = mixed_step(eng)
        before = eng.totals()
        got_gen = [r.token_ids for r in eng.generate(prompts, **gen)]
        gen_d = eng.totals() - before
    for i in range(3):
        assert torch.equal(got[i], want[i]), f"sequence {i}"
    assert d.expert_seq_union > d.expert_union > 0 and d.expert_lookups > 0 and d.prefill_lookups > 0
    assert d.expert_compute_calls == d.expert_union
    assert {k: getattr(d, k) for k in SAME_COUNTERS} == {k: getattr(want_d, k) for k in SAME_COUNTERS}
    assert got_gen == want_gen
    assert gen_d.expert_seq_union > gen_d.expert_union  # the two sequences shared steps
    assert {k: getattr(gen_d, k) for k in SAME_COUNTERS} == {k: getattr(want_gen_d, k) for k in SAME_COUNTERS}


def test_worker_memory_no_node_has_fails_at_once(family_models, cluster):
    """``--worker-memory`` larger than any node: an error naming the size at once, not minutes of silence."""
    from sluice.cluster.errors import ClusterError

    t0 = time.monotonic()
    with pytest.raises(ClusterError, match=r"no node of the Ray cluster has 100\.00 TiB for an expert worker"):
        load(family_models.hf("mixtral"), "2GiB", ray="auto", worker_memory="100TiB", ray_timeout=5, **COMMON)
    assert time.monotonic() - t0 < 30


def test_own_clusters_finds_this_users_cluster(cluster):
    """``--ray auto`` without RAY_ADDRESS would join the fixture's cluster: this user started it."""
    from sluice.cluster.connect import own_clusters

    port = cluster.address.rpartition(":")[2]
    assert any(a.endswith(f":{port}") for a in own_clusters())


def test_cli_nothing_listening_is_one_line_in_bounded_time(text_model, cluster):
    """``--ray HOST:PORT`` with nothing there: progress lines, then one error naming it, in --ray-timeout."""
    import subprocess
    import sys

    from serve_process import free_port

    port = free_port()
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "sluice.cli", "run", str(text_model), "-p", "x", "--ray",
                          f"127.0.0.1:{port}", "--ray-timeout", "6", "--no-progress"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    lines = out.stderr.strip().splitlines()
    assert lines[-1] == (f"sluice: error: --ray 127.0.0.1:{port}: nothing is listening there (connection refused) "
                         f"for 6 s (--ray-timeout): no Ray cluster is running at 127.0.0.1:{port} (start one "
                         f"there with: ray start --head --port {port})"), out.stderr
    assert any(line.startswith(f"sluice: waiting for a Ray cluster at 127.0.0.1:{port}") for line in lines[:-1])
    assert time.monotonic() - t0 < 60


def test_workers_that_cannot_all_be_placed_fail_within_ray_timeout(family_models, cluster):
    """One worker more than the nodes can hold (each node's memory fits one): an error after
    ``ray_timeout`` seconds saying how many did not start and what each asked for."""
    import ray

    from sluice.cluster.errors import ClusterError

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    each = int(min(n["Resources"]["memory"] for n in nodes) * 0.6)
    t0 = time.monotonic()
    with pytest.raises(ClusterError, match=r"[1-4] of 4 expert workers did not start within 4 s \(--ray-timeout\): "
                                           r"each needs .* of Ray memory"):
        load(family_models.hf("mixtral"), "2GiB", ray="auto", expert_workers=len(nodes) + 1, worker_memory=each,
             ray_timeout=4, **COMMON)
    assert time.monotonic() - t0 < 30
