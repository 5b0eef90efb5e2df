"""Argument types for the command line: every flag's value is checked when it is parsed.

Each factory returns an ``argparse`` ``type=`` function; a bad value becomes argparse's
``sluice run: error: argument --temperature: must be a finite number >= 0, got 'nan'`` and
exit status 2, before any model is opened. The rules are the API's (``validate.py``).
"""

from __future__ import annotations

import argparse
import re

from . import validate
from .errors import InvalidArgumentError
from .units import parse_size


def _wrap(check, parse):
    def convert(text: str):
        try:
            value = parse(text)
        except ValueError:
            value = text  # let the check say what was expected
        try:
            return check(value)
        except InvalidArgumentError as e:
            # the check says "value must be ..., got <parsed>"; argparse prefixes the flag, and the
            # user sees the text they typed
            msg = re.sub(r", got .*?(?= \(|$)", f", got {text!r}", str(e).removeprefix("value "), count=1)
            raise argparse.ArgumentTypeError(msg) from None

    return convert


def int_arg(lo: int | None = None, hi: int | None = None):
    """An integer flag in ``lo..hi``."""
    return _wrap(lambda v: validate.integer(v, "value", lo, hi), int)


def float_arg(lo: float | None = None, hi: float | None = None, lo_open: bool = False):
    """A finite number flag in ``lo..hi`` (NaN and infinities refused)."""
    return _wrap(lambda v: validate.number(v, "value", lo, hi, lo_open), float)


def temperature_arg(text: str) -> float:
    return _wrap(lambda v: validate.temperature(v, "value"), float)(text)


def top_p_arg(text: str) -> float:
    return _wrap(lambda v: validate.top_p(v, "value"), float)(text)


def seed_arg(text: str) -> int:
    return _wrap(lambda v: validate.seed(v, "value"), int)(text)


def size_arg(text: str) -> int:
    """A size with a unit (``8GiB``, ``500MB``); a bare number is refused (1.5 what?)."""
    try:
        return parse_size(text, "value")
    except InvalidArgumentError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("value: ")) from None


def positive_size_arg(text: str) -> int:
    n = size_arg(text)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 bytes, got {text!r}")
    return n
