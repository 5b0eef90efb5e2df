"""Checks of the public API's arguments and ``load()`` options.

Every check raises ``InvalidArgumentError`` (a ``SluiceError`` and a ``ValueError``) whose
message names the argument and the value it got. The command line checks the same rules
when it parses its flags (``cli_args.py``), so a bad flag never reaches a model.
"""

from __future__ import annotations

import math
import operator
import os
import warnings

from .errors import InvalidArgumentError, UnknownOptionError, shown
from .units import parse_size

# The smallest positive temperature (0 is greedy decoding): below it a sampled distribution is
# one-hot up to rounding, and far below it logits / temperature overflow. The server uses it too.
MIN_TEMPERATURE = 1e-3
MIN_SEED, MAX_SEED = -(1 << 63), (1 << 64) - 1  # what torch generators accept
MAX_LOGPROBS = 20
MAX_THREADS = 1024


def integer(value, name: str, lo: int | None = None, hi: int | None = None) -> int:
    """``value`` as an int in ``lo..hi``; booleans, floats and strings are refused."""
    if isinstance(value, bool):
        raise InvalidArgumentError(f"{name} must be {integer_rule(lo, hi)}, got {shown(value)}")
    try:
        v = operator.index(value)
    except TypeError:
        raise InvalidArgumentError(f"{name} must be {integer_rule(lo, hi)}, got {shown(value)}") from None
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise InvalidArgumentError(f"{name} must be {integer_rule(lo, hi)}, got {shown(value)}")
    return v


def integer_rule(lo: int | None, hi: int | None) -> str:
    if lo is not None and hi is not None:
        return f"an integer from {lo} to {hi}"
    if lo is not None:
        return f"an integer >= {lo}"
    if hi is not None:
        return f"an integer <= {hi}"
    return "an integer"


def number(value, name: str, lo: float | None = None, hi: float | None = None, lo_open: bool = False) -> float:
    """``value`` as a finite float in ``lo..hi`` (``lo`` excluded if ``lo_open``); NaN and
    infinities, booleans and strings are refused."""
    rule = "a finite number"
    if lo is not None and hi is not None:
        rule += f" in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
    elif lo is not None:
        rule += f" {'>' if lo_open else '>='} {lo:g}"
    elif hi is not None:
        rule += f" <= {hi:g}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgumentError(f"{name} must be {rule}, got {shown(value)}")
    f = float(value)
    if (not math.isfinite(f) or (lo is not None and (f < lo or (lo_open and f == lo)))
            or (hi is not None and f > hi)):
        raise InvalidArgumentError(f"{name} must be {rule}, got {shown(value)}")
    return f


def temperature(value, name: str = "temperature") -> float:
    t = number(value, name, lo=0.0)
    if 0 < t < MIN_TEMPERATURE:
        raise InvalidArgumentError(f"{name} must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {shown(value)} "
                                   "(too small to sample with)")
    return t


def top_p(value, name: str = "top_p") -> float:
    return number(value, name, lo=0.0, hi=1.0, lo_open=True)


def seed(value, name: str = "seed") -> int | None:
    return None if value is None else integer(value, name, MIN_SEED, MAX_SEED)


def boolean(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"{name} must be True or False, got {shown(value)}")
    return value


def token_ids(ids, name: str = "prompt") -> list[int]:
    """A sequence of token ids as ints (a float, string or boolean id is refused)."""
    out = []
    for i in ids:
        if isinstance(i, bool):
            raise InvalidArgumentError(f"{name}: token id {shown(i)} is not an integer")
        try:
            out.append(operator.index(i))
        except TypeError:
            raise InvalidArgumentError(f"{name}: token id {shown(i)} is not an integer") from None
    return out


def sampling(*, max_new_tokens, temperature_, top_p_, top_k, seed_, logprobs, stop, stop_token_ids,
             flags: dict | None = None) -> None:
    """The generation arguments of ``Engine.stream`` (``flags``: name -> a value that must be a bool)."""
    for name, value in (flags or {}).items():
        boolean(value, name)
    integer(max_new_tokens, "max_new_tokens", lo=1)
    temperature(temperature_)
    top_p(top_p_)
    integer(top_k, "top_k", lo=0)
    seed(seed_)
    if logprobs is not None:
        integer(logprobs, "logprobs", 0, MAX_LOGPROBS)
    stops = [stop] if isinstance(stop, str) else stop
    if stops is not None and (not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops)):
        raise InvalidArgumentError(f"stop must be a string or a list of strings, got {shown(stop)}")
    if stop_token_ids is not None:
        token_ids(stop_token_ids, "stop_token_ids")


# load() options: name -> check (None: any value of that field's type is checked elsewhere)
def _opt_int(lo, hi=None, none=True):
    return lambda v, n: None if (v is None and none) else integer(v, n, lo, hi)


def _opt_bool(none=False):
    return lambda v, n: None if (v is None and none) else boolean(v, n)


def _path(v, n):
    if v is not None and not isinstance(v, (str, os.PathLike)):
        raise InvalidArgumentError(f"{n} must be a file path, got {shown(v)}")


def _size(v, n):
    if v is None:
        return
    from .units import parse_size

    if parse_size(v, n) <= 0:
        raise InvalidArgumentError(f"{n} must be a size above 0 bytes, got {shown(v)}")


def _policy(v, n):
    from .experts.policy_spec import make_policy

    if not isinstance(v, str):
        raise InvalidArgumentError(f"{n} must be a policy name such as 'lfru' or 'lru', got {shown(v)}")
    try:
        make_policy(v)
    except ValueError as e:
        raise InvalidArgumentError(f"{n}: {e}") from None


_OPTION_CHECKS = {
    "cache_experts": _opt_int(1),
    "max_context": _opt_int(1),
    "threads": _opt_int(1, MAX_THREADS),
    "reader_threads": _opt_int(1, MAX_THREADS, none=False),
    "cache_policy": _policy,
    "prefetch": lambda v, n: prefetch_options(v, n),
    "certain_reads": _opt_bool(),
    "huge_pages": _opt_bool(),
    "direct_io": _opt_bool(none=True),
    "verify_reads": _opt_bool(none=True),
    "prefill_chunk": _opt_int(1, none=False),
    "parallel": _opt_int(1, 1 << 16),
    "progress": _opt_bool(),
    "trace_routing": _path,
    "ca_bundle": _path,
    "allow_unversioned_remote": _opt_bool(),
    "disk_cache": _size,
    "disk_cache_dir": _path,
    "max_resident_layers": _opt_int(0),
    "moe_top_k": _opt_int(1),
    "prefer_cached": lambda v, n: number(v, n, lo=0.0),
    "debug": lambda v, n: debug_options(v, n),
    "ray": lambda v, n: _ray_address(v, n),
    "expert_workers": _opt_int(1),
    "worker_memory": lambda v, n: v is None or parse_size(v, n),
    "replicate_hot": _opt_int(0, none=False),
    "ray_timeout": lambda v, n: number(v, n, lo=0.0, lo_open=True),
    "ray_compiled": _opt_bool(),
}


def prefetch_options(value, name: str = "prefetch") -> None:
    """``prefetch``: a bool or an ``experts.lookahead.PrefetchOptions`` with sane fields."""
    from .experts.lookahead import PrefetchOptions

    if isinstance(value, bool):
        return
    if not isinstance(value, PrefetchOptions):
        raise InvalidArgumentError(f"{name} must be True or False, got {shown(value)} (or a sluice.PrefetchOptions for "
                                   "its settings)")
    for flag in ("enabled", "gate", "latency"):
        boolean(getattr(value, flag), f"{name}.{flag}")
    integer(value.depth, f"{name}.depth", 1, 64)
    integer(value.max_depth, f"{name}.max_depth", 1, 64)
    integer(value.max_rows, f"{name}.max_rows", 0)
    number(value.min_prob, f"{name}.min_prob", lo=0.0, hi=1.0)


def debug_options(value, name: str = "debug") -> None:
    from .options import DebugOptions

    if not isinstance(value, DebugOptions):
        raise InvalidArgumentError(f"{name} must be a sluice.DebugOptions, got {shown(value)}")
    boolean(value.poison_stream_buffers, f"{name}.poison_stream_buffers")


def _ray_address(value, name: str) -> None:
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise InvalidArgumentError(f"{name} must be 'auto' or a Ray cluster address (HOST:PORT), got {shown(value)}")


def model_path(path) -> None:
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidArgumentError(f"path must be a model directory (a str or os.PathLike), got {shown(path)}")


def options(opts, known) -> None:
    """Check ``load()``'s keyword options: unknown names, then each known option's value."""
    unknown = set(opts) - set(known)
    if unknown:
        raise UnknownOptionError(f"unknown option(s) {sorted(unknown)}; known: {sorted(known)}")
    for name, value in opts.items():
        check = _OPTION_CHECKS.get(name)
        if check is not None:
            check(value, name)


def machine_memory() -> int | None:
    """Physical memory, or the cgroup limit if lower (bytes); None if unknown."""
    from .sysmem import cgroup_limit

    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = None
    limit, _ = cgroup_limit()
    if limit is not None and (total is None or limit < total):
        return limit
    return total


def warn_if_over_machine(budget: int) -> None:
    """A budget the machine cannot give: it still runs (the budget is a ceiling), but the
    planner will size the expert cache for memory that is not there, so the OS will swap or
    kill the process instead of Sluice refusing cleanly. (Called by ``load()``, from its caller's
    frame: the warning points at the user's call.)"""
    total = machine_memory()
    if total and budget > total:
        from .units import format_size

        warnings.warn(f"memory budget {format_size(budget)} (--memory) is more than this machine's memory "
                      f"({format_size(total)}): the expert cache is sized for memory that is not there; give a "
                      "smaller budget", stacklevel=3)
