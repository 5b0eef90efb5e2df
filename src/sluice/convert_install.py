"""Where ``sluice convert`` writes, and how the finished container takes its place.

Convert never deletes anything that is not a Sluice container: ``check_destination`` refuses an
output that is the source, lies inside it or contains it, an existing path that is not a
container, and an existing container without ``force``. ``install`` swaps the new directory in
with ``renameat2(RENAME_EXCHANGE)`` where the kernel and file system offer it (``exchange``: no
moment without a container at ``dst``); elsewhere the old container is renamed aside, the new
one renamed in and the old one deleted. The files are written through ``writer`` and
``Naming`` (an error names the file) and fsynced (``sync_close``, ``fsync_path``).
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import sys
from pathlib import Path


from .container import (
    FORMAT_NAME,
)
from .errors import ConvertError
from .container_files import foreign_names, remove_container
from .outputs import dir_relation
from .storage.jsonfile import read_json_path


PARTIAL_MARK = ".sluice-partial"  # inside DST.partial / DST.old: a directory convert made and may delete


def _looks_like_container(path: Path) -> bool:
    """A directory whose manifest.json says it is a Sluice container (the only thing convert replaces)."""
    try:
        m = read_json_path(path / "manifest.json")  # size-capped, depth-checked
    except (OSError, ValueError):
        return False
    return isinstance(m, dict) and m.get("format") == FORMAT_NAME


def _related(a: Path, b: Path) -> str | None:
    """How path ``a`` relates to ``b``: "is", "inside" or "contains" (resolved), or None."""
    if a == b:
        return "is"
    if b in a.parents:
        return "inside"
    if a in b.parents:
        return "contains"
    return None


def check_destination(src: Path | str, dst: Path, force: bool) -> None:
    """Refuse an output convert may not write: the source (or inside/around it), a path that is
    not a Sluice container, or an existing container without ``force``. ``src``: a local
    directory, or a URL (a ``str``, which no local output can be related to)."""
    d = dst.resolve()
    outputs = ((d, str(dst)), (d.with_name(d.name + ".partial"), f"{dst}.partial"),
               (d.with_name(d.name + ".old"), f"{dst}.old"))
    s = src.resolve() if isinstance(src, Path) else None
    for path, what in outputs if s is not None else ():
        rel = _related(path, s) or dir_relation(path, s)  # by name, then by identity (a bind mount)
        if rel == "is":
            raise ConvertError(f"{what}: the output is the source model directory {src}; choose another output")
        if rel == "inside":
            raise ConvertError(f"{what}: the output lies inside the source model directory {src}; "
                               "choose an output outside it")
        if rel == "contains":
            raise ConvertError(f"{what}: the output contains the source model directory {src}; "
                               "choose an output that does not")
    if dst.is_symlink():
        raise ConvertError(f"{dst}: exists and is a symbolic link; give the real path of the output")
    if dst.exists():
        if not dst.is_dir():
            raise ConvertError(f"{dst}: exists and is not a directory; convert writes a container directory "
                               "and never replaces other files (remove it or choose another output)")
        if not _looks_like_container(dst):
            raise ConvertError(f"{dst}: exists and is not a Sluice container; convert replaces only containers "
                               "(remove it or choose another output)")
        if not force:
            raise ConvertError(f"{dst}: a Sluice container already exists there; pass --force (force=True) to "
                               "replace it")
        foreign = foreign_names(dst, PARTIAL_MARK)
        if foreign:  # --force replaces a container's own files only: never a user's file kept inside it
            shown_names = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
            raise ConvertError(f"{dst}: the container directory also holds files that are not the container's "
                               f"({shown_names}); convert --force replaces only a container's own files: move "
                               "them out of it (or choose another output)")
    for leftover in (dst.with_name(dst.name + ".partial"), dst.with_name(dst.name + ".old")):
        if (leftover.exists() or leftover.is_symlink()) and not (leftover.is_dir() and not leftover.is_symlink()
                                                                  and (leftover / PARTIAL_MARK).exists()):
            raise ConvertError(f"{leftover}: exists and was not left by sluice convert; convert needs this path "
                               "for its work (remove or rename it)")


def writer(path: Path):
    """Open an output file (a seam for tests that simulate a full disk)."""
    return open(path, "wb")


class Naming:
    """Attach ``path`` to an OSError raised without a file name (a failed write or fsync)."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if isinstance(e, OSError) and not e.filename:
            e.filename = str(self.path)
        return False


def sync_close(f) -> None:
    f.flush()
    os.fsync(f.fileno())
    f.close()


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def exchange(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths with renameat2(RENAME_EXCHANGE); False where the C
    library, kernel or file system does not offer it."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), str(b))


def remove_ours(path: Path) -> None:
    """Delete a directory convert made (it carries the mark); anything else stays."""
    if path.is_dir() and not path.is_symlink() and (path / PARTIAL_MARK).exists():
        shutil.rmtree(path)


def remove_old(path: Path) -> None:
    """Delete a replaced container: its own files only (``container_files``); a file that appeared in
    it since the check stays, and so does the directory, with a warning naming it."""
    left = remove_container(path, PARTIAL_MARK)
    if left:
        print(f"sluice: warning: {path}: kept the replaced container's directory, which holds files that are "
              f"not the container's ({', '.join(left[:5])}); move them and remove the directory", file=sys.stderr)


def install(tmp: Path, dst: Path) -> None:
    """Move the finished ``tmp`` to ``dst``, replacing a container there (checked before)."""
    parent = dst.parent
    if not dst.exists():
        os.rename(tmp, dst)
    elif exchange(tmp, dst):  # dst is the new container now; the old one is at tmp
        (tmp / PARTIAL_MARK).touch()
        remove_old(tmp)
    else:  # no atomic exchange: a short window between the two renames without dst
        old = dst.with_name(dst.name + ".old")
        remove_ours(old)
        (dst / PARTIAL_MARK).touch()
        os.rename(dst, old)
        try:
            os.rename(tmp, dst)
        except BaseException:
            os.rename(old, dst)  # put the old container back
            (dst / PARTIAL_MARK).unlink(missing_ok=True)
            raise
        remove_old(old)
    (dst / PARTIAL_MARK).unlink(missing_ok=True)
    fsync_path(dst)
    fsync_path(parent)
