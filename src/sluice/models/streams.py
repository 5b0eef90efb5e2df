"""The gated multi-stream skeleton (Qwen3.8-Flash-Next, ``qwen4_exp``) and its declaration.

The residual is n streams side by side, [T, n * H] (``layers/gated_residual.py``). Per layer:

    if PLE:  h += ple(h, rows of the step's tokens)             (layers/ple.py)
    x, w = attn_hc(h); h = inject(h, attn(x), w)                  (no pre-norm: attn_hc normalises)
    x, w = mlp_hc(h);  h = inject(h, mlp(x), w)

and at the end ``logits = head(mixer(h))`` (the mixer collapses the streams; no final norm).

A ``StreamModel`` is a ``declare.Model`` whose layers are ``StreamLayer``s: each part at its
checkpoint prefix under ``model.layers.<i>.`` (``attn_hyper_connection.``,
``mlp_hyper_connection.``, the attention part's own, ``mlp.``, ``ple.``), so ``spine``,
``state`` and ``describe`` derive from the one declaration as for every family. The PLE
tables are not spine tensors: ``tables`` lists them (name -> (rows, dim)), the engine opens a
``rows.RowStore`` on them and hands it to the built model (``StreamCausalLM.attach_rows``).

``StreamCausalLM.forward`` computes every PLE layer's row ids at the start of the step, from
the token ids and each sequence's n-gram context, and issues their reads at once
(``RowStore.issue``); each PLE layer then gathers its rows. The router lookahead predicts a
later layer's experts from the streams through that layer's ``mlp_hc`` collapse and router.

Shape legend: T rows, n streams, H hidden.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..layers.context import ForwardContext
from ..layers.gated_residual import GatedResidual, expand, inject
from ..layers.routing import Router
from ..quant import embed
from .base import CausalLM, MoEBlock, State
from .declare import Lin, Model, Part, Shape


def gated_residual(n: int, hidden: int, rank: int, eps: float, *, injects: bool = True) -> Part:
    """A ``layers.gated_residual.GatedResidual``: ``hc_norm.weight`` [n * H], the low-rank
    ``input_mix_weight_down`` [r, n * H] / ``input_mix_weight_up`` [n * H, r] and, but for the
    final mixer, ``block_inject_weight`` [n, n * H]."""
    c = n * hidden
    tensors: dict = {"hc_norm.weight": (c,), "input_mix_weight_down": Lin((rank, c)),
                     "input_mix_weight_up": Lin((c, rank))}
    if injects:
        tensors["block_inject_weight"] = Lin((n, c))
    return Part(tensors, lambda t: GatedResidual(t("hc_norm.weight"), t.lin("input_mix_weight_down"),
                                                 t.lin("input_mix_weight_up"),
                                                 t.lin("block_inject_weight") if injects else None, n, hidden, eps))


ROLES = ("attn_hc", "mlp_hc", "attn", "mlp", "ple")
PREFIXES = {"attn_hc": "attn_hyper_connection.", "mlp_hc": "mlp_hyper_connection.", "attn": "", "mlp": "",
            "ple": "ple."}


@dataclass
class StreamLayer:
    """One decoder layer at ``model.layers.<index>.``; ``ple`` None on layers without PLE."""

    index: int
    attn_hc: Part
    mlp_hc: Part
    attn: Part
    mlp: Part
    ple: Part | None = None

    @property
    def prefix(self) -> str:
        return f"model.layers.{self.index}."

    def parts(self) -> list[tuple[str, Part]]:
        return [(PREFIXES[r], getattr(self, r)) for r in ROLES if getattr(self, r) is not None]


@dataclass
class StreamModel(Model):
    """``declare.Model`` for the gated streams: ``streams`` (n), the final ``mixer`` part (at
    ``model.hyper_connection_mixer.``), ``tables``: the PLE row tables, name -> (rows, dim)."""

    streams: int = 2
    mixer: Part | None = None
    tables: dict[str, tuple[int, int]] = field(default_factory=dict)

    def spine(self) -> dict[str, Shape]:
        spine: dict[str, Shape] = {"model.embed_tokens.weight": (self.vocab, self.hidden)}
        spine.update(self._expand("model.hyper_connection_mixer.", self.mixer.tensors))
        if not self.tied:
            spine["lm_head.weight"] = (self.vocab, self.hidden)
        for layer in self.layers:
            for sub, part in layer.parts():
                spine.update(self._expand(layer.prefix + sub, part.tensors))
        return spine

    def _all_parts(self) -> list[Part]:
        return [part for layer in self.layers for _, part in layer.parts()]

    def build(self, w, experts) -> StreamCausalLM:
        layers = []
        for layer in self.layers:
            made = {role: self._make(w, layer.prefix + PREFIXES[role], getattr(layer, role), experts, layer.index)
                    if getattr(layer, role) is not None else None for role in ROLES}
            layers.append(StreamDecoderLayer(**made))
        emb = w("model.embed_tokens.weight")
        head = emb if self.tied else w("lm_head.weight")
        mixer = self._make(w, "model.hyper_connection_mixer.", self.mixer, experts, None)
        return StreamCausalLM(emb, layers, mixer, head, self.rotary(), self.streams)


class StreamDecoderLayer:
    def __init__(self, attn_hc: GatedResidual, mlp_hc: GatedResidual, attn, mlp, ple=None):
        self.attn_hc, self.mlp_hc, self.attn, self.mlp, self.ple = attn_hc, mlp_hc, attn, mlp, ple


class PairState:
    """A PLE layer's state for one sequence: its attention's (``attn``) and its PLE's (``ple``),
    both ``LinearState``s marked, rewound and restored together."""

    def __init__(self, attn, ple):
        self.attn, self.ple = attn, ple

    def restorable(self, n: int) -> int:
        return min(self.attn.restorable(n), self.ple.restorable(n))

    def rewind(self, n: int) -> None:
        self.attn.rewind(n)
        self.ple.rewind(n)

    def mark(self, n: int) -> None:
        self.attn.mark(n)
        self.ple.mark(n)

    def save(self):
        return self.attn.save(), self.ple.save()

    def restore(self, saved) -> None:
        self.attn.restore(saved[0])
        self.ple.restore(saved[1])


class StreamCausalLM(CausalLM):
    """Embedding -> n streams -> layers (PLE, gated residuals) -> mixer -> head (module docstring)."""

    def __init__(self, embed_w: torch.Tensor, layers: list[StreamDecoderLayer], mixer: GatedResidual,
                 lm_head: torch.Tensor, rotary, streams: int):
        super().__init__(embed_w, layers, None, lm_head, rotary)
        self.mixer, self.streams = mixer, streams
        self.rows = None  # the RowStore of the PLE tables (attach_rows)
        # issue the step's row reads at its start (True), or read each layer's rows when it runs
        # (False: benchmarks/rows_decode.py compares the two)
        self.early_rows = True
        # with early_rows, also issue the step's next prefill chunk's rows while this one runs
        # (False: benchmarks/rows_decode.py --prefill compares the two)
        self.ahead_rows = True

    def attach_rows(self, rows) -> None:
        self.rows = rows

    @property
    def row_tables(self) -> list[str]:
        return [layer.ple.table for layer in self.layers if layer.ple is not None]

    def new_state(self, max_ctx: int) -> State:
        states = []
        for layer in self.layers:
            s = layer.attn.new_cache(max_ctx)
            states.append(PairState(s, layer.ple.new_state()) if layer.ple is not None else s)
        return State(states, max_ctx)

    def predict_weights(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``CausalLM.predict_weights`` on streams h [T, n * H]: the target layer's ``mlp_hc``
        collapse and router."""
        if not self.is_moe(layer):
            return None
        target = self.layers[layer]
        if not isinstance(target.mlp.router, Router):
            raise TypeError(f"layer {layer}'s router is a {type(target.mlp.router).__name__}, not a Router")
        x = target.mlp_hc.collapse(h)
        logits = target.mlp.router.logits(x)
        ids, _ = target.mlp.route(x, logits)
        return ids, torch.softmax(logits, dim=-1).gather(1, ids)

    def row_ids(self, ctx: ForwardContext) -> dict[int, torch.Tensor]:
        """Per PLE layer, the table rows [T, heads] of the step's tokens (each segment after its
        sequence's n-gram context): known before any layer runs."""
        out = {}
        tokens = ctx.token_ids.tolist()
        for i, layer in enumerate(self.layers):
            if layer.ple is None:
                continue
            parts = [layer.ple.hasher.row_ids(layer.ple.context(s.state.layers[i].ple), tokens[s.first:s.end])
                     for s in ctx.segments]
            out[i] = parts[0] if len(parts) == 1 else torch.cat(parts)
        return out

    def next_row_ids(self, ctx: ForwardContext) -> dict[int, torch.Tensor]:
        """Per PLE layer, the rows of the step's next forward (``ctx.next_tokens``: per segment the
        tokens its sequence runs next, the next prefill chunk): each after its sequence's n-gram
        context as it will be once this forward has run (the context, then this segment's tokens)."""
        out = {}
        tokens = ctx.token_ids.tolist()
        keep = [(s, nxt) for s, nxt in zip(ctx.segments, ctx.next_tokens) if nxt]
        if not keep:
            return out
        for i, layer in enumerate(self.layers):
            if layer.ple is None:
                continue
            back, ple = layer.ple.hasher.ngram - 1, layer.ple
            parts = [ple.hasher.row_ids((ple.context(s.state.layers[i].ple) + tokens[s.first:s.end])[-back:], nxt)
                     for s, nxt in keep]
            out[i] = parts[0] if len(parts) == 1 else torch.cat(parts)
        return out

    def issue_rows(self, ids: dict[int, torch.Tensor], ahead: bool = False) -> None:
        """Start the step's row reads (the one place an early-ids read mechanism plugs into);
        ``ahead``: the step's next forward's, behind every demand read."""
        for i, rows in ids.items():
            self.rows.issue(self.layers[i].ple.table, rows, ahead=ahead)

    def forward(self, ctx: ForwardContext) -> torch.Tensor:
        h = expand(embed(self.embed, ctx.token_ids), self.streams)  # [T, n * H]
        cos, sin = self.rotary.cos_sin(ctx.positions()) if self.rotary is not None else (None, None)
        ids = self.row_ids(ctx)
        if ids:
            if self.rows is None:
                raise RuntimeError("the PLE row tables are not attached (StreamCausalLM.attach_rows)")
            if self.early_rows:
                self.rows.begin()
                self.issue_rows(ids)
                if ctx.next_tokens and self.ahead_rows:  # the next prefill chunk's, while this one computes
                    self.issue_rows(self.next_row_ids(ctx), ahead=True)
        spine, lookahead = self.spine, ctx.lookahead
        if spine is not None:
            spine.start()
        for i, layer in enumerate(self.layers):
            if spine is not None:
                spine.acquire(i)
            segs = ctx.layer_segments(i)
            if layer.ple is not None:
                rows = self.rows.gather(layer.ple.table, ids[i])
                h = h + layer.ple(h, rows.reshape(rows.shape[0], -1), [(a, b, p, s.ple) for a, b, p, s in segs],
                                  ctx.token_ids)
                segs = [(a, b, p, s.attn) for a, b, p, s in segs]
            x, w = layer.attn_hc(h)
            h = inject(h, layer.attn.segments(x, segs, cos, sin), w)
            if lookahead is not None:
                lookahead.after_attention(i, h, ctx)
            x, w = layer.mlp_hc(h)
            h = inject(h, layer.mlp(x, ctx) if isinstance(layer.mlp, MoEBlock) else layer.mlp(x), w)
            if spine is not None:
                spine.release(i)
        return self.mixer.collapse(h)


__all__ = ["PairState", "StreamCausalLM", "StreamDecoderLayer", "StreamLayer", "StreamModel", "gated_residual"]
