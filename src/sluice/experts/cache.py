"""A bounded expert cache: fixed-size slots in one aligned arena, a key map and a policy.

All bookkeeping happens on the engine thread; reader threads only fill slot memory.
Slots are allocated once, so steady-state decoding allocates nothing per token.
"""

from __future__ import annotations

from collections.abc import Hashable
from concurrent.futures import Future

from ..kernels.backend import Backend, cpu
from ..quant import ExpertWeights, assemble
from ..storage import AlignedBuffer
from .layout import ExpertLayout
from .policy import Policy

EMPTY, LOADING, READY = 0, 1, 2


class Slot:
    __slots__ = ("index", "key", "state", "future", "weights", "pins", "speculative", "layout", "ticket")

    def __init__(self, index: int):
        self.index = index
        self.key: Hashable | None = None
        self.state = EMPTY
        self.future: Future | None = None
        self.weights: ExpertWeights | None = None  # assembled once, when the read completes
        self.pins = 0
        self.speculative = False
        self.layout: ExpertLayout | None = None
        self.ticket = None  # the read's priority ticket (storage/priority.py) while it is LOADING


class ExpertCache:
    def __init__(self, capacity: int, slot_bytes: int, policy: Policy, huge_pages: bool = False,
                 backend: Backend = cpu):
        if capacity < 1:
            raise ValueError("the expert cache needs at least one slot")
        self.capacity = capacity
        self.slot_bytes = slot_bytes
        self.policy = policy
        self.backend = backend  # where ready() places the assembled weights (kernels.backend)
        self.arena = AlignedBuffer(capacity * slot_bytes, huge=huge_pages)
        self.slots = [Slot(i) for i in range(capacity)]
        self._free = list(range(capacity - 1, -1, -1))
        self._map: dict[Hashable, Slot] = {}
        self._draining: list[Slot] = []  # abandoned slots whose read has not stopped yet
        self.evictions = 0
        self.evicted_unused = 0  # speculative loads evicted before any use
        self.ready_count = 0  # keys whose slot is READY (== the model's experts: the cache holds it all)

    def __len__(self) -> int:
        return len(self._map)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._map

    def keys(self):
        return self._map.keys()

    def lookup(self, key: Hashable) -> Slot | None:
        return self._map.get(key)

    def ready_slots(self, keys) -> list[Slot] | None:
        """The slots of ``keys`` if every one is READY (the warm case: nothing to read or wait
        on), else None. Looks up only; the caller pins and tells the policy."""
        get = self._map.get
        out = []
        for key in keys:
            slot = get(key)
            if slot is None or slot.state != READY:
                return None
            out.append(slot)
        return out

    def _evictable(self, key: Hashable) -> bool:
        s = self._map[key]
        return s.state == READY and s.pins == 0

    def allocate(self, key: Hashable, layout: ExpertLayout, speculative: bool = False,
                 prob: float | None = None) -> Slot | None:
        """A slot for ``key`` (state LOADING), evicting by policy; None if every slot is busy (or,
        for a ``speculative`` key, if the policy keeps every victim over a guess of probability
        ``prob``)."""
        if not self._free and self._draining:
            self._reclaim()
        if self._free:
            slot = self.slots[self._free.pop()]
        else:
            if speculative:
                victim = self.policy.speculative_victim(self._evictable, prob)
            else:
                victim = self.policy.victim(self._evictable)
            if victim is None:
                return None
            slot = self._map.pop(victim)
            self.policy.remove(victim)
            self.evictions += 1
            self.ready_count -= 1  # victims are READY (``_evictable``)
            if slot.speculative:
                self.evicted_unused += 1
        slot.key, slot.state, slot.layout = key, LOADING, layout
        slot.weights, slot.future, slot.speculative, slot.pins, slot.ticket = None, None, False, 0, None
        self._map[key] = slot
        self.policy.insert(key, speculative)
        return slot

    def base(self, slot: Slot) -> int:
        return slot.index * self.slot_bytes

    def ready(self, slot: Slot) -> None:
        """Mark a loaded slot READY and assemble its weights (``quant.assemble``: views over the
        slot memory), once per read; a cached expert keeps them until its slot is reused."""
        slot.weights = assemble(self.arena, self.base(slot), slot.layout, self.backend)
        if slot.state != READY and slot.key is not None and self._map.get(slot.key) is slot:
            self.ready_count += 1
        slot.state = READY
        slot.future = slot.ticket = None

    def discard(self, slot: Slot) -> None:
        """Forget a slot whose read failed: nothing from it stays cached."""
        if slot.key is not None and self._map.get(slot.key) is slot:
            del self._map[slot.key]
            self.policy.remove(slot.key)
            if slot.state == READY:
                self.ready_count -= 1
        slot.key, slot.state, slot.weights, slot.future, slot.pins, slot.layout = None, EMPTY, None, None, 0, None
        slot.ticket = None
        self._free.append(slot.index)

    def abandon(self, slot: Slot) -> None:
        """Forget a LOADING slot whose read is still running (a cancelled prefetch): its key
        leaves the cache now; the slot is reused once the read has stopped (``draining``)."""
        if slot.key is not None and self._map.get(slot.key) is slot:
            del self._map[slot.key]
            self.policy.remove(slot.key)
            if slot.state == READY:
                self.ready_count -= 1
        slot.key = None
        self._draining.append(slot)

    def draining(self) -> list[Slot]:
        return list(self._draining)

    def _reclaim(self) -> None:
        """Free the abandoned slots whose read has stopped."""
        keep = []
        for slot in self._draining:
            if slot.future is None or slot.future.done():
                self.discard(slot)
            else:
                keep.append(slot)
        self._draining = keep

    def loading(self) -> list[Slot]:
        return [s for s in self._map.values() if s.state == LOADING]
