"""The cache policies by name, and the spec strings that build them.

``make_policy("lfru:half_life=16,history=true")`` -> a fresh ``LFRU(half_life=16, history=True)``.
The registry lives here rather than in ``policy.py`` so that policies built on ``LFRU`` in their own
modules (``layer_share.py``) can join it without an import cycle.
"""

from __future__ import annotations

from collections.abc import Callable

from .layer_share import LayerUtilityLFRU
from .policy import LFRU, LRU, Policy


POLICIES: dict[str, Callable[..., Policy]] = {"lru": LRU, "lfru": LFRU, "ulfru": LayerUtilityLFRU}


def _value(text: str):
    low = text.strip().lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    try:
        return float(low)
    except ValueError:
        raise ValueError(f"cache policy parameter value {text!r} is not a number or true/false") from None


def parse_policy_spec(spec: str) -> tuple[str, dict]:
    """``"lfru:half_life=8,history=true"`` -> ``("lfru", {"half_life": 8.0, "history": True})``."""
    name, _, rest = spec.partition(":")
    params = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"cache policy {spec!r}: expected NAME:KEY=VALUE[,KEY=VALUE], got {part!r}")
        params[key.strip()] = _value(value)
    return name.strip(), params


def make_policy(spec: str, registry: dict[str, Callable[..., Policy]] | None = None) -> Policy:
    """A fresh policy from ``"name"`` or ``"name:key=value,..."`` (e.g. ``"lfru:half_life=8"``)."""
    table = POLICIES if registry is None else registry
    name, params = parse_policy_spec(spec)
    try:
        cls = table[name]
    except KeyError:
        raise ValueError(f"unknown cache policy {name!r} (choose from: {', '.join(table)})") from None
    try:
        return cls(**params)
    except TypeError as e:
        raise ValueError(f"cache policy {spec!r}: {e}") from None
