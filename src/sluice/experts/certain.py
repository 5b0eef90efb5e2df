"""Certain reads: experts known from the step's token ids before the model runs.

A hash-routed layer (DeepSeek-V4's ``hash_moe``, ``layers.routing.HashRouter``) picks its experts
from a resident table of the token ids, so as soon as a forward's ids are known its experts are
too: nothing is a guess. The runner asks the model (``CausalLM.certain_experts``) and hands the
answer to the expert interface (``ExpertInterface.read_certain``), which the local provider
serves here:

- a forward's own certain experts are read at demand priority right after ``begin``, before
  the embedding runs, in layer order (the first hash layer's are the first in the queue). Each
  slot is pinned until its layer's ``moe`` has run, so it is never evicted before use and never
  read twice (the layer finds it READY, or joins the read in flight). ``staggered`` (off) queues
  the later hash layers' behind every demand read (prefetch priority: at most the pool's
  ``low_cap`` of them at once) until the MoE layer before them has run, so they do not share the
  disk with the first layer's; measured side by side (``benchmarks/certain_reads.py --arms
  on,staggered,off``, docs/families.md) it made no difference beyond the noise, so the simpler
  rule is the default;
- the next prefill chunk's (the step's next forward) are issued as the current forward leaves
  each of those layers, at prefetch priority (the current chunk's demand reads go first), and
  raised to demand when their forward begins (only the first layer's, ``staggered``);
- the pins never take the room the running layer needs: at most ``capacity - reserve`` slots
  are pinned by certain reads at once, ``reserve`` being the union one layer of the forward
  can route to (``min(experts per layer, rows x top-k)``); what does not fit is read by its
  layer on demand, as without certain reads.

Results never depend on any of this: ``moe`` folds in ascending expert order whatever was read
when. ``ExpertCounters`` count the reads (``certain_reads``, ``certain_bytes``).
"""

from __future__ import annotations

import torch

from .cache import READY, Slot
from .reader import DEMAND, PREFETCH


def distinct(ids: torch.Tensor) -> list[int]:
    """The distinct experts of ``ids`` [T, K], ascending."""
    if ids.numel() == 1:
        return [int(ids.reshape(-1)[0])]
    return torch.unique(ids.reshape(-1)).tolist()


class CertainReads:
    """The provider's certain reads and the pins that hold them until their layer runs."""

    def __init__(self, provider):  # the ``ExpertProvider`` (not imported: it imports this module)
        self.provider = provider
        self.pins: dict[int, list[tuple[Slot, tuple[int, int]]]] = {}  # this forward's, by layer
        self.ahead_pins: dict[int, list[tuple[Slot, tuple[int, int]]]] = {}  # the next forward's
        self.ahead: dict[int, list[int]] = {}  # the next forward's experts, issued as layers finish
        self.reserve = 0
        # True: the later hash layers' reads queued behind every demand read until the MoE layer
        # before them has run (benchmarks/certain_reads.py's ``staggered`` arm); False: all at demand
        self.staggered = False

    @property
    def pinned(self) -> int:
        return sum(len(v) for v in self.pins.values()) + sum(len(v) for v in self.ahead_pins.values())

    @staticmethod
    def _unpin(held: list[tuple[Slot, tuple[int, int]]]) -> None:
        for slot, key in held:
            if slot.key == key and slot.pins > 0:  # a failed read's slot was discarded (and maybe reused)
                slot.pins -= 1

    def begin(self) -> None:
        """A forward begins: pins left by one that did not reach their layer are dropped, the next
        forward's (issued ahead) become this one's, their reads raised to demand (the first
        layer's only, ``staggered``)."""
        for held in self.pins.values():
            self._unpin(held)
        self.pins, self.ahead_pins, self.ahead = self.ahead_pins, {}, {}
        if self.staggered:
            self._raise_after(-1)
        else:
            for layer in list(self.pins):
                self._raise(layer)

    def _raise(self, layer: int) -> None:
        for slot, key in self.pins[layer]:
            if slot.key == key and slot.ticket is not None:
                slot.ticket.raise_to(DEMAND)

    def _raise_after(self, layer: int) -> None:
        """Raise the reads of the first layer after ``layer`` that holds certain pins to demand."""
        later = [lay for lay in self.pins if lay > layer]
        if later:
            self._raise(min(later))

    def issue(self, certain: dict[int, torch.Tensor], rows: int, ahead: bool) -> None:
        """Read (and pin) ``certain`` (layer -> experts [T, K]) for this forward, or, ``ahead``, keep
        them for the next one (``layer_done`` issues each layer's). ``rows``: the forward's rows."""
        p = self.provider
        if not certain or p.holds_all():
            return
        top_k = max(int(ids.shape[1]) if ids.dim() == 2 else 1 for ids in certain.values())
        self.reserve = max(self.reserve if ahead else 0, min(p.n_experts, rows * top_k))
        if ahead:
            self.ahead = {layer: distinct(ids) for layer, ids in certain.items()}
            return
        for i, layer in enumerate(sorted(certain)):
            if not self._pin(
                layer, distinct(certain[layer]), DEMAND if i == 0 or not self.staggered else PREFETCH, self.pins
            ):
                return

    def layer_done(self, layer: int) -> None:
        """``layer``'s ``moe`` has run: release its pins; issue the next forward's reads of it."""
        held = self.pins.pop(layer, None)
        if held:
            self._unpin(held)
        if self.pins and self.staggered:
            self._raise_after(layer)  # the next hash layer's reads: now the most urgent
        experts = self.ahead.pop(layer, None) if self.ahead else None
        if experts and not self.provider.holds_all():
            self._pin(layer, experts, PREFETCH, self.ahead_pins)

    def _pin(self, layer: int, experts: list[int], priority: int, into: dict) -> bool:
        """Read (or find) and pin ``experts`` of ``layer`` in ascending order while the room lasts;
        False once it has run out (or no slot could be had)."""
        p = self.provider
        cache, c = p.cache, p.counters
        room = cache.capacity - self.reserve - self.pinned
        held = into.setdefault(layer, [])
        mine = {key for _, key in held}
        for e in experts:
            key = (layer, e)
            if key in mine:
                continue
            if room <= 0:
                return False
            slot = cache.lookup(key)
            if slot is None:
                slot = p._start_read(key, speculative=False, priority=priority, certain=True)
                if slot is None:
                    return False
                c.certain_reads += 1
                c.certain_bytes += slot.layout.read_bytes if slot.layout is not None else 0
            else:
                if slot.speculative:  # a lookahead guess that is certain now: never cancelled
                    slot.speculative = False
                    c.prefetch_used += 1
                if slot.state != READY and slot.ticket is not None:
                    slot.ticket.raise_to(priority)
            slot.pins += 1
            held.append((slot, key))
            room -= 1
        return True


__all__ = ["CertainReads", "distinct"]
