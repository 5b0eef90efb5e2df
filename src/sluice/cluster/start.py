"""Placing and starting the expert workers in bounded time, saying why when they cannot start.

Ray keeps an actor that no node can take pending without a word (its autoscaler may add a node
some day); Sluice instead checks first that some node has the ``memory`` a worker asks for
(``--worker-memory``), waits for the workers' first answers at most ``--ray-timeout`` seconds
with a line on stderr every few seconds, and then fails naming what is missing.
"""

from __future__ import annotations

import sys
import time

from ..units import format_size
from .errors import ClusterError

PROGRESS_EVERY_S = 5.0


def _node_memory(node: dict) -> int:
    return int(node.get("Resources", {}).get("memory", 0))


def check_fits(nodes: list[dict], worker_memory: int) -> None:
    """``ClusterError`` if no live node's schedulable memory holds one worker's ``worker_memory``."""
    if not nodes:
        raise ClusterError("the Ray cluster has no live node to start expert workers on")
    best = max(_node_memory(n) for n in nodes)
    if best < worker_memory:
        raise ClusterError(
            f"no node of the Ray cluster has {format_size(worker_memory)} for an expert worker (--worker-memory "
            f"{format_size(worker_memory)}): the largest node offers {format_size(best)} of Ray memory "
            f"({len(nodes)} node(s)); give a smaller --worker-memory, or add a larger node")


def await_workers(ray, workers: list, timeout: float, worker_memory: int | None, say=None) -> list[dict]:
    """Every worker's ``hello`` (in order), waiting at most ``timeout`` seconds in all; a worker's own
    error is re-raised as Ray gives it (the caller names it)."""
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    refs = [w.hello.remote() for w in workers]
    start = time.monotonic()
    next_say = start + PROGRESS_EVERY_S
    pending = list(refs)
    while pending:
        left = timeout - (time.monotonic() - start)
        if left <= 0:
            break
        done, pending = ray.wait(pending, num_returns=len(pending), timeout=min(left, 1.0))
        if done:
            ray.get(done)  # a worker that failed to start raises here, with its own error
        now = time.monotonic()
        if pending and now >= next_say:
            say(f"sluice: waiting for expert workers: {len(refs) - len(pending)} of {len(refs)} started, "
                f"{now - start:.0f} s of {timeout:.0f} s (--ray-timeout)")
            next_say = now + PROGRESS_EVERY_S
    if pending:
        n = len(pending)
        free = ray.available_resources().get("memory")
        need = f" each needs {format_size(worker_memory)} of Ray memory," if worker_memory else ""
        room = f" {format_size(int(free))} is free in the cluster" if free is not None else ""
        raise ClusterError(
            f"{n} of {len(refs)} expert workers did not start within {timeout:.0f} s (--ray-timeout):{need}{room} "
            "(fewer --expert-workers, a smaller --worker-memory, or a longer --ray-timeout if the "
            "machines are only slow to start them)")
    return ray.get(refs)
