"""Replay expert-routing traces through cache policies: hit rates next to Belady's optimum.

The replay runs the engine's own cache, ``ExpertCache`` and ``ExpertProvider`` with the
engine's policy classes, over weightless experts (``CacheSim``: empty one-byte records,
reads that complete inside ``submit``, expert compute that does nothing). It has no cache
loop of its own, so what it measures is what the engine does:

* one ``tick()`` per decode token, before its first layer;
* ``semantics="engine"`` (default): one ``ExpertProvider.moe`` call per token and layer:
  ``begin_layer``, the layer's experts looked up (a hit is an expert resident at lookup;
  hits are ``access``-ed and pinned), then the misses fetched in ascending id order, each
  evicting the policy's victim among keys *not* used by this layer, then ``insert``-ed;
* ``semantics="sequential"``: one ``moe`` call per (layer, expert) access, in ascending id
  order, so only the expert being fetched is pinned and a miss may evict an expert the same
  layer uses later in the token. This is the model behind the reference figures of the
  OLMoE trace's README (LRU 0.571, Belady 0.747 at 16 slots per layer);
* ``predictions`` (traces that record the lookahead's predictions): before layer L runs,
  the prediction for layer L+1 goes to ``ExpertProvider.prefetch``, as the engine's
  lookahead does it, either as a hint to the policy only or with its speculative reads.

Caches are either one per layer (``scope="layer"``: each layer its own ``C`` slots) or one
global pool of ``layers x C`` slots (``scope="global"``, as in the engine). ``Belady`` is a
policy fed with next-use positions precomputed over the access sequence: it evicts the
resident key whose next use is furthest in the future (O(log n) per operation, lazy heap).
"""

from .policies import (
    ARC,
    LFU,
    NEVER,
    STUDY_POLICIES,
    Belady,
    HorizonBelady,
    ProbationLFRU,
    TwoQ,
    access_order,
    access_steps,
    next_uses,
)
from .report import DEFAULT_POLICIES, Report, build_report, describe, parse_capacities, parse_slice, render, run_cli
from .sim import (
    DEFAULT_MULTIPLES,
    PREDICTIONS,
    SCOPES,
    SEMANTICS,
    CacheSim,
    ReplayResult,
    capacities_for,
    pins_fit,
    replay,
    sweep,
)
from .synthetic import MAX_SYNTHETIC_LOOKUPS, SyntheticSpec, synthetic_trace

__all__ = ["ARC", "DEFAULT_MULTIPLES", "DEFAULT_POLICIES", "LFU", "MAX_SYNTHETIC_LOOKUPS", "NEVER", "PREDICTIONS",
           "SCOPES", "SEMANTICS", "STUDY_POLICIES", "Belady", "HorizonBelady", "CacheSim", "ProbationLFRU",
           "ReplayResult", "Report", "SyntheticSpec", "TwoQ", "access_order", "access_steps", "build_report",
           "capacities_for", "describe", "next_uses", "parse_capacities", "parse_slice", "pins_fit", "render",
           "replay", "run_cli", "sweep", "synthetic_trace"]
