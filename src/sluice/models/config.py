"""Reading config.json values with errors that name the key."""

from __future__ import annotations

from ..errors import CheckpointError, UnsupportedModelError

_REQUIRED = object()


class RawConfig:
    """A config.json dict with typed, named access."""

    def __init__(self, raw: dict, where: str = "config.json"):
        self.raw = raw
        self.where = where

    def __contains__(self, key: str) -> bool:
        return self.raw.get(key) is not None

    def get(self, key: str, default=_REQUIRED, *aliases: str):
        for k in (key, *aliases):
            v = self.raw.get(k)
            if v is not None:
                return v
        if default is _REQUIRED:
            names = " or ".join(repr(k) for k in (key, *aliases))
            raise CheckpointError(f"{self.where}: missing required key {names}")
        return default

    def int(self, key: str, default=_REQUIRED, *aliases: str) -> int:
        v = self.get(key, default, *aliases)
        if isinstance(v, bool) or not isinstance(v, int):
            if v is default:
                return v
            raise CheckpointError(f"{self.where}: {key!r} must be an integer, got {v!r}")
        return v

    def float(self, key: str, default=_REQUIRED, *aliases: str) -> float:
        v = self.get(key, default, *aliases)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise CheckpointError(f"{self.where}: {key!r} must be a number, got {v!r}")
        return float(v)

    def refuse(self, key: str, allowed, why: str) -> None:
        """Refuse a config option whose value Sluice does not implement."""
        v = self.raw.get(key)
        if v is not None and v not in allowed:
            raise UnsupportedModelError(f"{self.where}: {key}={v!r} is not supported ({why})")


def eos_ids(raw: dict, generation_config: dict | None = None) -> list[int]:
    out: list[int] = []
    for src in (raw, generation_config or {}):
        v = src.get("eos_token_id")
        for x in v if isinstance(v, list) else [v]:
            if isinstance(x, int) and x not in out:
                out.append(x)
    return out
