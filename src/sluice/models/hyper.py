"""The multi-stream residual skeleton (manifold-constrained hyper-connections) and its declaration.

A family with hyper-connections (DeepSeek-V4; GLM-5-style models later) declares a
``HyperModel``: the embedding, head and final norm, a ``HyperHead`` part, and per layer six
parts (two norms, two ``hyper_connection`` parts, attention, MLP), each at a prefix the family
names, so published tensor names are declared as they are. ``describe`` and ``build`` derive
from it as ``declare.Model``'s do.

``HyperCausalLM.forward``: the residual is [T, n, H]; per layer
``post, comb, x = attn_hc(h); h = mix(h, post, comb, attn(input_norm(x)))`` then the same with
``ffn_hc``, ``post_norm`` and the MLP; at the end ``norm(head(h))``. The router lookahead
predicts a later layer's experts from the streams it is handed by applying that layer's own
``ffn_hc`` collapse, post-attention norm and router: the stream the target layer's MoE block
would see (its tensors belong to the target layer, whose stream buffer the lookahead waits for).

Shape legend: T rows, n streams, H hidden, V vocabulary, K experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..layers.context import ForwardContext
from ..layers.hyper import HyperConnection, HyperHead, MeanHead, expand, mix
from ..layers.rotary import LayerRotary
from ..quant import embed
from .base import CausalLM, MoEBlock, ModelDescription
from .declare import Lin, Model, Part, Shape


def hyper_connection(n: int, hidden: int, *, iters: int, eps: float, norm_eps: float) -> Part:
    """A ``layers.hyper.HyperConnection``: ``fn`` [(2 + n) * n, n * H], ``base``, ``scale`` [3]
    (nest it at the family's prefix: ``hc_attn_`` in DeepSeek-V4's checkpoints)."""
    k = (2 + n) * n
    return Part({"fn": (k, n * hidden), "base": (k,), "scale": (3,)},
                lambda t: HyperConnection(t("fn"), t("base"), t("scale"), n, iters, eps, norm_eps))


def hyper_head(n: int, hidden: int, *, eps: float, norm_eps: float) -> Part:
    """A ``layers.hyper.HyperHead``: ``fn`` [n, n * H], ``base`` [n], ``scale`` [1]."""
    return Part({"fn": (n, n * hidden), "base": (n,), "scale": (1,)},
                lambda t: HyperHead(t("fn"), t("base"), t("scale"), n, eps, norm_eps))


def mean_head(n: int) -> Part:
    """A ``layers.hyper.MeanHead`` (GLM-5.3-Flash): the streams' mean, no tensors."""
    return Part({}, lambda t: MeanHead(n))


ROLES = ("input_norm", "post_norm", "attn_hc", "ffn_hc", "attn", "mlp")


@dataclass
class HyperLayer:
    """One decoder layer at ``prefix``: its six parts, each at ``prefix + names[role]``."""

    index: int
    prefix: str
    input_norm: Part
    post_norm: Part
    attn_hc: Part
    ffn_hc: Part
    attn: Part
    mlp: Part
    names: dict[str, str] = field(default_factory=dict)  # role -> prefix under the layer ("" by default)

    def parts(self) -> list[tuple[str, Part]]:
        return [(self.names.get(role, ""), getattr(self, role)) for role in ROLES]


@dataclass
class HyperModel(Model):
    """A ``declare.Model`` with hyper-connections: ``streams`` (n), the ``head_part`` (the final
    collapse) and names for the global tensors (``embed_name``, ``norm_prefix``, ``head_name``,
    ``hc_head_prefix``); ``layers`` are ``HyperLayer``s; ``tables``: integer lookup tables."""

    streams: int = 4
    head_part: Part | None = None
    embed_name: str = "model.embed_tokens.weight"
    norm_prefix: str = "model.norm."
    head_name: str = "lm_head.weight"
    hc_head_prefix: str = "model.hc_head."
    tables: list[str] = field(default_factory=list)

    def spine(self) -> dict[str, Shape]:
        spine: dict[str, Shape] = {self.embed_name: (self.vocab, self.hidden)}
        spine.update(self._expand(self.norm_prefix, self.norm.tensors))
        if not self.tied:
            spine[self.head_name] = (self.vocab, self.hidden)
        spine.update(self._expand(self.hc_head_prefix, self.head_part.tensors))
        for layer in self.layers:
            for sub, part in layer.parts():
                spine.update(self._expand(layer.prefix + sub, part.tensors))
            for sub, part in layer.parts():
                spine.update(self._expand(layer.prefix + sub, part.tail))
        return spine

    def linears(self) -> list[str]:
        """The spine tensors of every part's ``Lin`` declarations, the embedding and the head: the
        matrices the layers multiply whole through ``quant.linear`` (``ModelDescription.spine_linears``;
        not MLA's ``kv_b_proj``, whose heads are used as views)."""
        out = [self.embed_name] + ([] if self.tied else [self.head_name])
        for layer in self.layers:
            for sub, part in layer.parts():
                for name, shape in {**part.tensors, **part.tail}.items():
                    if isinstance(shape, Lin):
                        out.extend(self.weights.tensors(layer.prefix + sub + name, shape.shape))
        return [n for n in out if n.endswith(".weight") and ".kv_b_proj." not in n]  # MLA's: used as head views

    def describe(self, **fields) -> ModelDescription:
        return super().describe(tables=list(self.tables), spine_linears=self.linears(), **fields)

    def build(self, w, experts) -> HyperCausalLM:
        layers = []
        for layer in self.layers:
            made = {role: self._make(w, layer.prefix + sub, part, experts, layer.index)
                    for role, (sub, part) in zip(ROLES, layer.parts())}
            layers.append(HyperDecoderLayer(**made))
        emb = w(self.embed_name)
        head = emb if self.tied else w(self.head_name)
        return HyperCausalLM(emb, layers, self._make(w, self.norm_prefix, self.norm, experts, None), head,
                             self.rotary(), self._make(w, self.hc_head_prefix, self.head_part, experts, None),
                             self.streams)


class HyperDecoderLayer:
    """A decoder layer with hyper-connections around its attention and its MLP."""

    def __init__(self, input_norm, post_norm, attn_hc: HyperConnection, ffn_hc: HyperConnection, attn, mlp):
        self.input_norm, self.post_norm, self.attn_hc, self.ffn_hc = input_norm, post_norm, attn_hc, ffn_hc
        self.attn, self.mlp = attn, mlp


class HyperCausalLM(CausalLM):
    """Embedding -> n streams -> decoder layers with hyper-connections -> ``HyperHead`` -> final
    norm -> head (see the module docstring)."""

    def __init__(self, embed_w: torch.Tensor, layers: list[HyperDecoderLayer], norm, lm_head: torch.Tensor,
                 rotary, head: HyperHead, streams: int):
        super().__init__(embed_w, layers, norm, lm_head, rotary)
        self.head, self.streams = head, streams

    def predict_weights(self, layer: int, h: torch.Tensor, token_ids: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``CausalLM.predict_weights`` on streams h [T, n, H]: the target layer's ``ffn_hc``
        collapse, post-attention norm and router. A hash-routed layer's experts are known from the
        token ids alone (certain: probability 1); without ``token_ids`` it has no guess (None)."""
        if not self.is_moe(layer):
            return None
        target = self.layers[layer]
        router = target.mlp.router
        if getattr(router, "keyed", False):
            if token_ids is None:
                return None
            ids = router.experts_for(token_ids)
            return ids, torch.ones(ids.shape)
        x = target.post_norm(target.ffn_hc.collapse(h))
        logits = router.logits(x)
        ids, _ = target.mlp.route(x, logits)
        return ids, torch.softmax(logits, dim=-1).gather(1, ids)

    def forward(self, ctx: ForwardContext) -> torch.Tensor:
        """``CausalLM.forward`` over n residual streams: the final hidden [T, H] (after the head's
        collapse and the final norm), rows in order."""
        h = expand(embed(self.embed, ctx.token_ids), self.streams)  # [T, n, H]
        positions = ctx.positions()
        if isinstance(self.rotary, LayerRotary):
            rope = self.rotary.cos_sin_layers(positions)
        elif self.rotary is None:  # no positional encoding (GLM-5.3-Flash)
            rope = [(None, None)] * len(self.layers)
        else:
            rope = [self.rotary.cos_sin(positions)] * len(self.layers)
        spine, lookahead = self.spine, ctx.lookahead
        if spine is not None:
            spine.start()
        for i, layer in enumerate(self.layers):
            if spine is not None:
                spine.acquire(i)
            cos, sin = rope[i]
            post, comb, x = layer.attn_hc(h)
            h = mix(h, post, comb, layer.attn.segments(layer.input_norm(x), ctx.layer_segments(i), cos, sin))
            if lookahead is not None:
                lookahead.after_attention(i, h, ctx)
            post, comb, x = layer.ffn_hc(h)
            x = layer.post_norm(x)
            h = mix(h, post, comb, layer.mlp(x, ctx) if isinstance(layer.mlp, MoEBlock) else layer.mlp(x))
            if spine is not None:
                spine.release(i)
        return self.norm(self.head(h))


__all__ = ["HyperCausalLM", "HyperDecoderLayer", "HyperLayer", "HyperModel", "hyper_connection", "hyper_head",
           "mean_head"]
