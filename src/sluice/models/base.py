"""The decoder skeleton shared by every family, and what a family must describe.

A family module (``models/<model_type>.py``, found by its ``MODEL_TYPE``) provides:

- ``parse_config(raw: dict) -> cfg``: typed config, unknown keys ignored, unsupported
  options refused with ``UnsupportedModelError``;
- ``declare(cfg) -> models.declare.Model``: the layer kinds of ``models/parts.py`` composed
  once (each says its tensors, how it is built, its state); ``describe`` and ``build`` derive
  from it;
- ``describe(cfg) -> ModelDescription``: every spine tensor with its shape, the MoE layers,
  routing width and the checkpoint names of each expert's matrices;
- ``build(cfg, weights, experts) -> CausalLM``: wires shared layers from ``layers/`` and
  routes MoE layers through the expert interface (it never reads files). Every MoE layer is
  a ``MoEBlock`` over a ``layers.routing.Router`` (families keep no routing code of their
  own), and nothing is derived at build time from a tensor of two or more dimensions
  (it may be a stream buffer's view, filled only before its forward: see ``spine.py``).
  ``MoEBlock(x, ctx)`` takes the step's ``layers.context.ForwardContext`` (token ids,
  positions, segments) and hands it to ``experts.moe``. Attention layers take the rows of
  several sequences at once:
  ``attn.segments(x, [(first row, end row, start, layer state), ...], cos, sin)`` (every
  attention class of ``layers/`` has it; ``attn(x, start, state, cos, sin)`` is one segment);
- optionally ``tensor_aliases(cfg) -> {name: other name}``: spine tensors that some
  checkpoints store under another name (looked up there when ``name`` is absent).

Shape legend: T tokens, H hidden, V vocabulary, E experts, K experts per token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..errors import CheckpointError
from ..experts.spec import ExpertSpec, ExpertTensors
from ..layers.context import ForwardContext
from ..layers.norm import RMSNorm
from ..layers.pointwise import pointwise
from ..layers.rotary import LayerRotary, Rotary
from ..layers.routing import Router
from ..quant import embed, linear



@dataclass
class ModelDescription:
    model_type: str
    n_layers: int
    hidden: int
    vocab: int
    spine: dict[str, tuple[int, ...]]
    moe_layers: list[int]
    n_experts: int
    top_k: int
    expert: ExpertSpec
    expert_tensors: Callable[[int, int], ExpertTensors]
    state_bytes_per_token: int  # KV cache bytes per position, all layers (fp32)
    state_bytes_fixed: int = 0  # recurrent state bytes, independent of length
    # sliding-window layers (``WindowKVCache``): bytes per position, all such layers, and the
    # positions each keeps at most (fewer when max_context is shorter)
    window_bytes_per_token: int = 0
    window_positions: int = 0
    # compressed caches (DeepSeek-V4's CSA / HCA entries): one entry per m positions, so m -> the
    # bytes of one entry, all such layers (a context of n positions holds n // m entries)
    entry_bytes: dict[int, int] = field(default_factory=dict)
    # bounded buffers of the last positions (DeepSeek-V4's windows and compressor rings), by size:
    # positions kept at most -> bytes per position, all such buffers
    rings: dict[int, int] = field(default_factory=dict)
    max_position_embeddings: int = 4096
    attn_heads: int = 0
    eos_token_ids: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # a quant format (``sluice.quant.FORMATS``) the checkpoint stores routed experts in natively,
    # as parts named "<role>.<part>" in ``expert_tensors``; None: plain f32/bf16/f16 tensors
    expert_format: str | None = None
    # integer lookup tables among the spine tensors (hash routing's ``tid2eid``): read by token id,
    # possibly before their layer runs, so always resident (never streamed nor quantized), stored
    # as integers (I64 / I32)
    tables: list[str] = field(default_factory=list)
    # the spine matrices multiplied whole through ``quant.linear`` (what ``--spine int8`` may
    # quantize), when the family lists them; None: ``quantized_spine.quantizable``'s naming rule
    spine_linears: list[str] | None = None
    # tables read by row index (``rows/``: Qwen4-Exp's PLE n-gram tables), not spine tensors: name -> (rows, dim)
    row_tables: dict[str, tuple[int, int]] = field(default_factory=dict)

    def state_bytes(self, max_ctx: int) -> int:
        """KV caches and recurrent states of one sequence of up to ``max_ctx`` positions."""
        return (self.state_bytes_per_token * max_ctx + self.state_bytes_fixed
                + self.window_bytes_per_token * min(max_ctx, self.window_positions)
                + sum(b * (max_ctx // m) for m, b in self.entry_bytes.items())
                + sum(b * min(max_ctx, n) for n, b in self.rings.items()))

    @property
    def working_set(self) -> int:
        """Experts one token touches: K per MoE layer."""
        return self.top_k * len(self.moe_layers)

    @property
    def total_experts(self) -> int:
        return self.n_experts * len(self.moe_layers)


def check_tensor(name: str, info, expected: tuple[int, ...]) -> None:
    if tuple(info.shape) != tuple(expected):
        raise CheckpointError(
            f"{info.file}: tensor {name!r} has shape {list(info.shape)} but config.json implies "
            f"{list(expected)} (config and weights disagree)"
        )


class State:
    """Per-sequence state: one entry per layer (KV cache or recurrent state) and the tokens.

    A KV cache can be cut back to any length for free. A layer that cannot return to every
    position implements ``restorable(n) -> int`` (the largest restorable position <= n) and
    ``rewind(n)``: a recurrent state (linear attention) returns only to positions it kept a
    snapshot of with ``mark(n)`` (keep a snapshot of the current state, which is position n;
    snapshots are references to immutable tensors, since a forward builds new state tensors
    and never updates them in place, so marking costs nothing); a sliding-window cache
    (``WindowKVCache``) only to positions whose window it still holds, else to 0.
    """

    def __init__(self, layers: list, max_ctx: int):
        self.layers = layers
        self.max_ctx = max_ctx
        self.length = 0
        self.tokens: list[int] = []

    @property
    def recurrent(self) -> bool:
        """True if some layer keeps recurrent state (rollback needs a snapshot)."""
        return any(hasattr(s, "mark") for s in self.layers)

    def rewind(self, n: int) -> int:
        """Roll back to the first ``n`` positions, or fewer if a layer cannot; returns the length."""
        n = max(0, min(n, self.length))
        recurrent = [s for s in self.layers if hasattr(s, "rewind")]
        while True:
            m = min([n] + [s.restorable(n) for s in recurrent])
            if m == n:
                break
            n = m
        for s in recurrent:
            s.rewind(n)
        self.length = n
        del self.tokens[n:]
        return n

    def save(self):
        """Where the state is now, for ``restore`` (free: references to immutable tensors; a KV
        cache needs nothing, positions past the length are never read)."""
        return self.length, [s.save() if hasattr(s, "save") else None for s in self.layers]

    def restore(self, saved) -> None:
        """Return to what ``save`` returned, whatever forwards ran since (a failed step's undo), or
        as far back as a layer can: a sliding-window cache that has dropped the window of the
        saved length rewinds the state to 0 (``rewind``), and the caller prefills again."""
        length, layers = saved
        for s, v in zip(self.layers, layers):
            if v is not None:
                s.restore(v)
        self.length = max(self.length, length)
        self.rewind(length)

    def mark(self) -> None:
        """Let every recurrent layer keep a snapshot at the current length."""
        for s in self.layers:
            if hasattr(s, "mark"):
                s.mark(self.length)


class DecoderLayer:
    """Pre-norm residual block: ``h += attn(norm1(h)); h += mlp(norm2(h))`` (see CausalLM)."""

    def __init__(self, input_norm: RMSNorm, attn, post_norm: RMSNorm, mlp):
        self.input_norm, self.attn, self.post_norm, self.mlp = input_norm, attn, post_norm, mlp


class MoEBlock:
    """Routes tokens and hands them to the expert interface; adds shared experts if any.

    ``router`` is a ``layers.routing.Router`` (nothing else is accepted):
    ``router(x, bias=None) -> (ids [T, K], weights [T, K])`` returns experts in descending
    selection-score order and adds ``bias`` [E] (if given) to the scores used for
    *selection* only. Two opt-in lossy switches act here: ``top_k`` keeps only the first
    (best) experts (weights rescaled to the original total) and ``prefer_cached`` biases
    selection toward experts already in memory.
    """

    def __init__(self, layer: int, router: Router, experts, shared=None, shared_gate: torch.Tensor | None = None):
        if not isinstance(router, Router):
            raise TypeError(f"MoEBlock needs a sluice.layers.routing.Router, got {type(router).__name__}")
        self.layer, self.router, self.experts = layer, router, experts
        self.shared, self.shared_gate = shared, shared_gate
        self.top_k: int | None = None  # lossy: fewer experts than trained
        self.prefer_cached = 0.0  # lossy: selection bias toward resident experts

    def route(self, x: torch.Tensor, logits: torch.Tensor | None = None,
              token_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, weights) for ``x``; ``logits``: the router's logits for ``x`` if already computed
        (``router(x)`` is ``router.select(router.logits(x))``, so the result is the same);
        ``token_ids`` [T]: the rows' tokens, which a keyed router (hash routing) selects by."""
        if logits is None:
            logits = self.router.logits(x)
        if getattr(self.router, "keyed", False):  # the token ids choose; no cache bias can change that
            ids, weights = self.router.select(logits, token_ids=token_ids)
        elif self.prefer_cached:
            ids, weights = self.router.select(logits, self.experts.resident_mask(self.layer) * self.prefer_cached)
        else:
            ids, weights = self.router.select(logits)
        if self.top_k is not None and self.top_k < ids.shape[1]:
            total = weights.sum(-1, keepdim=True)
            ids, kept = ids[:, : self.top_k], weights[:, : self.top_k]
            weights = kept * (total / kept.sum(-1, keepdim=True))
        return ids, weights

    def __call__(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        logits = self.router.logits(x)
        ids, weights = self.route(x, logits, ctx.token_ids)
        # the logits: the cache policy's and the trace's view of the experts just below the top-k
        y = self.experts.moe(self.layer, x, ids, weights, ctx, logits=logits)
        if self.shared is not None:
            s = self.shared(x)
            if self.shared_gate is not None:
                s = pointwise(torch.sigmoid, linear(x, self.shared_gate)) * s
            y = y + s
        return y


class CausalLM:
    """Embedding -> decoder layers -> final norm -> head."""

    def __init__(self, embed: torch.Tensor, layers: list[DecoderLayer], norm: RMSNorm, lm_head: torch.Tensor,
                 rotary: Rotary | LayerRotary | None, lm_head_bias: torch.Tensor | None = None):
        self.embed, self.layers, self.norm, self.lm_head, self.rotary = embed, layers, norm, lm_head, rotary
        self.lm_head_bias = lm_head_bias.float() if lm_head_bias is not None else None  # [V], resident
        self.spine = None  # optional SpineStreamer for layers whose matrices are streamed

    def is_moe(self, layer: int) -> bool:
        """Layer ``layer`` exists and routes its MLP through the experts."""
        return 0 <= layer < len(self.layers) and isinstance(self.layers[layer].mlp, MoEBlock)

    def certain_experts(self, token_ids: torch.Tensor) -> dict[int, torch.Tensor]:
        """Per hash-routed MoE layer (a keyed router: ``HashRouter``), the experts [T, K] of tokens
        ``token_ids`` [T]: decided by the token ids alone, so known before any layer runs (the
        runner reads them early, ``ExpertInterface.read_certain``). Empty for a family without
        such layers (found once), and for a layer whose experts the lossy ``moe_top_k`` cuts (its
        experts then depend on the weights)."""
        keyed = self.__dict__.get("_keyed_layers")
        if keyed is None:
            keyed = self._keyed_layers = [i for i, layer in enumerate(self.layers) if isinstance(layer.mlp, MoEBlock)
                                          and getattr(layer.mlp.router, "keyed", False)]
        out = {}
        for i in keyed:
            block = self.layers[i].mlp
            if block.top_k is None or block.top_k >= block.router.top_k:
                out[i] = block.router.experts_for(token_ids)
        return out

    def predict(self, layer: int, h: torch.Tensor) -> torch.Tensor | None:
        """Router lookahead: the experts layer ``layer`` would pick for residual stream ``h``.

        Applies that layer's own post-attention norm and router to a stream that has not yet
        been through it (it is an early guess, used only to start reads). None for dense layers.
        """
        got = self.predict_weights(layer, h)
        return None if got is None else got[0]

    def predict_weights(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``predict`` with a confidence: (ids [T, K], p [T, K]), ``p`` the softmax of the
        router's logits over all experts at ``ids`` (whatever the routing rule; it only ranks
        guesses). None for dense layers and past the last layer."""
        if not self.is_moe(layer):
            return None
        target = self.layers[layer]
        if not isinstance(target.mlp.router, Router):
            raise TypeError(f"layer {layer}'s router is a {type(target.mlp.router).__name__}, not a Router")
        x = target.post_norm(h)
        logits = target.mlp.router.logits(x)
        ids, _ = target.mlp.route(x, logits)
        probs = torch.softmax(logits, dim=-1).gather(1, ids)
        return ids, probs

    def new_state(self, max_ctx: int) -> State:
        """One sequence's state; a layer state with ``link(states)`` is then given the whole list (one
        that reads an earlier layer's state of the same sequence: GLM-5's shared DSA selection)."""
        states = [layer.attn.new_cache(max_ctx) for layer in self.layers]
        for s in states:
            if hasattr(s, "link"):
                s.link(states)
        return State(states, max_ctx)

    def forward(self, ctx: ForwardContext) -> torch.Tensor:
        """Run one forward of the step ``ctx`` (one or several sequences' rows); final hidden [T, H],
        rows in order. Writes each segment's per-layer state for its positions; the caller
        advances ``state.length``.

        Everything that is per row runs on all rows at once: projections, norms, routers,
        experts (each routed expert read and computed once for every row of the step that needs
        it), dense and shared MLPs, rotary at each row's own position. Attention proper runs per
        sequence on its own KV cache or recurrent state (``attn.segments(x, [(first row, end
        row, start, layer state), ...], cos, sin)``). With batch-invariant kernels a segment's
        rows are bit-identical to its solo forward. After each layer's attention the step's
        lookahead (``ctx.lookahead``, the expert side's) may start reads for later layers.
        """
        h = embed(self.embed, ctx.token_ids)
        if isinstance(self.rotary, LayerRotary):  # a RoPE per layer kind
            rope = self.rotary.cos_sin_layers(ctx.positions())
        else:
            rope = [self.rotary.cos_sin(ctx.positions()) if self.rotary is not None else (None, None)] \
                * len(self.layers)
        spine, lookahead = self.spine, ctx.lookahead
        if spine is not None:
            spine.start()
        # h += attn(input_norm(h)); h += mlp(post_norm(h)): each residual add runs in one call with
        # the norm that follows it (``RMSNorm.add``: the same sum, rounded once, as ``h + y``)
        y = None  # the previous layer's MLP output, not yet added to h
        for i, layer in enumerate(self.layers):
            if spine is not None:
                spine.acquire(i)
            h, x = layer.input_norm.add(h, y) if y is not None else (h, layer.input_norm(h))
            cos, sin = rope[i]
            h, x = layer.post_norm.add(h, layer.attn.segments(x, ctx.layer_segments(i), cos, sin))
            if lookahead is not None:
                lookahead.after_attention(i, h, ctx)
            y = layer.mlp(x, ctx) if isinstance(layer.mlp, MoEBlock) else layer.mlp(x)
            if spine is not None:
                spine.release(i)
        return self.norm.add(h, y)[1] if y is not None else self.norm(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return linear(h, self.lm_head, self.lm_head_bias)
