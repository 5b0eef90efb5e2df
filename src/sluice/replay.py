"""Replay expert-routing traces through cache policies: hit rates next to Belady's optimum.

The replay drives the engine's own policy classes (``sluice.experts.policy``) with the
engine's cache semantics (``ExpertCache`` + ``ExpertProvider.moe``), without weights:

* one ``tick()`` per decode token, before its first layer;
* ``semantics="engine"`` (default): for each layer the token's experts are looked up
  first (a hit is an expert resident at lookup; hits are ``access``-ed and pinned), then
  the misses are fetched in ascending id order, each evicting the policy's victim among
  keys *not* used by this layer (the layer's experts are pinned while its other experts
  are brought in), then ``insert``-ed;
* ``semantics="sequential"``: each (layer, expert) access is processed on its own in
  ascending id order, fetched on demand with nothing pinned, so a miss may evict an
  expert the same layer uses later in the token. This is the model behind the reference
  figures of the shared traces' README (LRU 0.571, Belady 0.747 at 16 slots per layer).

Caches are either one per layer (``scope="layer"``: each layer its own ``C`` slots) or one
global pool of ``layers x C`` slots (``scope="global"``, as in the engine). Belady's policy
evicts the resident key whose next use is furthest in the future, from next-use positions
precomputed over the access sequence (O(log n) per operation with a lazy heap).
"""

from __future__ import annotations

import heapq
import json
import math
import random
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from .errors import InvalidArgumentError
from .experts.cache import ExpertCache
from .experts.layout import ExpertLayout
from .experts.policy import LFRU, POLICIES, Pinned, Policy, make_policy
from .experts.provider import ExpertProvider
from .experts.source import ExpertSource
from .experts.spec import ExpertSpec
from .trace import Trace

NEVER = math.inf
SCOPES = ("layer", "global")
SEMANTICS = ("engine", "sequential")
PREDICTIONS = ("off", "hint", "prefetch")
DEFAULT_MULTIPLES = (1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # of one layer's top-k: 8,12,16,24,32,48 for top-8
DEFAULT_POLICIES = ("lru", "lfru")
MAX_SYNTHETIC_LOOKUPS = 1 << 28  # expert lookups in a synthetic trace (~tokens x layers x top-k)


# -- Belady ----------------------------------------------------------------------------------


def access_order(trace: Trace) -> list[tuple[int, int]]:
    """Every ``(layer, expert)`` access in trace order: token, then layer, then ascending id."""
    return [(layer, e) for step in trace.steps for layer, ids in enumerate(step) for e in ids]


def next_uses(trace: Trace) -> dict[Hashable, deque]:
    """For each key, the positions (in ``access_order``) at which it is used, ascending."""
    uses: dict[Hashable, deque] = {}
    for pos, key in enumerate(access_order(trace)):
        q = uses.get(key)
        if q is None:
            uses[key] = q = deque()
        q.append(pos)
    return uses


class Belady(Policy):
    """Evict the key whose next use is furthest in the future (Belady's MIN, offline).

    Built from ``next_uses(trace)``: every ``insert``/``access`` of a key consumes its current
    use, so the replay must report each access exactly once, in trace order per key (both
    replay semantics do). Keys with no further use are evicted first.
    """

    name = "belady"

    def __init__(self, uses: dict[Hashable, deque]):
        self._uses = uses
        self._next: dict[Hashable, float] = {}
        self._heap: list[tuple[float, int, Hashable]] = []
        self._seq = 0

    def _use(self, key):
        q = self._uses[key]
        q.popleft()
        nxt = q[0] if q else NEVER
        self._next[key] = nxt
        self._seq += 1
        heapq.heappush(self._heap, (-nxt, self._seq, key))
        if len(self._heap) > 4 * len(self._next) + 64:
            self._heap = [(n, i, k) for n, i, k in self._heap if self._next.get(k) == -n]
            heapq.heapify(self._heap)

    def insert(self, key, speculative=False):
        if not speculative:
            self._use(key)
            return
        q = self._uses[key]  # a prediction read ahead: not a use, its next use is still ahead
        self._next[key] = nxt = q[0] if q else NEVER
        self._seq += 1
        heapq.heappush(self._heap, (-nxt, self._seq, key))

    def access(self, key):
        self._use(key)

    def remove(self, key):
        self._next.pop(key, None)

    def victim(self, evictable):
        skipped = []
        found = None
        while self._heap:
            item = heapq.heappop(self._heap)
            neg, _, key = item
            if self._next.get(key) != -neg:
                continue
            skipped.append(item)
            if evictable(key):
                found = key
                break
        for item in skipped:
            heapq.heappush(self._heap, item)
        return found


# -- study-only policies ---------------------------------------------------------------------
# Designs measured against the engine's policies in docs/cache-policy.md and rejected there.
# They follow the same interface; the cache size they need is taken as the number of
# resident keys when a victim is asked for (the cache only evicts when full).


def _first(order, evictable):
    for key in order:
        if evictable(key):
            return key
    return None


class TwoQ(Policy):
    """2Q: new keys enter a FIFO (``a1in``, a ``kin`` share of the cache); keys seen again
    after leaving it (remembered in a ghost list of ``kout`` x cache keys) go to an LRU (``am``)."""

    name = "2q"

    def __init__(self, kin: float = 0.25, kout: float = 0.5):
        self.kin, self.kout = kin, kout
        self.a1in: OrderedDict = OrderedDict()
        self.am: OrderedDict = OrderedDict()
        self.a1out: OrderedDict = OrderedDict()

    def insert(self, key, speculative=False):
        if key in self.a1out:
            del self.a1out[key]
            self.am[key] = None
        else:
            self.a1in[key] = None

    def access(self, key):
        if key in self.am:
            self.am.move_to_end(key)

    def remove(self, key):
        if key in self.a1in:
            del self.a1in[key]
            self.a1out[key] = None
            limit = max(1, int(self.kout * (len(self.a1in) + len(self.am) + 1)))
            while len(self.a1out) > limit:
                self.a1out.popitem(last=False)
        else:
            self.am.pop(key, None)

    def victim(self, evictable):
        n = len(self.a1in) + len(self.am)
        first, second = (self.a1in, self.am) if len(self.a1in) > self.kin * n else (self.am, self.a1in)
        v = _first(first, evictable)
        return v if v is not None else _first(second, evictable)


class ARC(Policy):
    """Adaptive Replacement Cache (Megiddo and Modha), with a victim chosen before the
    incoming key is known (the cache asks for a victim, then inserts)."""

    name = "arc"

    def __init__(self):
        self.t1: OrderedDict = OrderedDict()
        self.t2: OrderedDict = OrderedDict()
        self.b1: OrderedDict = OrderedDict()
        self.b2: OrderedDict = OrderedDict()
        self.p = 0.0
        self.c = 1

    def insert(self, key, speculative=False):
        self.c = max(self.c, len(self.t1) + len(self.t2) + 1)
        if key in self.b1:
            self.p = min(self.c, self.p + max(len(self.b2) / max(len(self.b1), 1), 1))
            del self.b1[key]
            self.t2[key] = None
        elif key in self.b2:
            self.p = max(0.0, self.p - max(len(self.b1) / max(len(self.b2), 1), 1))
            del self.b2[key]
            self.t2[key] = None
        else:
            self.t1[key] = None

    def access(self, key):
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        elif key in self.t2:
            self.t2.move_to_end(key)

    def remove(self, key):
        if key in self.t1:
            del self.t1[key]
            self.b1[key] = None
        elif key in self.t2:
            del self.t2[key]
            self.b2[key] = None
        while len(self.b1) + len(self.t1) > self.c and self.b1:
            self.b1.popitem(last=False)
        while len(self.b1) + len(self.b2) + len(self.t1) + len(self.t2) > 2 * self.c and self.b2:
            self.b2.popitem(last=False)

    def victim(self, evictable):
        first, second = (self.t1, self.t2) if self.t1 and len(self.t1) > self.p else (self.t2, self.t1)
        v = _first(first, evictable)
        return v if v is not None else _first(second, evictable)


class ProbationLFRU(Policy):
    """LFRU behind a small LRU probation segment: new keys wait in probation (a ``probation``
    share of the cache) and are evicted from there first; a hit promotes a key to the LFRU."""

    name = "plfru"

    def __init__(self, half_life: float = 64.0, probation: float = 0.25, history: bool = False):
        self.main = LFRU(half_life, history)
        self.share = probation
        self.prob: OrderedDict = OrderedDict()

    def tick(self):
        self.main.tick()

    def insert(self, key, speculative=False):
        self.prob[key] = None

    def access(self, key):
        if key in self.prob:
            del self.prob[key]
            self.main.insert(key)
            self.main.access(key)  # the miss that brought it in and this hit
        else:
            self.main.access(key)

    def remove(self, key):
        if key in self.prob:
            del self.prob[key]
        else:
            self.main.remove(key)

    def victim(self, evictable):
        n = len(self.prob) + len(self.main._resident)
        if len(self.prob) > self.share * n:
            v = _first(self.prob, evictable)
            if v is not None:
                return v
        v = self.main.victim(evictable)
        return v if v is not None else _first(self.prob, evictable)


class LFU(Policy):
    """Plain LFU over resident keys (ties: least recently used), not layer-aware; ``history``
    keeps counts of evicted keys. LFRU with a half-life too long to matter."""

    name = "lfu"

    def __init__(self, history: bool = False):
        self.inner = LFRU(half_life=1e12, history=history, protect=False)

    def tick(self):
        self.inner.tick()

    def insert(self, key, speculative=False):
        self.inner.insert(key)

    def access(self, key):
        self.inner.access(key)

    def remove(self, key):
        self.inner.remove(key)

    def victim(self, evictable):
        return self.inner.victim(evictable)


STUDY_POLICIES: dict[str, Callable[..., Policy]] = {**POLICIES, "2q": TwoQ, "arc": ARC, "plfru": ProbationLFRU,
                                                     "lfu": LFU}


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


class _Weightless(ExpertSource):
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

    def submit(self, fn, *args, priority: int = 0) -> _Done:
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
        self.cache = ExpertCache(slots, _Weightless.slot_bytes, policy)
        self.provider = ExpertProvider(_Weightless(), self.cache, _SPEC, n_experts, pool=_AtOnce(),
                                       compute=(_no_output, _no_forward))
        self.provider.decoding = True
        self._x = torch.zeros(1, 1)

    def tick(self) -> None:
        self.cache.policy.tick()  # what Engine._run does before each forward

    def predict(self, layer: int, experts: Sequence[int], read: bool) -> None:
        """What the engine's lookahead does after the previous layer's attention."""
        self.provider.prefetch(layer, list(experts), read=read)

    def run_layer(self, layer: int, experts: Sequence[int]) -> None:
        """One decode token's MoE call for ``layer``, routed to ``experts``."""
        ids = torch.tensor([list(experts)])
        self.provider.moe(layer, self._x, ids, torch.ones(ids.shape))


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
    if semantics == "engine" and capacity < k:
        raise InvalidArgumentError(f"capacity {capacity} per layer cannot hold one layer's {k} experts "
                                   "(engine semantics)")
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
    sequential = semantics == "sequential"
    try:
        for t, step in enumerate(trace.steps):
            for sim in sims:
                sim.tick()
            for layer, ids in enumerate(step):
                if pred is not None and layer + 1 < layers and pred[t][layer + 1]:
                    sims[layer + 1 if n_caches > 1 else 0].predict(layer + 1, pred[t][layer + 1], read)
                sim = sims[layer if n_caches > 1 else 0]
                if sequential:  # one expert per call: only the expert being fetched is pinned
                    for e in ids:
                        sim.run_layer(layer, (e,))
                else:
                    sim.run_layer(layer, ids)
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
    out = sorted({min(n, max(k, round(m * k))) for m in multiples})
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


# -- synthetic traces ------------------------------------------------------------------------


@dataclass
class SyntheticSpec:
    """A seeded synthetic routing trace with Zipf-skewed, drifting popularity and reuse.

    Each layer ranks its experts by a random permutation and weighs rank ``r`` by
    ``1 / (r + 1) ** zipf``. Every ``segment`` tokens a new "topic" ranking is drawn per
    layer and mixed in with weight ``drift`` (popularity that moves with the text). Each of
    a token's ``top_k`` experts is, with probability ``reuse``, one of the experts the
    previous token used in that layer, else a popularity draw (distinct ids, sorted).
    The defaults roughly match the shared OLMoE trace (16 layers, 64 experts, top-8):
    next-token same-layer reuse 0.44 (OLMoE 0.435), a layer's 8 most used experts take 0.40
    of its accesses (OLMoE 0.37) and LRU at 16 slots per layer hits 0.60 (OLMoE 0.596).
    """

    layers: int = 16
    experts: int = 64
    top_k: int = 8
    tokens: int = 1000
    zipf: float = 1.1
    reuse: float = 0.18
    drift: float = 0.3
    segment: int = 100
    seed: int = 0

    @classmethod
    def parse(cls, text: str) -> SyntheticSpec:
        """``"tokens=2000,zipf=1.1,seed=3"`` -> spec (unnamed fields keep their defaults)."""
        kw: dict = {}
        names = {f: t for f, t in cls.__annotations__.items()}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            key = key.strip()
            if not sep or key not in names:
                raise InvalidArgumentError(f"bad synthetic trace field {part!r} (fields: {', '.join(names)})")
            try:
                kw[key] = float(value) if names[key] == "float" else int(value)
            except ValueError:
                kind = "an integer" if names[key] == "int" else "a number"
                raise InvalidArgumentError(f"--synthetic: {key}={value.strip()!r} is not {kind}") from None
        spec = cls(**kw)
        if not 1 <= spec.top_k <= spec.experts or spec.layers < 1 or spec.tokens < 1:
            raise InvalidArgumentError("synthetic trace needs layers >= 1, tokens >= 1 and 1 <= top_k <= experts")
        if spec.tokens * spec.layers * spec.top_k > MAX_SYNTHETIC_LOOKUPS:
            raise InvalidArgumentError(f"synthetic trace of {spec.tokens} tokens x {spec.layers} layers x top-k "
                                       f"{spec.top_k} is too large (at most {MAX_SYNTHETIC_LOOKUPS} lookups)")
        if not (0 <= spec.reuse <= 1 and 0 <= spec.drift <= 1 and spec.segment >= 1):
            raise InvalidArgumentError("synthetic trace needs 0 <= reuse, drift <= 1 and segment >= 1")
        return spec

    def label(self) -> str:
        return "synthetic(" + ",".join(f"{k}={v}" for k, v in asdict(self).items()) + ")"


def synthetic_trace(spec: SyntheticSpec) -> Trace:
    rng = random.Random(spec.seed)
    n, k = spec.experts, spec.top_k
    rank_w = [1.0 / (r + 1) ** spec.zipf for r in range(n)]

    def ranking():
        perm = list(range(n))
        rng.shuffle(perm)
        w = [0.0] * n
        for r, e in enumerate(perm):
            w[e] = rank_w[r]
        s = sum(w)
        return [x / s for x in w]

    base = [ranking() for _ in range(spec.layers)]
    prev: list[list[int]] = [[] for _ in range(spec.layers)]
    steps = []
    cum: list[list[float]] = []
    for t in range(spec.tokens):
        if t % spec.segment == 0:
            cum = []
            for layer in range(spec.layers):
                topic = ranking()
                w = [(1 - spec.drift) * a + spec.drift * b for a, b in zip(base[layer], topic)]
                acc, c = 0.0, []
                for x in w:
                    acc += x
                    c.append(acc)
                cum.append(c)
        step = []
        for layer in range(spec.layers):
            chosen: set[int] = set()
            before = prev[layer]
            while len(chosen) < k:
                if before and rng.random() < spec.reuse:
                    cand = [e for e in before if e not in chosen]
                    if cand:
                        chosen.add(rng.choice(cand))
                        continue
                chosen.add(rng.choices(range(n), cum_weights=cum[layer])[0])
            ids = sorted(chosen)
            step.append(ids)
            prev[layer] = ids
        steps.append(step)
    return Trace(steps, list(range(1, spec.tokens + 1)), spec.label())


# -- reports ---------------------------------------------------------------------------------


def describe(trace: Trace) -> dict:
    d = {"source": trace.source, "tokens": trace.tokens, "layers": trace.layers, "experts": trace.experts,
         "top_k": trace.top_k, "working_set": trace.top_k * trace.layers, "lookups": trace.lookups,
         "next_token_reuse": trace.reuse()}
    if trace.pred is not None:
        d["prediction_recall"] = trace.prediction_recall()
    return d


@dataclass
class Report:
    trace: dict
    semantics: str
    capacities: list[dict]
    results: list[ReplayResult] = field(default_factory=list)
    pins: dict | None = None

    def as_json(self) -> dict:
        return {"trace": self.trace, "semantics": self.semantics, "capacities": self.capacities,
                "results": [r.as_dict() for r in self.results], "pins": self.pins}


def build_report(trace: Trace, policies: Sequence[str], capacities: Sequence[int], scopes: Sequence[str] = SCOPES,
                 semantics: str = "engine", pins: Sequence[tuple[int, int]] = (), pins_source: str = "",
                 predictions: str = "off") -> Report:
    k, layers = trace.top_k, trace.layers
    caps = [{"experts_per_layer": c, "multiple": c / k, "global_slots": c * layers} for c in capacities]
    rep = Report(describe(trace), semantics, caps,
                 sweep(trace, policies, capacities, scopes, semantics, pins=pins, predictions=predictions))
    if pins:
        rep.pins = {"count": len(pins), "source": pins_source}
    return rep


def render(rep: Report) -> str:
    t = rep.trace
    lines = [
        f"trace: {t['source']}",
        f"  {t['tokens']} tokens, {t['layers']} layers, {t['experts']} experts, top-{t['top_k']}: working set "
        f"{t['working_set']} experts/token; next-token same-layer reuse {t['next_token_reuse']:.3f}",
        f"  semantics: {rep.semantics}" + (
            " (a layer's experts are looked up, then pinned while its misses are fetched)"
            if rep.semantics == "engine" else " (each access fetched on demand in id order, nothing pinned)"),
    ]
    if "prediction_recall" in t:
        lines.append(f"  lookahead predictions recorded: recall {t['prediction_recall']:.3f} "
                     "(+hint: the policy hears them; +prefetch: they are read ahead too)")
    if rep.pins:
        lines.append(f"  pins: {rep.pins['count']} keys from {rep.pins['source']}")
    caps = [c["experts_per_layer"] for c in rep.capacities]
    names = list(dict.fromkeys(r.policy for r in rep.results))
    width = max([len(n) for n in names] + [16])
    for scope in dict.fromkeys(r.scope for r in rep.results):
        lines.append("")
        layers = t["layers"]
        lines.append("per-layer caches (each layer its own C slots)" if scope == "layer"
                     else f"global cache ({layers} x C slots in one pool)")
        lines.append(f"  {'experts/layer C':<{width}}" + "".join(f"{c:>8}" for c in caps))
        if scope == "global":
            lines.append(f"  {'slots':<{width}}" + "".join(f"{c * layers:>8}" for c in caps))
        lines.append(f"  {'x working set':<{width}}" + "".join(f"{c['multiple']:>7.2g}x" for c in rep.capacities))
        got = {(r.policy, r.capacity): r for r in rep.results if r.scope == scope}
        for name in names:
            cells = [got.get((name, c)) for c in caps]
            lines.append(f"  {name:<{width}}" + "".join(f"{r.hit_rate:>8.3f}" if r else f"{'-':>8}" for r in cells))
    return "\n".join(lines)


def parse_capacities(text: str) -> list[int]:
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            v = int(part)
        except ValueError:
            raise InvalidArgumentError(f"--capacity: {part!r} is not a whole number of experts per layer") from None
        if v < 1:
            raise InvalidArgumentError(f"--capacity: {v} must be at least 1")
        out.append(v)
    if not out:
        raise InvalidArgumentError("--capacity: give at least one capacity, e.g. 8,16,32")
    return sorted(set(out))


def parse_slice(text: str) -> tuple[int | None, int | None]:
    """``"150:"``, ``":150"``, ``"10:20"`` -> python slice bounds over tokens."""
    a, sep, b = text.partition(":")
    if not sep:
        raise InvalidArgumentError(f"--tokens {text!r}: expected START:STOP (either may be empty)")
    try:
        return (int(a) if a.strip() else None, int(b) if b.strip() else None)
    except ValueError:
        raise InvalidArgumentError(f"--tokens {text!r}: START and STOP must be integers") from None


def run_cli(args) -> int:
    """``sluice trace-replay``: see ``cli.py`` for the arguments."""
    from .trace import hottest, read_pins, read_trace, write_pins

    if (args.trace is None) == (args.synthetic is None):
        raise InvalidArgumentError("give a trace file or --synthetic SPEC (one of the two)")
    trace = read_trace(args.trace) if args.trace else synthetic_trace(SyntheticSpec.parse(args.synthetic))
    if args.tokens:
        start, stop = parse_slice(args.tokens)
        trace = trace.slice(start, stop)
        trace.source += f" [tokens {args.tokens}]"
        if not trace.steps:
            raise InvalidArgumentError(f"--tokens {args.tokens} selects no tokens")
    if args.pin_count is not None and not args.write_pins:
        raise InvalidArgumentError("--pin-count goes with --write-pins FILE")
    if args.write_pins:
        if not args.pin_count or args.pin_count < 1:
            raise InvalidArgumentError("--write-pins needs --pin-count N (N >= 1)")
        pins = hottest(trace, args.pin_count)
        counts = trace.counts()
        write_pins(args.write_pins, pins, source=trace.source, tokens=trace.tokens,
                   uses=[counts[p] for p in pins])
        if not args.json:
            print(f"wrote {len(pins)} pins ({sum(counts[p] for p in pins)} of {trace.lookups} uses) "
                  f"to {args.write_pins}")
    pins = read_pins(args.pins) if args.pins else ()
    caps = parse_capacities(args.capacity) if args.capacity else capacities_for(trace)
    policies = args.policy or list(DEFAULT_POLICIES)
    for spec in policies:
        if spec != "belady":
            try:
                make_policy(spec, STUDY_POLICIES)
            except ValueError as e:
                raise InvalidArgumentError(f"--policy: {e}") from None
    scopes = SCOPES if args.scope == "both" else (args.scope,)
    predictions = getattr(args, "predictions", "off")
    if predictions != "off" and trace.pred is None:
        raise InvalidArgumentError(f"--predictions {predictions}: {trace.source} records no lookahead "
                                   "predictions (traces written by --trace-routing do)")
    rep = build_report(trace, [p for p in policies if p != "belady"], caps, scopes, args.semantics, pins,
                       args.pins or "", predictions)
    print(json.dumps(rep.as_json(), indent=1) if args.json else render(rep))
    return 0


__all__ = ["Belady", "ReplayResult", "SyntheticSpec", "build_report", "capacities_for", "next_uses", "render",
           "replay", "run_cli", "sweep", "synthetic_trace"]
