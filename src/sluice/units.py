"""Byte sizes: parse ``8GiB`` / ``500MB`` and format sizes for people."""

from __future__ import annotations

import math
import re

from .errors import InvalidArgumentError

_UNITS = {
    "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}

_EXAMPLE = "use a number with a unit, e.g. 8GiB, 1.5GB, 512MiB"


def parse_size(text: str | int | float, what: str = "size") -> int:
    """Parse a size: ``GiB``/``MiB``/``KiB`` are binary, ``GB``/``MB``/``KB`` decimal, ``B`` bytes.

    A string needs a unit (``"1.5"`` is refused: 1.5 what?); an integer (or a float with an
    integral value) is a count of bytes.
    Raises ``InvalidArgumentError`` (a ``ValueError``) naming ``what`` and the value.
    """
    if isinstance(text, bool):
        raise InvalidArgumentError(f"{what}: cannot parse size {text!r}: {_EXAMPLE}")
    if isinstance(text, float):
        if not (math.isfinite(text) and text.is_integer()):
            raise InvalidArgumentError(f"{what}: cannot parse size {text!r}: {_EXAMPLE}")
        text = int(text)
    if isinstance(text, int):
        if text < 0:
            raise InvalidArgumentError(f"{what}: size must not be negative, got {text}")
        return text
    if not isinstance(text, str):
        raise InvalidArgumentError(f"{what}: cannot parse size {text!r}: {_EXAMPLE}")
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        if m and not m.group(2):
            raise InvalidArgumentError(f"{what}: size {text!r} has no unit ({m.group(1)} what?): give one, e.g. "
                                       f"{m.group(1)}GiB, {m.group(1)}GB or {m.group(1)}MiB")
        raise InvalidArgumentError(f"{what}: cannot parse size {text!r}: {_EXAMPLE}")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if _UNITS[m.group(2).lower()] == 1 and not value.is_integer():
        raise InvalidArgumentError(f"{what}: {text!r} is not a whole number of bytes")
    return int(value)


def format_size(n: float) -> str:
    """Format bytes with a binary unit: ``1.50 GiB``."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
