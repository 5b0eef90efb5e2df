"""The typed step boundary: what one forward carries from the runner down to the layers.

The runner builds one ``ForwardContext`` per forward and passes it to ``CausalLM.forward``;
the model hands it to every MoE block, which passes it to ``experts.moe`` (the local
provider and the Ray driver alike), and to any layer that needs the step's token ids or
positions (hash routing, token-keyed tables). Nothing about the step is set on the experts
object or the model from outside: what was ``decoding``, ``segments``, ``routing`` and
``predicted_routing`` attributes and the engine's ``model.lookahead`` hook is here.

Shape legend: T rows of the forward (all segments), K experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Segment:
    """One sequence's rows of a forward: rows ``first..end`` at positions ``start..`` on ``state``
    (the family's ``State``), decoding (past its prefill) or not."""

    first: int
    end: int
    start: int
    state: object
    decoding: bool = False

    @property
    def rows(self) -> int:
        return self.end - self.first


@dataclass
class Recording:
    """What a forward records when a step asks for the routing (traces, tests): per MoE layer
    the routed (ids [T, K], weights [T, K], router probabilities [T, E] or None), and the
    lookahead's prediction ids [T, K] for the layers it predicted."""

    routing: dict[int, tuple] = field(default_factory=dict)
    predicted: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class ForwardContext:
    """One forward: its token ids [T] (every segment's, in row order) and segments; ``record``
    (None: record nothing) and ``lookahead``: the expert side's ``Lookahead`` (or None), called
    after each layer's attention. ``certain``: per hash-routed layer, the experts [T, K] the token
    ids decide (``CausalLM.certain_experts``; empty for a family without such layers): known
    before any layer runs, the runner has them read early (``ExpertInterface.read_certain``)."""

    token_ids: torch.Tensor
    segments: list[Segment]
    record: Recording | None = None
    lookahead: object = None
    # per segment, the tokens its sequence runs in the step's next forward (its next prefill chunk;
    # empty: none), known before this forward runs (row tables read ahead: models/streams.py)
    next_tokens: list[list[int]] | None = None
    certain: dict[int, torch.Tensor] = field(default_factory=dict)
    _positions: torch.Tensor | None = field(default=None, repr=False)

    @classmethod
    def single(cls, token_ids: torch.Tensor, state=None, start: int = 0, decoding: bool = False,
               **kw) -> "ForwardContext":
        """A forward of one sequence."""
        return cls(token_ids, [Segment(0, int(token_ids.shape[0]), start, state, decoding)], **kw)

    @property
    def rows(self) -> int:
        return self.segments[-1].end if self.segments else 0

    @property
    def decoding(self) -> bool:
        """Some segment is decoding: its lookups count toward the hit rate."""
        return any(s.decoding for s in self.segments)

    def positions(self) -> torch.Tensor:
        """Each row's position [T] (long)."""
        if self._positions is None:
            segs = self.segments
            self._positions = (torch.arange(segs[0].start, segs[0].start + segs[0].rows) if len(segs) == 1 else
                               torch.cat([torch.arange(s.start, s.start + s.rows) for s in segs]))
        return self._positions

    def layer_segments(self, layer: int) -> list[tuple[int, int, int, object]]:
        """``attn.segments``' argument for ``layer``: (first row, end row, start, layer state)."""
        return [(s.first, s.end, s.start, s.state.layers[layer]) for s in self.segments]


__all__ = ["ForwardContext", "Recording", "Segment"]
