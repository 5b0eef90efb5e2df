"""Connecting to a Ray cluster: ``--ray auto`` or ``--ray ADDRESS``."""

from __future__ import annotations

import logging
import os

from .errors import INSTALL_HINT, ClusterError, RayUnavailableError


def require_ray():
    """The ``ray`` module, or ``RayUnavailableError`` saying what to install."""
    try:
        import ray
    except ImportError:
        raise RayUnavailableError(INSTALL_HINT) from None
    return ray


def connect(address: str) -> str:
    """Connect this process to a Ray cluster; returns a line saying which (or that one was started).

    ``auto``: ``RAY_ADDRESS`` if set, else a cluster running on this machine (``ray start``),
    else a new local cluster (this process's, gone when it exits). Anything else is an address
    (``HOST:PORT`` or ``ray://HOST:PORT``). A process already connected stays on its cluster.
    """
    ray = require_ray()
    if ray.is_initialized():
        return "experts on the Ray cluster this process is connected to"
    quiet = dict(logging_level=logging.WARNING, log_to_driver=False, configure_logging=True)
    if address != "auto":
        try:
            ray.init(address=address, **quiet)
        except (ConnectionError, ValueError, RuntimeError) as e:
            raise ClusterError(f"--ray {address}: cannot connect to a Ray cluster there: {e}") from None
        return f"experts on the Ray cluster at {address}"
    env = os.environ.get("RAY_ADDRESS")
    if env:
        try:
            ray.init(address=env, **quiet)
        except (ConnectionError, ValueError, RuntimeError) as e:
            raise ClusterError(f"--ray auto: cannot connect to RAY_ADDRESS={env}: {e}") from None
        return f"experts on the Ray cluster at RAY_ADDRESS={env}"
    try:
        ray.init(address="auto", **quiet)
        return "experts on the Ray cluster running on this machine"
    except ConnectionError:
        pass
    # a cluster of this process only: on loopback (Ray has no authentication), dashboard off
    ray.init(include_dashboard=False, _node_ip_address="127.0.0.1", **quiet)
    return ("no Ray cluster found (RAY_ADDRESS unset, none running here): started a local one for this "
            "process (ray start --head to run one that outlives it)")
