"""Decayed frequency: the one scoring rule of Sluice's caches.

Both the expert cache's LFRU policy (``experts/policy.py``, in memory, time in forwards) and
the disk tier (``storage/disk_tier.py``, on disk, wall-clock time) rank what they keep by a
score to which each use adds 1 and which halves every half-life. Kept in log space relative
to a clock that only grows (``log(sum of e^(rate x t_use))``), ordering scores needs no decay
pass over every entry: an entry's score at any moment is its stored log score minus the same
``rate x now`` for all. This module is that rule once; the two caches differ only in their
clock and their unit (natural log with ``rate = ln 2 / half_life`` for the policy, log2 with
``t / half_life`` for the tier's index, whose stored scores keep that unit).
"""

from __future__ import annotations

import math

LN2 = math.log(2.0)


def log_add(a: float, b: float) -> float:
    """``log(e^a + e^b)`` without overflow: one use (``b``, the log-time of the use) added to a score ``a``."""
    return max(a, b) + math.log1p(math.exp(-abs(a - b)))


def log2_add(a: float, b: float) -> float:
    """``log2(2^a + 2^b)``: ``log_add`` in base-2 units (the disk tier's index)."""
    hi, lo = (a, b) if a >= b else (b, a)
    return hi + math.log2(1.0 + 2.0 ** (lo - hi))


def add_use(old: float | None, t: float) -> float:
    """A natural-log score plus one use at log-time ``t`` (the first use: ``t``)."""
    return t if old is None else log_add(old, t)


__all__ = ["LN2", "add_use", "log2_add", "log_add"]
