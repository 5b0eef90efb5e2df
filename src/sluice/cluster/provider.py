"""The expert interface over Ray actors: the driver routes, workers compute, the driver folds.

Per MoE layer ``RayExperts.moe`` groups the rows by expert as ``ExpertProvider.moe`` does
(both with ``experts.fold.Groups``), picks a worker for each routed expert
(``placement.Placement``), sends every worker the rows routed to its experts (hidden states,
and per expert its rows and weights) in one call, all workers of the layer at once, and folds
the returned outputs in ascending expert order into a zero tensor with the same operations as
the single process (``experts.fold.Fold``: ``acc += y`` for one row, ``acc.index_add_`` for
more). The outputs are computed by the same functions on the same rows (the driver checks each
worker's kernel signature), so logits are bit-identical to one process.

The driver holds no expert cache. The lookahead's prediction for the next layer travels with
this layer's request (a worker that gets no rows this layer gets it alone, not waited for).

Failure: a worker that dies fails its call (Ray notices a dead process at once); the driver
retries the call's experts on their replicas if every one has a live replica, otherwise the
forward fails with ``WorkerLostError`` (an ``ExpertReadError``) naming the worker and layer.
Ray restarts the actor (``max_restarts``); calls made while it restarts wait for it.
"""

from __future__ import annotations

import re
import time

import torch

from ..experts.fold import Fold, Groups
from ..experts.interface import ExpertInterface
from ..experts.provider import ExpertCounters
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
                 timeout: float = START_TIMEOUT_S):
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
        assign = self.placement.assign(layer, {e: groups.count(e) for e in experts})
        results = self._run(layer, x, groups.one_row, work, assign, decode, decoding)
        fold = Fold(x, experts)
        for e in experts:
            fold.add(e, work[e][0], results[e])
        acc = fold.result()
        self.dispatch_s += time.perf_counter() - t0
        self.dispatch_calls += 1
        return acc

    # -- dispatch ------------------------------------------------------------------------------

    def _calls(self, layer: int, x: torch.Tensor, one_row: bool, work: dict, assign: dict[int, int], decode: set[int],
               prefetch, decoding: bool):
        """Send one call per worker with experts; returns {ref: (worker, [experts], rows)}, ``rows`` the
        layer's rows the call sent (None: all, one row) in its order. ``decode``: the
        experts some decoding row routed to (the worker counts them as decode lookups, the rest as
        prefill lookups)."""
        per: dict[int, list[int]] = {}
        for e, w in assign.items():
            per.setdefault(w, []).append(e)
        by_worker: dict[int, tuple[int, list[int]]] = {}
        if prefetch is not None:
            nxt, pred = prefetch
            for e in pred:
                by_worker.setdefault(self.placement.home(nxt, e), (nxt, []))[1].append(e)
        threads = torch.get_num_threads()
        calls = {}
        for w, es in per.items():
            if one_row:
                xs, items, used = x, [(e, None, work[e][1]) for e in es], None
            else:
                used = sorted({r for e in es for r in work[e][0].tolist()})
                local = {r: i for i, r in enumerate(used)}
                xs = x[torch.tensor(used)]
                items = [(e, torch.tensor([local[r] for r in work[e][0].tolist()]), work[e][1]) for e in es]
            ref = self.workers[w].compute.remote(layer, one_row, xs, items, by_worker.pop(w, None), decoding,
                                                 threads, [e for e in es if e in decode])
            calls[ref] = (w, es, used)
        for w, pf in by_worker.items():  # workers with nothing this layer: the prediction alone
            self.workers[w].prefetch.remote(*pf)
        return calls

    def _run(self, layer: int, x, one_row: bool, work: dict, assign: dict[int, int],
             decode: set[int], decoding: bool) -> dict[int, torch.Tensor]:
        ray = self._ray
        if self._down:  # run on replicas while a lost worker restarts; wait for it if some expert has none
            self._await_restarted(block=False)
            if self._down:
                assign = self.placement.assign(layer, {e: 1 for e in assign}, exclude=self._down, count=False)
                if any(w in self._down for w in assign.values()):
                    self._await_restarted()
        prefetch, self._pending = self._pending, None
        calls = self._calls(layer, x, one_row, work, assign, decode, prefetch, decoding)
        results: dict[int, torch.Tensor] = {}
        lost: dict[int, str] = {}
        for ref, (w, es, used) in calls.items():
            try:
                outs, deltas = ray.get(ref, timeout=CALL_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - Ray wraps what happened on the worker
                err = self._classify(e)
                if not isinstance(err, WorkerLostError):
                    raise layer_rows(err, used) from None
                self.lost += 1
                self._per[w]["lost_total"] += 1
                self._down.add(w)
                lost[w] = str(err)
                continue
            self._count(deltas, w, outs)
            results.update(zip(es, outs))
        if lost:
            todo = {e: w for e, w in assign.items() if e not in results}
            retry = self.placement.assign(layer, {e: 1 for e in todo}, exclude=set(lost), count=False)
            if any(retry[e] in lost for e in todo):
                w = next(iter(lost))
                raise WorkerLostError(
                    f"expert worker {w} was lost while computing layer {layer} ({lost[w]}); experts "
                    f"{sorted(e for e in todo if retry[e] in lost)} have no live replica. Ray restarts the "
                    "worker; the next request runs on it") from None
            self.retries += 1
            again = self._calls(layer, x, one_row, work, retry, decode, None, decoding)
            for ref, (w, es, used) in again.items():
                try:
                    outs, deltas = ray.get(ref, timeout=CALL_TIMEOUT_S)
                except Exception as e:  # noqa: BLE001
                    raise layer_rows(self._classify(e), used) from None
                self._count(deltas, w, outs)
                results.update(zip(es, outs))
        return results

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
