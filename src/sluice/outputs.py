"""Files Sluice writes never overwrite what it reads.

``--trace-routing FILE`` naming the model's own ``model.safetensors`` (or a symbolic or hard
link to it) would truncate the checkpoint. Every writer of a user-named output opens it with
``open_output``: the file is opened without truncation, its identity (``st_dev``, ``st_ino``
of the open descriptor, so a link or a rename race changes nothing) compared with every input
file, and only then truncated. A clash is an ``OutputClashError`` naming both files.

``model_inputs`` lists a local model's input files (every file of its directory: the
checkpoint or container files, ``config.json``, tokenizer files).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable

from .errors import InvalidArgumentError


class OutputClashError(InvalidArgumentError):
    """An output path is (or links to) one of the inputs: writing it would destroy that input."""


def model_inputs(store) -> list[str]:
    """The local input files of a model's store (every file of a local directory); [] for a
    remote store, whose files a local output cannot be."""
    from .storage import LocalDir

    inner = getattr(store, "inner", store)  # a TieredStore wraps the model's own store
    if not isinstance(inner, LocalDir):
        return []
    try:
        return [inner.locate(n) for n in inner.names()]
    except OSError:
        return []


def _identity(path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _refuse_if_input(path, ident, inputs: Iterable, what: str) -> None:
    for p in inputs:
        if p is not None and _identity(p) == ident:
            same = "is" if os.path.abspath(os.fspath(path)) == os.path.abspath(os.fspath(p)) else "links to"
            raise OutputClashError(f"{what} {os.fspath(path)}: {same} the input file {os.fspath(p)}; writing it "
                                   "would destroy that input (choose another output file)")


def open_output(path, inputs: Iterable, what: str, *, encoding: str = "utf-8"):
    """``path`` opened for writing text (as ``open(path, "w")``), after refusing it when it is one
    of ``inputs``: opened without truncating, compared by the open descriptor's identity, then
    truncated (a regular file; a device such as ``/dev/null`` is written as it is)."""
    path = os.fspath(path)
    inputs = list(inputs)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        st = os.fstat(fd)
        _refuse_if_input(path, (st.st_dev, st.st_ino), inputs, what)
        if stat.S_ISREG(st.st_mode):
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return open(fd, "w", encoding=encoding)


def dir_relation(out, src) -> str | None:
    """How directory ``out`` relates to directory ``src`` by identity (``st_dev``/``st_ino``, so a
    bind mount or another name of the same directory counts): "is", "inside" or "contains"; None."""
    from pathlib import Path

    s = _identity(src)
    if s is None:
        return None
    out = Path(os.path.abspath(out))
    o = _identity(out)
    if o == s:
        return "is"
    if any(_identity(p) == s for p in out.parents):
        return "inside"
    if o is not None and any(_identity(p) == o for p in Path(os.path.abspath(src)).parents):
        return "contains"
    return None
