"""Every JSON file Sluice reads, through one door: size-capped before it is read, depth-checked
before it is parsed.

A model's ``config.json`` of 300 MB (local or over HTTP) would be read and parsed whole, far
past the memory budget; a JSON text nested 100,000 deep makes Python's parser raise
``RecursionError``. So the config, ``generation_config.json``, ``tokenizer_config.json``, the
container manifest and the safetensors index are read with ``read_json``: a member larger than
``MAX_JSON_BYTES`` is refused before a byte of it is read (for a remote store, from its HEAD),
and one nested deeper than ``MAX_JSON_DEPTH`` before it is parsed (a scan that skips strings).
The safetensors header has its own, tighter rules (``checkpoint.py``) and uses ``nesting``.
"""

from __future__ import annotations

import json
import re

from ..errors import CheckpointError
from .regular import FileTooLargeError

# Real files are far smaller: the largest config or tokenizer_config seen is under 2 MB, a
# container manifest of DeepSeek-V3 ~2 MB, its safetensors index ~9 MB.
MAX_JSON_BYTES = 64 << 20
# Real files nest a few levels (a manifest 5, a tokenizer_config's added tokens 3); the parser
# recurses once per level and Python's limit is 1000.
MAX_JSON_DEPTH = 64

_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"')


class JSONFileError(CheckpointError):
    """A JSON file is too large, nested too deep, or not valid JSON (the message names the file)."""


class JSONTooLargeError(JSONFileError):
    """A JSON file is larger than ``MAX_JSON_BYTES`` (refused before it is read)."""


class JSONTooDeepError(JSONFileError):
    """A JSON file nests arrays and objects deeper than ``MAX_JSON_DEPTH`` (refused before parsing)."""


def nesting(raw: bytes) -> int:
    """Deepest bracket nesting of a JSON text, strings skipped (without parsing it; in chunks, so
    memory stays small whatever the text's size)."""
    import numpy as np

    bare = np.frombuffer(_STRINGS.sub(b"", raw), dtype=np.uint8)
    depth = deepest = 0
    for i in range(0, len(bare), 1 << 20):
        c = bare[i : i + (1 << 20)]
        step = ((c == 123) | (c == 91)).astype(np.int8) - ((c == 125) | (c == 93)).astype(np.int8)
        running = np.cumsum(step, dtype=np.int64) + depth
        deepest = max(deepest, int(running.max(initial=depth)))
        depth = int(running[-1]) if len(running) else depth
    return deepest


def parse_json(raw: bytes, where: str, what: str = "", *, max_depth: int = MAX_JSON_DEPTH, hook=None):
    """``raw`` parsed, after the depth check; ``JSONFileError`` naming ``where`` (and ``what`` it is)."""
    label = f"{what} " if what else ""
    depth = nesting(raw)
    if depth > max_depth:
        raise JSONTooDeepError(f"{where}: {label}nests JSON {depth} levels deep, more than the {max_depth} "
                               "Sluice reads (corrupt or hostile file)")
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=hook)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise JSONFileError(f"{where}: {what + ' is ' if what else ''}not valid JSON ({e})") from None
    except RecursionError:  # cannot happen after the depth check; kept so it never escapes
        raise JSONTooDeepError(f"{where}: {label}nests JSON too deep to parse") from None


def read_json(store, name: str, what: str = "", *, limit: int = MAX_JSON_BYTES, max_depth: int = MAX_JSON_DEPTH):
    """Member ``name`` of ``store`` (a ``Store``) parsed as JSON, size-capped and depth-checked.

    ``FileNotFoundError`` and other ``OSError``s pass through (callers say what is missing); a
    member over ``limit`` bytes is a ``JSONTooLargeError``, one too deep a ``JSONTooDeepError``,
    invalid JSON a ``JSONFileError``.
    """
    where = store.locate(name)
    label = f"{what} " if what else ""
    try:
        raw = store.read_bytes(name, limit=limit)
    except FileTooLargeError as e:
        raise JSONTooLargeError(f"{where}: {label}{e.strerror}; Sluice reads JSON files of at most "
                                f"{limit >> 20} MiB (corrupt or hostile file)") from None
    return parse_json(raw, where, what, max_depth=max_depth)


def read_json_path(path, what: str = "", *, limit: int = MAX_JSON_BYTES, max_depth: int = MAX_JSON_DEPTH):
    """A local JSON file by path, as ``read_json`` (a FIFO or directory: ``NotRegularFileError``)."""
    from .regular import read_regular

    label = f"{what} " if what else ""
    try:
        raw = read_regular(path, limit)
    except FileTooLargeError as e:
        raise JSONTooLargeError(f"{path}: {label}{e.strerror}; Sluice reads JSON files of at most "
                                f"{limit >> 20} MiB (corrupt or hostile file)") from None
    return parse_json(raw, str(path), what, max_depth=max_depth)
