"""Errors of the distributed expert path (all ``SluiceError`` subclasses)."""

from __future__ import annotations

from ..errors import ExpertReadError, InvalidArgumentError, SluiceError

INSTALL_HINT = 'experts on a Ray cluster (--ray) need the ray extra: pip install "sluice[ray]"'


class RayUnavailableError(InvalidArgumentError):
    """``--ray`` was given and Ray is not installed."""


class ClusterError(SluiceError):
    """The Ray cluster could not be reached, or its workers could not start."""


class WorkerMismatchError(ClusterError):
    """A worker computes with other kernels, libraries or another model than the driver."""


class WorkerLostError(ExpertReadError):
    """An expert worker died (or stopped answering) while computing a request's experts."""
