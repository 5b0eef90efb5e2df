"""Seeded synthetic routing traces (``sluice trace-replay --synthetic SPEC``)."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

from ..errors import InvalidArgumentError
from ..trace import Trace

MAX_SYNTHETIC_LOOKUPS = 1 << 28  # expert lookups in a synthetic trace (~tokens x layers x top-k)


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
