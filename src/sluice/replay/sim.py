"""The replay itself: a routing trace through the engine's own expert cache and provider."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from ..errors import InvalidArgumentError
from ..experts.cache import ExpertCache
from ..experts.layout import ExpertLayout
from ..experts.policy import Pinned, Policy
from ..experts.policy_spec import make_policy
from ..experts.provider import ExpertProvider
from ..experts.source import ExpertSource
from ..experts.spec import ExpertSpec
from ..layers.context import ForwardContext
from ..trace import Trace
from .policies import STUDY_POLICIES, Belady, next_uses

SCOPES = ("layer", "global")
SEMANTICS = ("engine", "sequential")
PREDICTIONS = ("off", "hint", "prefetch")
DEFAULT_MULTIPLES = (1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # of one layer's top-k: 8,12,16,24,32,48 for top-8


# -- the replay ------------------------------------------------------------------------------


@dataclass
class ReplayResult:
    policy: str
    scope: str
    capacity: int  # experts per layer (C); the global cache has layers x C slots
    slots: int  # total slots over all caches
    multiple: float  # C / top-k: multiples of one token's working set
    hits: int
    lookups: int
    evictions: int
    prefetch_reads: int = 0  # with predictions="prefetch": speculative reads ...
    prefetch_used: int = 0  # ... and those the predicted layer used

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["hit_rate"] = self.hit_rate
        return d


class WeightlessExperts(ExpertSource):
    """Experts without bytes: every record is an empty one-byte slot and a read lands nothing."""

    format = "weightless"
    slot_bytes = 1
    _layout = ExpertLayout(reads=(), views=(), slot_bytes=1)

    def layout(self, layer, expert):
        return self._layout

    def read(self, layer, expert, buf, base=0, verify_crc=False):
        return self._layout

    @property
    def direct_io(self) -> bool:
        return False

    @property
    def record_bytes(self) -> int:
        return 0


class _Done:
    """A finished read: the part of ``concurrent.futures.Future`` the provider uses."""

    __slots__ = ("_value", "_error")

    def __init__(self, value, error):
        self._value, self._error = value, error

    def done(self) -> bool:
        return True

    def cancel(self) -> bool:
        return False

    def result(self):
        if self._error is not None:
            raise self._error
        return self._value


class _AtOnce:
    """A reader pool whose reads complete inside ``submit`` (in issue order)."""

    def submit(self, fn, *args, priority: int = 0, ticket=None) -> _Done:
        try:
            return _Done(fn(*args), None)
        except Exception as e:
            return _Done(None, e)

    def shutdown(self) -> None:
        pass


def _no_output(spec, weights, x, scale):
    return x


def _no_forward(spec, weights, x):
    return x


_SPEC = ExpertSpec(hidden=1, intermediate=1)


class CacheSim:
    """The engine's own expert cache and lookup loop (``ExpertCache`` + ``ExpertProvider.moe``)
    over weightless experts: reads complete at once, expert compute does nothing. Only the
    bookkeeping runs: lookups, pins, evictions, the policy's events and the counters."""

    def __init__(self, slots: int, policy: Policy, n_experts: int):
        self.cache = ExpertCache(slots, WeightlessExperts.slot_bytes, policy)
        self.provider = ExpertProvider(WeightlessExperts(), self.cache, _SPEC, n_experts, pool=_AtOnce(),
                                       compute=(_no_output, _no_forward))
        self._x = torch.zeros(1, 1)
        self._ctx: dict[int, ForwardContext] = {}  # a decoding forward of n rows, one per n

    def _context(self, rows: int) -> ForwardContext:
        ctx = self._ctx.get(rows)
        if ctx is None:
            ctx = self._ctx[rows] = ForwardContext.single(torch.zeros(rows, dtype=torch.long), decoding=True)
        return ctx

    def tick(self) -> None:
        self.cache.policy.tick()  # what the runner's ``experts.begin`` does before each forward

    def predict(self, layer: int, experts: Sequence[int], read: bool) -> None:
        """What the engine's lookahead does after the previous layer's attention."""
        self.provider.prefetch(layer, list(experts), read=read)

    def run_layer(self, layer: int, experts: Sequence[int], probs: Sequence[float] | None = None) -> None:
        """One decode token's MoE call for ``layer``, routed to ``experts``; ``probs``: the router's
        probability of every expert (handed over as the engine's MoE block does, as logits)."""
        self.run_rows(layer, [experts], None if probs is None else [probs])

    def run_rows(self, layer: int, rows: Sequence[Sequence[int]],
                 probs: Sequence[Sequence[float]] | None = None) -> None:
        """One step's MoE call for ``layer`` over several rows (sequences batched in one step, a
        verified draft), each routed to its experts: the union is looked up once, as in the engine."""
        k = max(len(r) for r in rows)
        # rows of fewer experts are padded with their own first expert (same union, zero weight)
        ids = torch.tensor([list(r) + [r[0]] * (k - len(r)) for r in rows])
        w = torch.tensor([[1.0] * len(r) + [0.0] * (k - len(r)) for r in rows])
        x = self._x if len(rows) == 1 else torch.zeros(len(rows), 1)
        logits = None if probs is None else torch.tensor(probs, dtype=torch.float32).clamp_min(1e-30).log()
        self.provider.moe(layer, x, ids, w, self._context(len(rows)), logits=logits)


def replay(trace: Trace, policy: str | Callable[[], Policy], capacity: int, scope: str = "layer",
           semantics: str = "engine", pins: Sequence[tuple[int, int]] = (),
           predictions: str = "off") -> ReplayResult:
    """Replay ``trace`` through caches of ``capacity`` experts per layer.

    ``policy`` is a policy spec (``"lru"``, ``"lfru:half_life=8"``, ``"belady"``) or a factory
    of fresh ``Policy`` objects (one per cache). ``pins`` wraps each cache's policy in
    ``Pinned`` (pinned keys are never evicted once resident). ``predictions`` (for traces
    that record the lookahead's predictions): ``"off"``, ``"hint"`` (the policy hears them,
    nothing is read) or ``"prefetch"`` (speculative reads, as the engine does; such a read
    completes at once, so a used prediction counts as a hit).
    """
    if scope not in SCOPES:
        raise InvalidArgumentError(f"scope must be one of {SCOPES}, got {scope!r}")
    if semantics not in SEMANTICS:
        raise InvalidArgumentError(f"semantics must be one of {SEMANTICS}, got {semantics!r}")
    if predictions not in PREDICTIONS:
        raise InvalidArgumentError(f"predictions must be one of {PREDICTIONS}, got {predictions!r}")
    if predictions != "off" and trace.pred is None:
        raise InvalidArgumentError(f"{trace.source}: the trace records no predictions "
                                   "(record one with --trace-routing)")
    layers, k = trace.layers, trace.top_k
    if capacity < 1:
        raise InvalidArgumentError("capacity must be at least 1 expert per layer")
    width = trace.step_width
    if semantics == "engine" and capacity < width:
        raise InvalidArgumentError(f"capacity {capacity} per layer cannot hold one layer's {width} experts of "
                                   "one step (engine semantics)")
    if isinstance(policy, str):
        spec = policy
        if spec == "belady":
            uses = next_uses(trace)

            def factory():
                return Belady(uses)
        else:
            make_policy(spec, STUDY_POLICIES)  # fail early on a bad spec

            def factory():
                return make_policy(spec, STUDY_POLICIES)
    else:
        factory = policy
    pin_set = frozenset(pins)
    if pin_set:
        why = pins_fit(trace, pins, capacity, scope)
        if why:
            raise InvalidArgumentError(f"pins do not fit at {capacity} experts per layer ({scope} scope): {why}")
    n_caches = layers if scope == "layer" else 1
    per_cache = capacity if scope == "layer" else capacity * layers
    n_experts = max(trace.experts, 1)
    sims = []
    for _ in range(n_caches):
        p = factory()
        sims.append(CacheSim(per_cache, Pinned(p, pin_set) if pin_set else p, n_experts))
    pol = sims[0].cache.policy
    label = pol.name if not isinstance(policy, str) else (policy if not pin_set else f"pinned({policy})")
    if predictions != "off":
        label += f" +{predictions}"
    read = predictions == "prefetch"
    pred = trace.pred if predictions != "off" else None
    probs = trace.probs
    sequential = semantics == "sequential"
    try:
        for group in trace.groups():  # one engine step: one tick, one moe call per layer for its rows
            for sim in sims:
                sim.tick()
            for layer in range(layers):
                if pred is not None and layer + 1 < layers:
                    guess = sorted({e for t in group for e in pred[t][layer + 1]})
                    if guess:
                        sims[layer + 1 if n_caches > 1 else 0].predict(layer + 1, guess, read)
                sim = sims[layer if n_caches > 1 else 0]
                rows = [trace.steps[t][layer] for t in group]
                if sequential:  # one expert per call: only the expert being fetched is pinned
                    for e in sorted({e for r in rows for e in r}):
                        sim.run_layer(layer, (e,))
                else:
                    sim.run_rows(layer, rows, None if probs is None else [probs[t][layer] for t in group])
    except RuntimeError as e:
        raise ValueError(f"{label}: {e}") from None
    hits = sum(s.provider.counters.hits for s in sims)
    lookups = sum(s.provider.counters.lookups for s in sims)
    evictions = sum(s.cache.evictions for s in sims)
    for s in sims:
        s.provider.close()
    res = ReplayResult(label, scope, capacity, per_cache * n_caches, capacity / k if k else 0.0,
                       hits, lookups, evictions)
    if read:
        res.prefetch_reads = sum(s.provider.counters.prefetch_reads for s in sims)
        res.prefetch_used = sum(s.provider.counters.prefetch_used for s in sims)
    return res


def pins_fit(trace: Trace, pins: Sequence[tuple[int, int]], capacity: int, scope: str) -> str | None:
    """Why ``pins`` cannot be pinned in caches of ``capacity`` per layer, or None if they can:
    every cache must keep one layer's top-k slots free of pins."""
    k, layers = trace.top_k, trace.layers
    if scope == "global":
        room = capacity * layers - k
        return None if len(pins) <= room else f"{len(pins)} pins leave fewer than {k} of {capacity * layers} slots"
    per: dict[int, int] = {}
    for layer, _ in pins:
        per[layer] = per.get(layer, 0) + 1
    worst = max(per.items(), key=lambda kv: kv[1], default=(0, 0))
    if worst[1] > capacity - k:
        return f"layer {worst[0]} has {worst[1]} pins, leaving fewer than {k} of its {capacity} slots"
    return None


def capacities_for(trace: Trace, multiples: Sequence[float] = DEFAULT_MULTIPLES) -> list[int]:
    """Experts per layer for multiples of one layer's top-k, deduplicated, within 1..experts."""
    k, n = trace.top_k, max(trace.experts, trace.top_k)
    least = min(n, trace.step_width)  # a step of several sequences needs its union resident
    out = sorted({min(n, max(least, round(m * k))) for m in multiples})
    return out


def sweep(trace: Trace, policies: Sequence[str], capacities: Sequence[int], scopes: Sequence[str] = SCOPES,
          semantics: str = "engine", belady: bool = True, pins: Sequence[tuple[int, int]] = (),
          predictions: str = "off") -> list[ReplayResult]:
    """Every (scope, policy, capacity) combination; Belady last within each scope. With
    ``predictions`` other than ``"off"``, each policy is replayed without and with them."""
    out = []
    specs = list(policies) + (["belady"] if belady else [])
    for scope in scopes:
        for spec in specs:
            modes = ["off"] if spec == "belady" or predictions == "off" else ["off", predictions]
            for mode in modes:
                for cap in capacities:
                    out.append(replay(trace, spec, cap, scope, semantics, predictions=mode))
                    if pins and spec != "belady" and pins_fit(trace, pins, cap, scope) is None:
                        out.append(replay(trace, spec, cap, scope, semantics, pins=pins, predictions=mode))
    return out
