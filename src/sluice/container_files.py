"""The files a container consists of, so that replacing one removes those and nothing else.

``sluice convert --force`` replaces an existing container. A user's own file kept inside that
directory (notes, a README, a second model's shard) is not the container's, and deleting it
would be silent data loss. The container's names are what its manifest says it holds:
``manifest.json``, the spine file, every expert bank, the copied tokenizer files (and the mark
convert leaves in a directory it is working on). ``foreign_names`` lists anything else, and
``remove_container`` unlinks only the container's names, then the directory if that left it
empty.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from .container import ManifestNameError, member_file
from .storage.jsonfile import JSONFileError, read_json_path

MANIFEST = "manifest.json"


def own_names(path: Path, mark: str) -> set[str]:
    """The file names the container at ``path`` consists of (by its manifest; names that are not
    plain file names are skipped: they are never the container's to delete)."""
    names = {MANIFEST, mark}
    try:
        m = read_json_path(Path(path) / MANIFEST)
    except (OSError, JSONFileError):
        return names
    if not isinstance(m, dict):
        return names
    candidates = []
    for section in ("spine", "rows"):
        part = m.get(section)
        if isinstance(part, dict):
            candidates.append(part.get("file"))
    layers = (m.get("experts") or {}).get("layers") if isinstance(m.get("experts"), dict) else None
    if isinstance(layers, dict):
        candidates += [b.get("file") for b in layers.values() if isinstance(b, dict)]
    tok = m.get("tokenizer_files")
    if isinstance(tok, list):
        candidates += tok
    for c in candidates:
        with contextlib.suppress(ManifestNameError):
            names.add(member_file(c, path))
    return names


def foreign_names(path: Path, mark: str) -> list[str]:
    """Entries of directory ``path`` that are not the container's own files (sorted)."""
    own = own_names(path, mark)
    try:
        entries = os.listdir(path)
    except OSError:
        return []
    return sorted(n for n in entries if n not in own
                  or (os.path.isdir(Path(path) / n) and not os.path.islink(Path(path) / n)))


def remove_container(path: Path, mark: str) -> list[str]:
    """Unlink the container's own files in ``path`` and the ``mark``, then the directory if that
    emptied it; returns what was left there (foreign files: the directory stays, unmarked)."""
    path = Path(path)
    for n in own_names(path, mark) - {mark}:
        p = path / n
        if p.is_symlink() or p.is_file():  # unlinking a link (or one hard link) deletes no one's data
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
    with contextlib.suppress(FileNotFoundError):
        (path / mark).unlink()  # also when files stay: the mark would let convert delete the directory later
    left = sorted(os.listdir(path))
    if not left:
        os.rmdir(path)
    return left
