"""The expert interface over Ray actors: the driver routes, workers compute, the driver folds.

Per MoE layer ``RayExperts.moe`` groups the rows by expert as ``ExpertProvider.moe`` does
(both with ``experts.fold.Groups``), picks a worker for each routed expert
(``placement.Placement``), sends every worker the rows routed to its experts (hidden states,
and per expert its rows and weights) in one call, all workers of the layer at once, and folds
the returned outputs in ascending expert order into a zero tensor with the same operations as
the single process (``experts.fold.Fold``: ``acc += y`` for one row, ``acc.index_add_`` for
more). The outputs are computed by the same functions on the same rows (the driver checks each
worker's kernel signature), so logits are bit-identical to one process.

The requests go through one Ray compiled graph of all workers (``ExpertWorker.step`` per
worker, built on first use: one ``execute`` per layer over shared-memory channels, each worker
getting its request or None), or with ``compiled=False`` (``--ray-plain-calls``) as one plain
actor call per worker with something to do; the requests, and so the bits, are the same. A
layer of decoding rows puts replicated experts on the fewest workers (``Placement.assign(pack=)``).

The driver holds no expert cache. The lookahead's prediction for the next layer travels with
this layer's request (a worker that gets no rows this layer gets it alone, not waited for).

Failure: a worker that dies fails its call (Ray notices a dead process at once); the driver
retries the call's experts on their replicas if every one has a live replica, otherwise the
forward fails with ``WorkerLostError`` (an ``ExpertReadError``) naming the worker and layer.
Ray restarts the actor (``max_restarts``); calls made while it restarts wait for it. A lost
worker breaks the compiled graph: the answers already in are kept, the graph is dropped and the
rest of the layer re-sent as plain calls; the graph is built again once every worker is back.
"""

from __future__ import annotations

import logging
import re
import time

import torch

from ..experts.fold import Fold, Groups
from ..experts.interface import ExpertInterface
from ..experts.counters import ExpertCounters
from .connect import require_ray
from .errors import ClusterError, InvalidArgumentError, WorkerLostError, WorkerMismatchError
from .model import differences
from .placement import Placement
from .start import await_workers, check_fits
from .worker import ExpertWorker

MAX_RESTARTS = 1000  # Ray restarts a dead worker this many times
START_TIMEOUT_S = 300.0  # workers import torch and open the model
CALL_TIMEOUT_S = 600.0  # one layer's call (a cold prefill chunk reads all its experts)


class RayExperts(ExpertInterface):
    def __init__(self, location: str, signature: dict, moe_layers: list[int], n_experts: int, *, workers: int | None,
                 worker_memory: int | None, replicate_hot: int = 0, worker_opts: dict | None = None,
                 timeout: float = START_TIMEOUT_S, compiled: bool = True):
        ray = self._ray = require_ray()
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        self.n_workers = workers or max(1, len(nodes))
        if self.n_workers < 1:
            raise InvalidArgumentError(f"expert_workers (--expert-workers) must be at least 1, got {workers}")
        self.n_experts = n_experts
        self.signature = signature
        self.placement = Placement(moe_layers, n_experts, self.n_workers, replicate_hot)
        self.counters = ExpertCounters()
        self._evictions = 0
        self._bytes = 0
        self._predictions: dict[int, list[int]] = {}
        self._pending: tuple[int, list[int]] | None = None  # the next layer's prediction, sent with this layer
        self.dispatch_s = 0.0  # seconds in moe calls (round trips and worker compute), all layers
        self.dispatch_calls = 0  # MoE layers dispatched
        self.retries = 0  # worker calls re-sent to a replica after a worker was lost
        self.lost = 0  # worker calls that failed
        self._down: set[int] = set()  # workers lost by an earlier call: waited for before the next
        self.compiled = compiled  # a layer's requests through one compiled graph of all workers
        self.pack_decoding = True  # decoding layers on as few workers as the placement allows (benchmarks: off)
        self._graph = None  # built on first use, dropped when a worker is lost
        self.worker_calls = 0  # requests sent to workers (computing or prefetch only), all layers
        self.graph_builds = 0
        self.graph_fallbacks = 0  # graph executions that lost a worker (the layer re-sent as plain calls)
        # per worker, counted by the driver from the calls' answers (no call to read them: /metrics)
        self._per = [dict(index=i, calls_total=0, experts_computed_total=0, rows_computed_total=0, lookups_total=0,
                          hits_total=0, bytes_read_total=0, lost_total=0) for i in range(self.n_workers)]
        opts = dict(worker_opts or {})
        opts["memory"] = worker_memory
        per_node = -(-self.n_workers // max(1, len(nodes)))
        if not opts.get("threads"):
            cpus = min((int(n.get("Resources", {}).get("CPU", 1)) for n in nodes), default=1)
            opts["threads"] = max(1, cpus // per_node)
        if worker_memory:
            check_fits(nodes, worker_memory)
        res = {"memory": worker_memory} if worker_memory else {}
        actor = ray.remote(ExpertWorker).options(num_cpus=0, max_restarts=MAX_RESTARTS, max_task_retries=0,
                                                 scheduling_strategy="SPREAD", **res)
        self.workers = [actor.remote(i, str(location), opts) for i in range(self.n_workers)]
        try:
            hellos = await_workers(ray, self.workers, timeout, worker_memory)
        except ClusterError:
            self.close()
            raise
        except Exception as e:  # noqa: BLE001 - a worker's __init__ error arrives wrapped by Ray
            self.close()
            raise ClusterError(f"expert workers could not start: {_cause(e)}") from None
        for h in hellos:
            self._check(h, closing=True)
        self.info = hellos

    def _check(self, h: dict, closing: bool = False) -> None:
        diff = differences(self.signature, h["signature"])
        if diff:
            if closing:
                self.close()
            raise WorkerMismatchError(
                f"expert worker {h['index']} on {h['host']} would not give this process's bits: "
                + "; ".join(diff) + " (install the same sluice and torch, and the same model, on every machine)")

    def _await_restarted(self, block: bool = True) -> None:
        """Before a call: wait for workers lost earlier to be restarted by Ray (and check them again);
        ``block=False``: only take back those already up."""
        ray = self._ray
        for w in sorted(self._down):
            if not block:
                try:
                    h = ray.get(self.workers[w].hello.remote(), timeout=1.0)
                except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
                    continue
                except ray.exceptions.RayActorError as e:
                    raise WorkerLostError(f"expert worker {w} is gone for good: {_cause(e)}") from None
                self._check(h)
                self.info[w] = h
                self._down.discard(w)
                continue
            deadline = time.monotonic() + START_TIMEOUT_S
            while True:
                try:
                    h = ray.get(self.workers[w].hello.remote(), timeout=START_TIMEOUT_S)
                    break
                except ray.exceptions.ActorUnavailableError:  # still restarting
                    if time.monotonic() > deadline:
                        raise WorkerLostError(f"expert worker {w} did not come back within {START_TIMEOUT_S:.0f} s "
                                              "of being lost") from None
                    time.sleep(0.2)
                except ray.exceptions.RayActorError as e:
                    raise WorkerLostError(f"expert worker {w} is gone for good: {_cause(e)}") from None
            self._check(h)
            self.info[w] = h
            self._down.discard(w)

    # -- the interface -----------------------------------------------------------------------

    def begin(self, ctx) -> None:
        self.placement.tick()

    @property
    def evictions(self) -> int:
        return self._evictions

    @property
    def bytes_read_elsewhere(self) -> int:
        return self._bytes

    def resident_mask(self, layer: int) -> torch.Tensor:
        raise InvalidArgumentError("prefer_cached (--prefer-cached) needs the expert cache in this process; "
                                   "it cannot be used with --ray")

    def prefetch(self, layer: int, experts: list[int], read: bool = True, distance: int = 1,
                 probs: list[float] | None = None) -> None:
        if distance != 1:
            return  # the prediction travels with the previous layer's request: one layer ahead only
        self._predictions[layer] = list(experts)
        if read:
            self._pending = (layer, list(experts))

    def moe(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, ctx,
            logits: torch.Tensor | None = None) -> torch.Tensor:
        t0 = time.perf_counter()
        if ctx.record is not None:  # no router probabilities: the driver holds no cache policy to rank for
            ctx.record.routing[layer] = (ids, weights, None)
        groups = Groups(ids, weights)  # grouped and folded as ExpertProvider.moe does (experts.fold)
        experts = groups.experts
        decoding = ctx.decoding
        # no far predictions: see prefetch
        self._count_predictions(set(experts), self._predictions.pop(layer, None), decoding=decoding)
        decode = self._count_union(ids, experts, ctx)  # union, seq_union; the decode lookups (as ExpertProvider)
        # per expert: (global row index tensor or None, weight)
        work = {e: groups.work(e) for e in experts}
        # decoding rows only: as few workers as the placement allows (a round trip per worker called)
        pack = self.pack_decoding and all(seg.decoding for seg in ctx.segments)
        assign = self.placement.assign(layer, {e: groups.count(e) for e in experts}, pack=pack)
        results = self._run(layer, x, groups.one_row, work, assign, decode, decoding)
        fold = Fold(x, experts)
        for e in experts:
            fold.add(e, work[e][0], results[e])
        acc = fold.result()
        self.dispatch_s += time.perf_counter() - t0
        self.dispatch_calls += 1
        return acc

    # -- dispatch ------------------------------------------------------------------------------

    def _requests(self, layer: int, x: torch.Tensor, one_row: bool, work: dict, assign: dict[int, int],
                  decode: set[int], prefetch, decoding: bool) -> tuple[dict[int, tuple], dict[int, tuple]]:
        """Each worker's request for this layer, as ``ExpertWorker.step`` takes it: ``("compute",
        args)`` for a worker with experts, ``("prefetch", (layer, experts))`` for one that only gets
        the next layer's prediction; and per computing worker ``(experts, rows)``, ``rows`` the
        layer's rows the request sent (None: all, one row) in its order. ``decode``: the experts
        some decoding row routed to (the worker counts them as decode lookups, the rest as prefill
        lookups)."""
        per: dict[int, list[int]] = {}
        for e, w in assign.items():
            per.setdefault(w, []).append(e)
        by_worker: dict[int, tuple[int, list[int]]] = {}
        if prefetch is not None:
            nxt, pred = prefetch
            for e in pred:
                by_worker.setdefault(self.placement.home(nxt, e), (nxt, []))[1].append(e)
        threads = torch.get_num_threads()
        requests, sent = {}, {}
        for w, es in per.items():
            if one_row:
                xs, items, used = x, [(e, None, work[e][1]) for e in es], None
            else:
                used = sorted({r for e in es for r in work[e][0].tolist()})
                local = {r: i for i, r in enumerate(used)}
                xs = x[torch.tensor(used)]
                items = [(e, torch.tensor([local[r] for r in work[e][0].tolist()]), work[e][1]) for e in es]
            requests[w] = ("compute", (layer, one_row, xs, items, by_worker.pop(w, None), decoding, threads,
                                       [e for e in es if e in decode]))
            sent[w] = (es, used)
        for w, pf in by_worker.items():  # workers with nothing this layer: the prediction alone
            requests[w] = ("prefetch", pf)
        self.worker_calls += len(requests)
        return requests, sent

    def _send_plain(self, requests: dict[int, tuple]) -> dict[int, object]:
        """One plain actor call per request; returns {worker: ref} of the computing ones."""
        refs = {}
        for w, (kind, args) in requests.items():
            if kind == "compute":
                refs[w] = self.workers[w].compute.remote(*args)
            else:
                self.workers[w].prefetch.remote(*args)
        return refs

    def _graph_for(self):
        """The compiled graph of all workers (built on first use and after a worker was lost and came
        back: a graph holds the channels of the actor processes it was built with)."""
        if self._graph is None:
            from ray.dag import InputNode, MultiOutputNode

            with InputNode() as inp:
                dag = MultiOutputNode([w.step.bind(inp[i]) for i, w in enumerate(self.workers)])
            self._graph = dag.experimental_compile()
            self.graph_builds += 1
        return self._graph

    def _drop_graph(self) -> None:
        graph, self._graph = self._graph, None
        if graph is None:
            return
        quiet = logging.getLogger("ray.dag.compiled_dag_node")  # a lost actor's channels log their teardown
        level, quiet.level = quiet.level, logging.CRITICAL
        try:
            graph.teardown()
        except Exception:  # noqa: BLE001 - an actor of the graph is gone: nothing left to tear down there
            pass
        finally:
            quiet.setLevel(level)

    def _run_graph(self, layer: int, requests: dict[int, tuple], sent: dict[int, tuple]):
        """The layer's requests through the compiled graph: every worker gets its request or None in
        one execution. Returns (results, lost) as ``_run_plain``: on a lost worker the graph is
        dropped, the answers already in are kept and the caller re-sends the rest as plain calls."""
        ray = self._ray
        refs = self._graph_for().execute(*[requests.get(w) for w in range(self.n_workers)])
        results: dict[int, torch.Tensor] = {}
        for w, ref in enumerate(refs):
            try:
                answer = ray.get(ref, timeout=CALL_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - Ray wraps what happened on the worker
                err = self._classify(e)
                if not isinstance(err, WorkerLostError):
                    for r in refs[w + 1:]:  # the execution's other answers, so the graph stays usable
                        try:
                            ray.get(r, timeout=CALL_TIMEOUT_S)
                        except Exception:  # noqa: BLE001
                            pass
                    raise layer_rows(err, sent[w][1] if w in sent else None) from None
                self.graph_fallbacks += 1
                self._drop_graph()
                return results, {g: str(err) for g in self._gone(e)} or {w: str(err)}
            if w in sent:
                outs, deltas = answer
                self._count(deltas, w, outs)
                results.update(zip(sent[w][0], outs))
        return results, {}

    def _gone(self, e: BaseException) -> set[int]:
        """The workers a failed graph execution lost: the actor the error names, else those that do
        not answer."""
        actor = getattr(e, "actor_id", None) or getattr(getattr(e, "cause", None), "actor_id", None)
        if actor:
            hit = {i for i, w in enumerate(self.workers) if w._actor_id.hex() == actor}
            if hit:
                return hit
        gone = set()
        for i, w in enumerate(self.workers):
            try:
                self._ray.get(w.hello.remote(), timeout=5.0)
            except Exception:  # noqa: BLE001
                gone.add(i)
        return gone

    def _run_plain(self, layer: int, requests: dict[int, tuple], sent: dict[int, tuple]):
        """The layer's requests as plain actor calls. Returns (results, lost)."""
        ray = self._ray
        results: dict[int, torch.Tensor] = {}
        lost: dict[int, str] = {}
        for w, ref in self._send_plain(requests).items():
            es, used = sent[w]
            try:
                outs, deltas = ray.get(ref, timeout=CALL_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - Ray wraps what happened on the worker
                err = self._classify(e)
                if not isinstance(err, WorkerLostError):
                    raise layer_rows(err, used) from None
                lost[w] = str(err)
                continue
            self._count(deltas, w, outs)
            results.update(zip(es, outs))
        return results, lost

    def _lose(self, lost: dict[int, str]) -> None:
        for w in lost:
            self.lost += 1
            self._per[w]["lost_total"] += 1
            self._down.add(w)

    def _run(self, layer: int, x, one_row: bool, work: dict, assign: dict[int, int],
             decode: set[int], decoding: bool) -> dict[int, torch.Tensor]:
        if self._down:  # run on replicas while a lost worker restarts; wait for it if some expert has none
            self._await_restarted(block=False)
            if self._down:
                assign = self.placement.assign(layer, {e: 1 for e in assign}, exclude=self._down, count=False)
                if any(w in self._down for w in assign.values()):
                    self._await_restarted()
        prefetch, self._pending = self._pending, None
        requests, sent = self._requests(layer, x, one_row, work, assign, decode, prefetch, decoding)
        run = self._run_graph if self.compiled and not self._down else self._run_plain
        results, lost = run(layer, requests, sent)
        if lost or len(results) < len(assign):  # re-send what is missing as plain calls, on replicas of the lost
            self._lose(lost)
            todo = {e: w for e, w in assign.items() if e not in results}
            retry = self.placement.assign(layer, {e: 1 for e in todo}, exclude=set(lost), count=False)
            self._no_replica(layer, todo, retry, lost)
            self.retries += 1
            requests, sent = self._requests(layer, x, one_row, work, retry, decode, None, decoding)
            more, again = self._run_plain(layer, requests, sent)
            if again:
                self._lose(again)
                self._no_replica(layer, retry, retry, again)
            results.update(more)
        return results

    @staticmethod
    def _no_replica(layer: int, todo: dict[int, int], assign: dict[int, int], lost: dict[int, str]) -> None:
        """Fail the forward if some expert of ``todo`` is left only on a lost worker."""
        stuck = sorted(e for e in todo if assign[e] in lost)
        if stuck:
            w = assign[stuck[0]]
            raise WorkerLostError(
                f"expert worker {w} was lost while computing layer {layer} ({lost[w]}); experts {stuck} have no "
                "live replica. Ray restarts the worker; the next request runs on it") from None

    def _classify(self, e: BaseException) -> Exception:
        """A Ray error as a Sluice one: a lost worker, or the worker's own error (re-raised as it was)."""
        ray = self._ray
        exc = ray.exceptions
        if isinstance(e, (exc.RayActorError, exc.GetTimeoutError, exc.WorkerCrashedError, exc.NodeDiedError)):
            return WorkerLostError(_cause(e))
        if isinstance(e, exc.RayTaskError):
            inner = getattr(e, "cause", None)
            return inner if isinstance(inner, Exception) else ClusterError(_cause(e))
        return ClusterError(_cause(e))

    def _count(self, d, w: int, outs: list) -> None:
        c = self.counters
        lookups, hits, prefill, demand, pf_used, wait_s, compute_s, ev, br, started = d
        if started != self.info[w]["started"]:  # Ray restarted it between calls: check it again
            h = self._ray.get(self.workers[w].hello.remote(), timeout=START_TIMEOUT_S)
            self._check(h)
            self.info[w] = h
        p = self._per[w]
        c.compute_calls += len(outs)  # one per expert of the layer's union (a lost call's are counted on retry)
        p["calls_total"] += 1
        p["experts_computed_total"] += len(outs)
        p["rows_computed_total"] += sum(y.shape[0] for y in outs)
        p["lookups_total"] += lookups
        p["hits_total"] += hits
        p["bytes_read_total"] += br
        c.lookups += lookups
        c.hits += hits
        c.misses += lookups - hits
        c.prefill_lookups += prefill
        c.demand_reads += demand
        c.prefetch_used += pf_used
        c.read_wait_s += wait_s
        c.compute_s += compute_s
        self._evictions += ev
        self._bytes += br

    # -- workers -------------------------------------------------------------------------------

    def worker_counters(self) -> list[dict]:
        """Per worker, what the driver counted from its answers (``/metrics``; asks no worker)."""
        return [dict(p) for p in self._per]

    def worker_stats(self) -> list[dict]:
        """Each worker's counters (calls, experts and rows computed, hits, reads, bytes, cache)."""
        out = []
        for i, w in enumerate(self.workers):
            try:
                out.append(self._ray.get(w.stats_now.remote(), timeout=30))
            except Exception as e:  # noqa: BLE001
                out.append({"index": i, "error": _cause(e)})
        return out

    @property
    def pooled_slots(self) -> int:
        """Expert cache slots of all workers together."""
        return sum(h["slots"] for h in self.info)

    def describe(self) -> str:
        slots = sum(h["slots"] for h in self.info)
        hosts = sorted({h["host"] for h in self.info})
        return (f"{self.n_workers} expert worker(s) on {len(hosts)} host(s), {slots} cache slots in all "
                f"({', '.join(str(h['slots']) for h in self.info)})")

    def close(self) -> None:
        ray = self._ray
        if getattr(self, "_graph", None) is not None:
            self._drop_graph()
        for w in getattr(self, "workers", []):
            try:
                ray.kill(w, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.workers = []


def layer_rows(err: Exception, used: list[int] | None) -> Exception:
    """A worker's failed read names the rows of its request (``x[used]``, as the provider's
    ``run_experts`` names them): rename them the layer's rows, so the runner fails only the
    sequences whose rows needed the expert, as in one process."""
    rows = getattr(err, "rows", None)
    if used is not None and rows:
        err.rows = sorted({used[r] for r in rows})
    return err


def _cause(e: BaseException) -> str:
    """What Ray reports, without its traceback: the worker's own error line if it raised one (a
    failed ``__init__``: "BudgetError: ..."), else the first line."""
    text = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    for line in reversed(text):
        m = re.match(r"^(?:[A-Za-z_][\w.]*\.)?([A-Z]\w*(?:Error|Exception)): (.+)$", line)
        if m:
            return f"{m.group(1)}: {m.group(2)}"
    return text[0] if text else type(e).__name__


__all__ = ["RayExperts"]
