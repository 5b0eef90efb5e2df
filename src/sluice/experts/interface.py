"""The one expert interface the engine, the runner and the families use.

Two implementations: ``experts.provider.ExpertProvider`` (this process: cache, reader pool,
compute) and ``cluster.provider.RayExperts`` (experts sharded over Ray actors, the driver
holding no expert cache). A family sees only ``moe`` (and ``resident_mask`` for the lossy
``prefer_cached``); the runner and the engine use the rest. Both fold the expert outputs
in ascending expert order, so logits are bit-identical whichever runs them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class ExpertInterface(ABC):
    """What the engine reaches for. Attributes every implementation keeps:

    - ``counters``: an ``experts.provider.ExpertCounters`` (lookups, hits, reads, waits, ...);
    - ``decoding``: set by the runner, lookups count toward the hit rate only while True;
    - ``routing`` / ``predicted_routing``: None, or dicts the runner sets to record each MoE
      layer's (ids, weights) and the lookahead's predicted ids during a forward.
    """

    decoding: bool = False
    routing: dict | None = None
    predicted_routing: dict | None = None

    @abstractmethod
    def moe(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Weighted sum of the routed experts: x [T, H] fp32, ids/weights [T, K] -> [T, H], summed
        in ascending expert order."""

    @abstractmethod
    def prefetch(self, layer: int, experts: list[int], read: bool = True, distance: int = 1) -> None:
        """The lookahead's prediction for ``layer`` (made ``distance`` layers ahead), most likely
        first: tell the cache policy, and start reads unless ``read`` is False. Results never
        depend on it."""

    def after_reads(self, layer: int, fn) -> None:
        """Run the lookahead ``fn()`` for ``layer`` once that layer's demand reads are issued; by
        default at once (an implementation that sends the prediction with the layer's request)."""
        fn()

    @abstractmethod
    def resident_mask(self, layer: int) -> torch.Tensor:
        """[E] float: 1 for experts of ``layer`` in memory (the lossy ``prefer_cached`` bias)."""

    @abstractmethod
    def tick(self) -> None:
        """A forward begins (the cache policy's clock)."""

    @property
    @abstractmethod
    def evictions(self) -> int:
        """Experts evicted from the cache(s) since load."""

    @property
    def bytes_read_elsewhere(self) -> int:
        """Expert bytes read outside this process's checkpoint (by remote workers); 0 here."""
        return 0

    def drain(self) -> None:
        """Wait for reads in flight (benchmarks, before measuring a cold start)."""

    @abstractmethod
    def close(self) -> None:
        """Stop readers (and workers); the interface is unusable afterwards."""
