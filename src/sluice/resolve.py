"""Where a model named on the command line (or passed to ``sluice.load``) lives on disk.

``resolve_model(spec, revision=None) -> (location, model_id)``, in this order:

1. an existing local path (a Hugging Face model directory or a Sluice container) wins,
   whatever it is called; its model id is the directory name;
2. a URL (``http://``, ``https://``, ``s3://``): a remote store, returned as the URL (a str; the
   rule is ``storage.location``'s, and ``open_store`` opens it); its model id is the URL's last
   path component;
3. ``demo``: the trained demo model shipped inside the package, model id ``sluice-demo``;
4. a Hugging Face repo id (``Qwen/Qwen3-30B-A3B``): its snapshot in the local Hugging Face
   cache (``HF_HUB_CACHE``, or ``HF_HOME``/hub, default ``~/.cache/huggingface/hub``) at
   ``refs/main`` or at ``revision`` (a branch or tag name under ``refs/``, or a commit hash),
   found with ``huggingface_hub``'s cache functions and never over the network; its model
   id is the repo id.

Anything else is a ``ModelNotFoundError`` that says what was looked for, close names (difflib,
among ``demo`` and the directories beside the name: ``dmeo`` -> ``demo``), and only for a name
shaped like a repo id (``owner/name``) the ``hf download`` command that fetches it.
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import CheckpointError

DEMO_NAME = "demo"
DEMO_MODEL_ID = "sluice-demo"
DEMO_DIR = Path(__file__).resolve().parent / "demo_model"
MODEL_HELP = ("a Hugging Face model directory, a Sluice container, an s3://, http:// or https:// URL of "
              "either (the remote extra), 'demo' (the small model shipped with Sluice), or a Hugging Face "
              "repo id already in the local Hugging Face cache (e.g. Qwen/Qwen3-30B-A3B, downloaded with "
              "`hf download`)")
REVISION_HELP = ("with a repo id: the branch, tag or commit hash of the cached snapshot to use "
                 "(default: main)")


class ModelNotFoundError(CheckpointError):
    """The model named is neither a local path, ``demo``, nor a repo id in the local Hugging Face cache."""


def model_id_for(path: str | os.PathLike) -> str:
    """The model id of a local directory: its name (what a server reports and clients send)."""
    p = Path(os.path.abspath(path))  # '.' and '..' named, symlinks kept: the name the user chose
    return p.name or str(p)


def model_id_for_url(url: str) -> str:
    """The model id of a URL: its last path component (``s3://bucket/models/olmoe`` -> ``olmoe``)."""
    rest = url.split("://", 1)[1].split("?", 1)[0].rstrip("/")
    return rest.rpartition("/")[2] or rest


def resolve_model(spec: str | os.PathLike, revision: str | None = None,
                  cache_dir: str | os.PathLike | None = None) -> tuple[Path | str, str]:
    """``(location, model_id)`` of the model ``spec`` names: a local directory (``Path``) or a
    URL (``str``); see the module docstring.

    ``cache_dir`` overrides the Hugging Face cache directory (default: huggingface_hub's,
    which honours ``HF_HUB_CACHE`` and ``HF_HOME``).
    """
    text = os.fspath(spec)
    if not text:
        raise ModelNotFoundError("no model given: name a model directory, a container, 'demo' or a repo id")
    path = Path(text).expanduser()
    if path.exists():
        if revision is not None:
            raise ModelNotFoundError(f"{text}: --revision applies to a Hugging Face repo id in the local cache, "
                                     "not to a local path")
        return path, model_id_for(path)
    from .storage.location import check_location, is_url  # here: `sluice --help` imports this module, not torch

    check_location(text)  # an unknown scheme:// is refused
    if is_url(text):
        if revision is not None:
            raise ModelNotFoundError(f"{text}: --revision applies to a Hugging Face repo id in the local cache, "
                                     "not to a URL")
        url = text.rstrip("/")
        return url, model_id_for_url(url)
    if text == DEMO_NAME:
        if revision is not None:
            raise ModelNotFoundError("demo: --revision applies to a Hugging Face repo id, not to the demo model")
        if not (DEMO_DIR / "config.json").is_file() or not (DEMO_DIR / "model.safetensors").is_file():
            raise ModelNotFoundError(f"the demo model is missing from {DEMO_DIR}; reinstall sluice")
        return DEMO_DIR, DEMO_MODEL_ID
    if not _looks_like_repo_id(text):
        raise ModelNotFoundError(f"{text}: no such file or directory{_did_you_mean(text)}")
    return _from_hf_cache(text, revision, cache_dir)


def _did_you_mean(text: str) -> str:
    """``"; did you mean 'demo'?"`` when ``text`` is close (difflib) to a built-in name or to a
    directory beside it (in its parent, or the current directory); else ``""``."""
    import difflib

    parent, name = os.path.split(text)
    names = [DEMO_NAME] if not parent else []
    try:
        with os.scandir(parent or ".") as it:
            names += [e.name for e in it if not e.name.startswith(".") and e.is_dir()]
    except OSError:
        pass
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
    if not close:
        return ""
    shown = [os.path.join(parent, c) if parent else c for c in close]
    return "; did you mean " + " or ".join(repr(c) for c in shown) + "?"


def _looks_like_repo_id(text: str) -> bool:
    if text.startswith((".", "/", "~")) or text.endswith("/") or text.count("/") > 1:
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def _from_hf_cache(repo_id: str, revision: str | None, cache_dir) -> tuple[Path, str]:
    from huggingface_hub import constants, try_to_load_from_cache

    cache = Path(cache_dir) if cache_dir is not None else Path(constants.HF_HUB_CACHE)
    rev = revision or constants.DEFAULT_REVISION
    download = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")
    where = f"the Hugging Face cache ({cache})"
    if "/" not in repo_id and not (cache / f"models--{repo_id}").is_dir():
        # a single word: a mistyped name or path far more often than a repo id (Hub repo ids are
        # owner/name), so no download is suggested, only close names
        raise ModelNotFoundError(f"{repo_id}: no such file or directory, and no model '{repo_id}' in "
                                 f"{where}{_did_you_mean(repo_id)} (a Hugging Face repo id is owner/name)")
    found = try_to_load_from_cache(repo_id, "config.json", cache_dir=str(cache), revision=rev)
    if not isinstance(found, str):
        repo_dir = cache / f"models--{repo_id.replace('/', '--')}"
        if not repo_dir.is_dir():
            what = f"no model '{repo_id}' in {where}"
        elif revision is None:
            what = f"{where} has '{repo_id}', but not its main revision (refs/main) with a config.json"
        else:
            what = f"{where} has '{repo_id}', but not revision '{revision}' with a config.json"
        raise ModelNotFoundError(f"{repo_id}: not a local path, and {what}. Sluice never downloads; "
                                 f"fetch it with: {download}")
    snapshot = Path(found).parent
    if not any((snapshot / n).is_file() for n in ("model.safetensors", "model.safetensors.index.json")):
        raise ModelNotFoundError(f"{repo_id}: the cached snapshot {snapshot} has a config.json but no safetensors "
                                 "weights (model.safetensors or model.safetensors.index.json); Sluice reads "
                                 f"safetensors checkpoints only. If the download was cut short, finish it: {download}")
    return snapshot, repo_id
