"""A family declares its model once; ``describe()`` and ``build()`` both derive from it.

A ``Part`` is one layer kind at a prefix (see ``models/parts.py`` for every kind): the tensors it
needs, named relative to that prefix with shapes from the config, how to build the layer from
them, and the state it keeps per sequence (KV bytes per position, sliding-window bytes, fixed
recurrent bytes). A ``Layer`` is one decoder layer (two norms, attention, MLP or MoE block) at
``model.layers.<i>.``; a ``Model`` is the embedding, the layers, the final norm and the head.

From the one declaration:

- ``Model.spine()``: every spine tensor with its shape, in checkpoint order (global tensors,
  then per layer: norms, attention, MLP, then any ``Part.tail``), the ``ModelDescription.spine``
  that the planner, the container, ``spine.streamable`` and the tests read;
- ``Model.state()``: the ``ModelDescription`` state fields (sums over the layers' parts);
- ``Model.describe(**fields)``: a ``ModelDescription`` with both (and the MoE layers) filled in;
- ``Model.build(w, experts)``: the ``CausalLM``, each part built from exactly the tensors it
  declared (``Tensors``, the getter a part builds from, refuses any other name).

A linear weight is declared as ``Lin(shape)`` under its module name (``"q_proj"``, not
``"q_proj.weight"``): the family's ``weights`` (``weight_format.WeightFormat``, from config.json's
``quantization_config``) says which tensors store it (``<module>.weight``, plus its FP8 scales)
and builds it; the routed experts' tensors come from the same ``weights``
(``Model.routed_experts``), and ``describe`` adds its notes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..experts.spec import ExpertSpec
from .base import CausalLM, DecoderLayer, ModelDescription
from .weight_format import PLAIN, WeightFormat

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Lin:
    """A linear module's weight [out, in] (``<module>.weight``, plus its scales in a ``weight_format``)."""

    shape: Shape


class Tensors:
    """The getter a part builds from: ``t(name)`` is the tensor ``prefix + name``; ``t.opt(name)``
    None if the part did not declare it; ``t.lin(module)`` the built linear; ``t.sub(p)`` the getter
    of a nested part; ``t.experts`` and ``t.layer`` for an MoE block."""

    def __init__(self, model: Model, w, prefix: str, declared: dict, experts, layer: int | None):
        self._model, self._w, self.prefix, self._declared = model, w, prefix, declared
        self.experts, self.layer = experts, layer

    def __call__(self, name: str):
        if name not in self._declared:
            raise KeyError(f"{self.prefix}{name} is not declared by this part")
        return self._w(self.prefix + name)

    def opt(self, name: str):
        return self(name) if name in self._declared else None

    def lin(self, module: str):
        if not isinstance(self._declared.get(module), Lin):
            raise KeyError(f"{self.prefix}{module} is not declared as a linear by this part")
        return self._model.weights.linear(self._w, self.prefix + module)

    def sub(self, prefix: str) -> Tensors:
        declared = {k[len(prefix):]: v for k, v in self._declared.items() if k.startswith(prefix)}
        return Tensors(self._model, self._w, self.prefix + prefix, declared, self.experts, self.layer)


@dataclass
class Part:
    """One layer kind: ``tensors`` (relative name -> shape or ``Lin``), ``make(Tensors) -> layer``,
    and the state it keeps for one sequence (fp32 bytes)."""

    tensors: dict[str, Shape | Lin]
    make: Callable[[Tensors], Any]
    kv_per_token: int = 0  # a KV or latent cache: bytes per position
    window_per_token: int = 0  # a sliding-window cache: bytes per position it keeps
    window_positions: int = 0  # ... and the positions it keeps at most
    fixed: int = 0  # a recurrent state and its snapshots: bytes, whatever the length
    transient: int = 0  # what one forward of this kind builds besides (the model needs the largest once)
    tail: dict[str, Shape | Lin] = field(default_factory=dict)  # listed after the layer's other parts
    routed: bool = False  # an MoE block (its layer is one of ``ModelDescription.moe_layers``)
    entries: dict[int, int] = field(default_factory=dict)  # compressed caches: m -> bytes per entry (m positions)
    rings: dict[int, int] = field(default_factory=dict)  # bounded buffers: positions kept -> bytes per position

    def nested(self, prefix: str) -> Part:
        """This part under ``prefix`` inside another part (built with ``t.sub(prefix)``)."""
        make = self.make
        return Part({prefix + k: v for k, v in self.tensors.items()}, lambda t: make(t.sub(prefix)),
                    self.kv_per_token, self.window_per_token, self.window_positions, self.fixed, self.transient,
                    {prefix + k: v for k, v in self.tail.items()}, self.routed, dict(self.entries),
                    dict(self.rings))


@dataclass
class Layer:
    """One decoder layer at ``model.layers.<index>.``: ``h += attn(input_norm(h)); h += mlp(post_norm(h))``
    (norm tensors ``input_layernorm.weight`` / ``post_attention_layernorm.weight``)."""

    index: int
    input_norm: Part
    post_norm: Part
    attn: Part
    mlp: Part

    @property
    def prefix(self) -> str:
        return f"model.layers.{self.index}."

    def parts(self) -> list[tuple[str, Part]]:
        return [("input_layernorm.", self.input_norm), ("post_attention_layernorm.", self.post_norm),
                ("", self.attn), ("", self.mlp)]


@dataclass
class Model:
    vocab: int
    hidden: int
    layers: list[Layer]
    norm: Part  # at ``model.norm.``
    tied: bool  # the head is the embedding (no ``lm_head.weight``)
    rotary: Callable[[], Any] = lambda: None  # the model's Rotary, built once (None: no RoPE)
    weights: WeightFormat = PLAIN  # how the checkpoint stores its linears and routed experts
    head_bias: bool = False  # the head has a bias ``lm_head.bias`` [V] (ERNIE-4.5's ``use_bias``), tied or not
    prefix: str = ""  # of every tensor name in the checkpoint (a multimodal wrapper's "language_model.")

    def _expand(self, prefix: str, tensors: dict) -> dict[str, Shape]:
        out: dict[str, Shape] = {}
        for name, shape in tensors.items():
            out.update(self.weights.tensors(prefix + name, shape.shape) if isinstance(shape, Lin)
                       else {prefix + name: tuple(shape)})
        return out

    def spine(self) -> dict[str, Shape]:
        spine: dict[str, Shape] = {"model.embed_tokens.weight": (self.vocab, self.hidden)}
        spine.update(self._expand("model.norm.", self.norm.tensors))
        if not self.tied:
            spine["lm_head.weight"] = (self.vocab, self.hidden)
        if self.head_bias:
            spine["lm_head.bias"] = (self.vocab,)
        for layer in self.layers:
            for sub, part in layer.parts():
                spine.update(self._expand(layer.prefix + sub, part.tensors))
            for sub, part in layer.parts():
                spine.update(self._expand(layer.prefix + sub, part.tail))
        return {self.prefix + name: shape for name, shape in spine.items()} if self.prefix else spine

    def _all_parts(self) -> list[Part]:
        return [part for layer in self.layers for _, part in layer.parts()]

    def state(self) -> dict[str, int]:
        """The ``ModelDescription`` state fields of one sequence."""
        parts = self._all_parts()
        fixed = sum(p.fixed for p in parts)
        fixed += max((p.transient for p in parts), default=0)
        entries: dict[int, int] = {}
        rings: dict[int, int] = {}
        for p in parts:
            for m, b in p.entries.items():
                entries[m] = entries.get(m, 0) + b
            for n, b in p.rings.items():
                rings[n] = rings.get(n, 0) + b
        return dict(state_bytes_per_token=sum(p.kv_per_token for p in parts), state_bytes_fixed=fixed,
                    window_bytes_per_token=sum(p.window_per_token for p in parts),
                    window_positions=max((p.window_positions for p in parts), default=0), entry_bytes=entries,
                    rings=rings)

    @property
    def moe_layers(self) -> list[int]:
        return [layer.index for layer in self.layers if layer.mlp.routed]

    def routed_experts(self, spec: ExpertSpec, template: str, names: dict[str, str]) -> dict:
        """``describe``'s ``expert``, ``expert_tensors`` and ``expert_format`` for routed experts whose
        matrices are the linear modules ``template.format(layer=, e=, name=names[role])`` (checkpoint
        names, without ``.weight``), stored as ``weights`` says."""
        return self.weights.experts(spec, template, names, self.moe_layers)

    def describe(self, **fields) -> ModelDescription:
        """A ``ModelDescription``: the spine, the state fields and the MoE layers from the declaration,
        the weight format's notes after ``fields["notes"]``, the rest from ``fields``."""
        fields["notes"] = [*fields.get("notes", ()), *self.weights.notes()]
        return ModelDescription(n_layers=len(self.layers), hidden=self.hidden, vocab=self.vocab, spine=self.spine(),
                                moe_layers=self.moe_layers, **self.state(), **fields)

    def _make(self, w, prefix: str, part: Part, experts, layer: int | None):
        declared = {**part.tensors, **part.tail}
        return part.make(Tensors(self, w, prefix, declared, experts, layer))

    def build(self, w, experts) -> CausalLM:
        if self.prefix:
            stored, prefix = w, self.prefix
            w = lambda name: stored(prefix + name)  # noqa: E731
        layers = []
        for layer in self.layers:
            p, i = layer.prefix, layer.index
            layers.append(DecoderLayer(self._make(w, p + "input_layernorm.", layer.input_norm, experts, i),
                                       self._make(w, p, layer.attn, experts, i),
                                       self._make(w, p + "post_attention_layernorm.", layer.post_norm, experts, i),
                                       self._make(w, p, layer.mlp, experts, i)))
        embed = w("model.embed_tokens.weight")
        head = embed if self.tied else w("lm_head.weight")
        return CausalLM(embed, layers, self._make(w, "model.norm.", self.norm, experts, None), head, self.rotary(),
                        lm_head_bias=w("lm_head.bias") if self.head_bias else None)
