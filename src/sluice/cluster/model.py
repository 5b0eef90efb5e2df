"""What a worker opens of a model (its expert source), and the signature workers must share.

A worker opens the model at the location the driver was given (a local path that exists on
every machine, or an ``s3://`` / ``http(s)://`` URL) and reads only experts from it. The
signature names everything that decides an expert's output bits: the kernels' instruction-set
path and batch invariance, the torch and sluice versions, and a hash of the model (its config
and every tensor's name, dtype, shape and size). The driver refuses a worker whose signature
differs from its own.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from importlib import metadata

import torch

from ..kernels.backend import cpu
from ..checkpoint import Checkpoint
from ..container import Container, is_container
from ..errors import CheckpointError, SluiceError
from ..experts.source import CheckpointExperts, ContainerExperts, ExpertSource
from ..experts.spec import ExpertSpec
from ..models import get_family
from ..storage import open_store
from ..storage.urls import mask


@dataclass
class OpenedExperts:
    checkpoint: object  # Checkpoint or Container
    source: ExpertSource
    spec: ExpertSpec
    moe_layers: list[int]
    n_experts: int
    raw_config: dict


def open_experts(location: str, direct_io: bool | None = None, ca_bundle: str | None = None,
                 allow_unversioned_remote: bool = False) -> OpenedExperts:
    """Open the model at ``location`` for its experts only (no spine, no tokenizer)."""
    remote = {"ca_bundle": os.fspath(ca_bundle)} if ca_bundle else {}
    if allow_unversioned_remote:
        remote["allow_unversioned"] = True
    try:
        store = open_store(location, **remote)
        ckpt = Container(store, direct=direct_io) if is_container(store) else Checkpoint(store, direct=direct_io)
    except SluiceError:
        raise
    except OSError as e:
        raise CheckpointError(mask(f"{location}: cannot open the model: {e}")) from None
    family = get_family(ckpt.config.get("model_type"))
    cfg = family.parse_config(ckpt.config)
    desc = family.describe(cfg)
    aliases = getattr(family, "tensor_aliases", None)
    if aliases is not None:  # as ModelInfo: a tensor some checkpoints store under another name
        tensors = ckpt.tensors
        for name, alt in aliases(cfg).items():
            if name not in tensors and alt in tensors:
                tensors[name] = tensors[alt]
    if isinstance(ckpt, Container):
        source = ContainerExperts(ckpt, desc.moe_layers, desc.n_experts, desc.expert)
    else:
        source = CheckpointExperts(ckpt, desc.moe_layers, desc.n_experts, desc.expert_tensors, desc.expert_format,
                                   desc.expert)
    return OpenedExperts(ckpt, source, desc.expert, list(desc.moe_layers), desc.n_experts, ckpt.config)


def model_hash(checkpoint) -> str:
    """sha256 of the model's config and tensor table (names, dtypes, shapes, sizes): equal on two
    machines holding the same files, whatever their paths."""
    h = hashlib.sha256(json.dumps(checkpoint.config, sort_keys=True, default=str).encode())
    for name in sorted(checkpoint.tensors):
        info = checkpoint.tensors[name]
        h.update(f"{name}|{info.dtype}|{tuple(info.shape)}|{info.nbytes}\n".encode())
    return h.hexdigest()[:16]


def _version(pkg: str) -> str:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return "unknown"


def signature(checkpoint) -> dict:
    """What decides the bits of an expert's output on this process."""
    k = cpu.info()
    return {"kernels": {key: k[key] for key in sorted(k) if key in ("available", "avx2", "avx512")},
            "batch_invariant": cpu.batch_invariant(), "torch": torch.__version__, "sluice": _version("sluice"),
            "model": model_hash(checkpoint)}


def differences(mine: dict, theirs: dict) -> list[str]:
    """Human-readable keys where two signatures differ (empty: they match)."""
    return [f"{key}: driver {mine.get(key)!r}, worker {theirs.get(key)!r}"
            for key in sorted(set(mine) | set(theirs)) if mine.get(key) != theirs.get(key)]
