"""GLM-5.3-Flash (``model_type: glm5_next``, the multimodal wrapper around ``glm5_next_text``), as
transformers 5.24 computes it (modeling_glm5_next.py, the oracle).

- **Residual**: ``hc_mult`` streams with manifold-constrained hyper-connections around every
  attention and MLP block (``models.hyper``, ``layers.hyper``: DeepSeek-V4's), collapsed at the
  end by the streams' plain mean (``MeanHead``), then the final norm.
- **Attention** per ``layer_types``: ``linear_attention`` is Kimi Delta Attention
  (``layers.gated_delta.KimiDeltaAttention``) with GLM's bounded forget gate
  ``linear_lower_bound * sigmoid(exp(A_log) * (f_b(f_a(x)) + dt_bias))`` (without a bound,
  Kimi's ``-exp(A_log) * softplus(...)``); ``indexed_attention`` is MLA without positional
  encoding (``qk_rope_head_dim`` = 0: the latent cache is ``kv_lora_rank`` floats per position)
  with DeepSeek sparse attention (``layers.dsa``) whose indexer scores pools of ``index_kpool``
  positions (``layers.indexer.PooledIndexer``: it keeps ``index_topk / index_kpool`` pools and
  the query's own incomplete pool). ``indexer_types`` "shared" layers reuse the previous layer's
  selection (transformers hands it to the next layer only).
- **MLP**: ``mlp_layer_types`` "dense" (a clamped SwiGLU, ``swiglu_limit``) or "sparse": sigmoid
  routing with the selection-only ``e_score_correction_bias`` (group-limited with ``n_group``),
  renormalised, times ``routed_scaling_factor``; routed and shared experts clamped as well.

The published checkpoints are the multimodal wrapper: ``text_config`` holds the text model's
config (a flat config is read as transformers reads it: the top-level keys are the text
model's), its tensors are under ``model.language_model.`` with the original names
(``hc_attn_fn``, ``self_attn.f_a_proj``, ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d``, experts one
by one), ``lm_head.weight`` at the top; the vision tower (``model.visual.*``) and the MTP layer are
never read.

FP8 (block and compressed-tensors) and INT4-expert checkpoints are read as every family reads
them (``models/weight_format.py``), the wrapper's top-level ``quantization_config`` applying to
the text model, its module names matched as the checkpoint writes them (the declaration's names
are the checkpoint's): every linear transformers' FP8 integration converts is declared one
(``Lin``): attention, KDA's projections (``f_a_proj`` / ``f_b_proj``, ``g_a_proj`` / ``g_b_proj``,
``b_proj`` too), the dense and shared MLPs, and the DSA indexer's ``wq_b``, ``wk`` and
``weights_proj`` (GLM-5.3-Flash keeps no module in fp32, unlike GLM-5, whose ``weights_proj``
transformers keeps unquantized); the hyper-connections' ``fn`` / ``base`` / ``scale``, the router,
the correction bias, the indexer's pool gate and position bias, the convolutions, ``A_log`` /
``dt_bias``, norms, the embedding and the head are parameters, not linears, and stay as stored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ConfigError, UnsupportedModelError
from ..experts.spec import ExpertSpec
from ..layers.gated_delta import SNAPSHOTS
from ..units import format_size
from .base import ModelDescription
from .config import MAX_EXPERTS, MAX_HEAD_DIM, MAX_HEADS, MAX_POSITIONS, RawConfig, number
from .hyper import HyperCausalLM, HyperLayer, HyperModel, hyper_connection, mean_head
from .parts import dsa_mla, gated_mlp, grouped_router, kimi_delta, moe, rms_norm
from .weight_format import PLAIN, WeightFormat, text_quantization

MODEL_TYPE = "glm5_next"
ALIASES = ("glm5_next_text",)  # a text_config on its own (the checkpoint is still the wrapper's)
TEXT_MODEL_TYPE = "glm5_next_text"
PREFIX = "model.language_model."  # the text model's tensors in the checkpoint
LAYER_TYPES = ("linear_attention", "indexed_attention")
MLP_TYPES = ("dense", "sparse")
INDEXER_TYPES = ("full", "shared")
EXPERT_TEMPLATE = PREFIX + "layers.{layer}.mlp.experts.{e}.{name}"
EXPERT_NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


@dataclass
class Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    kv_lora_rank: int
    q_lora_rank: int
    qk_nope_head_dim: int
    v_head_dim: int
    attention_bias: bool
    hidden_act: str
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    layer_types: list[str]
    mlp_layer_types: list[str]
    indexer_types: list[str]
    index_topk: int
    index_head_dim: int
    index_n_heads: int
    index_kpool: int
    swiglu_limit: float
    linear_head_dim: int
    linear_num_heads: int
    linear_conv_kernel_dim: int
    linear_lower_bound: float | None
    hc_mult: int
    hc_eps: float
    hc_sinkhorn_iters: int
    notes: list[str]
    weights: WeightFormat = field(default=PLAIN)  # how the checkpoint stores its linears and routed experts

    @property
    def moe_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.mlp_layer_types) if t == "sparse"]

    def shares(self, i: int) -> bool:
        """Layer ``i`` (indexed) reuses the previous layer's selection."""
        return self.indexer_types[i] == "shared"


def _text_config(raw: dict) -> tuple[dict, str, list[str]]:
    """(the text model's config, where its errors point, notes)."""
    if raw.get("model_type") == TEXT_MODEL_TYPE:
        return raw, "config.json", []
    notes = ["multimodal checkpoint: the text model only (the vision tower, model.visual.*, is not read; "
             "requests with images or video are refused)"]
    text = raw.get("text_config")
    if text is None:  # a flat config: transformers takes the top-level keys as the text model's
        return raw, "config.json", notes
    if not isinstance(text, dict):
        raise ConfigError(f"config.json: text_config={text!r} is invalid: expected an object (the text model's "
                          "config)")
    inner = text.get("model_type", TEXT_MODEL_TYPE)
    if inner != TEXT_MODEL_TYPE:
        raise UnsupportedModelError(f"config.json: text_config.model_type={inner!r} is not supported (expected "
                                    f"{TEXT_MODEL_TYPE!r})")
    if raw.get("tie_word_embeddings", False) != text.get("tie_word_embeddings", False):
        raise UnsupportedModelError("config.json: tie_word_embeddings and text_config.tie_word_embeddings disagree")
    return text, "config.json text_config", notes


def _types(c: RawConfig, key: str, value, n: int, allowed: tuple[str, ...]) -> list[str]:
    if not isinstance(value, list) or len(value) != n:
        raise c.bad(key, value, f"a list of {n} layer types (one per layer)")
    bad = sorted({repr(t) for t in value if t not in allowed})
    if bad:
        raise UnsupportedModelError(f"{c.where}: {key} has {', '.join(bad)}, which is not supported (supported: "
                                    f"{', '.join(allowed)})")
    return list(value)


def _layer_types(c: RawConfig, n: int) -> list[str]:
    types = c.raw.get("layer_types")
    if types is None:  # transformers' default: every 4th layer indexed attention
        return ["indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(n)]
    if isinstance(types, list):
        types = ["indexed_attention" if t == "full_attention" else t for t in types]
    return _types(c, "layer_types", types, n, LAYER_TYPES)


def _indexer_types(c: RawConfig, n: int) -> list[str]:
    """``indexer_types``, else ``index_topk_pattern`` ("F"/"S" per layer), else the schedule of
    ``index_topk_freq`` (1) and ``index_skip_topk_offset`` (2), as transformers derives it."""
    types, key = c.raw.get("indexer_types"), "indexer_types"
    if types is None and c.raw.get("index_topk_pattern") is not None:
        key, pattern = "index_topk_pattern", c.raw["index_topk_pattern"]
        if isinstance(pattern, str):
            if any(ch not in "FS" for ch in pattern):
                raise c.bad(key, pattern, "a string of \"F\" (full) and \"S\" (shared), one per layer")
            types = ["full" if ch == "F" else "shared" for ch in pattern]
        else:
            types = pattern
    elif types is None:
        freq = max(c.int("index_topk_freq", 1), 1)
        offset = c.int("index_skip_topk_offset", 2)
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    return _types(c, key, types, n, INDEXER_TYPES)


def _linear_attn(c: RawConfig, text: dict) -> dict:
    """The KDA fields, ``linear_attn_config`` overriding the flat keys (as transformers reads them)."""
    lin = text.get("linear_attn_config")
    out = dict(head_dim=c.pos_int("linear_head_dim", 128, hi=MAX_HEAD_DIM),
               heads=c.pos_int("linear_num_heads", 64, hi=MAX_HEADS),
               kernel=c.pos_int("linear_conv_kernel_dim", 4, hi=MAX_HEAD_DIM))
    bound = text.get("linear_lower_bound", -5.0)
    if lin is not None:
        if not isinstance(lin, dict):
            raise c.bad("linear_attn_config", lin, "an object")
        lc = RawConfig(lin, f"{c.where}: linear_attn_config")
        out.update(head_dim=lc.pos_int("head_dim", out["head_dim"], hi=MAX_HEAD_DIM),
                   heads=lc.pos_int("num_heads", out["heads"], hi=MAX_HEADS),
                   kernel=lc.pos_int("short_conv_kernel_size", out["kernel"], hi=MAX_HEAD_DIM))
        bound = lin.get("gate_lower_bound", bound)
        if lin.get("safe_gate", True) and bound is None:
            bound = -5.0
    if bound is not None:
        bound = number(bound, "linear_lower_bound", c.where)
    out["lower_bound"] = bound
    return out


def parse_config(raw: dict) -> Config:
    if not isinstance(raw, dict):
        raise ConfigError(f"config.json: must be a JSON object, got {type(raw).__name__}")
    text, where, notes = _text_config(raw)
    quantization = text_quantization(raw, text) if text is not raw else raw.get("quantization_config")
    # the declaration's names are the checkpoint's (``PREFIX``); PLAIN: one object for plain configs (equal)
    weights = WeightFormat(quantization) if quantization else PLAIN
    c = RawConfig(text, where)
    n = c.layers()
    hidden = c.pos_int("hidden_size", 4096)
    heads = c.pos_int("num_attention_heads", 64, hi=MAX_HEADS)
    kv_heads = c.pos_int("num_key_value_heads", heads, hi=MAX_HEADS)
    if kv_heads != heads:
        raise UnsupportedModelError(f"{where}: num_key_value_heads={kv_heads} differs from num_attention_heads="
                                    f"{heads} (MLA has no key/value head groups; transformers refuses it too)")
    if "q_lora_rank" in text and text["q_lora_rank"] is None:
        raise UnsupportedModelError(f"{where}: q_lora_rank=None is not supported (the DSA indexer reads the "
                                    "normalised low-rank query; transformers refuses it too)")
    rope_dim = c.int("qk_rope_head_dim", 0, lo=0, hi=MAX_HEAD_DIM)
    if rope_dim:
        raise UnsupportedModelError(f"{where}: qk_rope_head_dim={rope_dim} is not supported (GLM-5.3-Flash's MLA "
                                    "has no positional encoding; transformers refuses it too)")
    layer_types = _layer_types(c, n)
    mlp_types = c.raw.get("mlp_layer_types")
    if mlp_types is None:
        mlp_types = ["dense"] * min(3, n) + ["sparse"] * max(0, n - 3)
    mlp_types = _types(c, "mlp_layer_types", mlp_types, n, MLP_TYPES)
    indexer_types = _indexer_types(c, n)
    for i, t in enumerate(layer_types):
        if t == "indexed_attention" and indexer_types[i] == "shared" and (
                i == 0 or layer_types[i - 1] != "indexed_attention" or indexer_types[i - 1] != "full"):
            raise UnsupportedModelError(f"{where}: indexer_types[{i}]=\"shared\" on layer {i}, which does not follow "
                                        "an indexed_attention layer with its own indexer (\"full\"): transformers "
                                        "hands a selection to the next layer only, and refuses this")
    n_experts = c.pos_int("n_routed_experts", 288, "num_local_experts", hi=MAX_EXPERTS)
    n_group, topk_group = c.pos_int("n_group", 1, hi=MAX_EXPERTS), c.pos_int("topk_group", 1, hi=MAX_EXPERTS)
    if n_experts % n_group or topk_group > n_group:
        raise UnsupportedModelError(f"{where}: {n_experts} experts cannot be routed in {n_group} groups keeping "
                                    f"{topk_group}")
    if n_experts // n_group < 2:
        raise UnsupportedModelError(f"{where}: group-limited routing needs at least 2 experts per group "
                                    f"({n_experts} experts in {n_group} groups): transformers scores each group "
                                    "by its best two")
    n_shared = c.int("n_shared_experts", 1, lo=0, hi=MAX_EXPERTS)
    if n_shared < 1:
        raise UnsupportedModelError(f"{where}: n_shared_experts={n_shared} is not supported (GLM-5.3-Flash always "
                                    "has a shared expert)")
    topk = c.pos_int("index_topk", 2048, hi=MAX_POSITIONS)
    kpool = c.pos_int("index_kpool", 16, hi=MAX_POSITIONS)
    if topk % kpool:
        raise ConfigError(f"{where}: index_topk={topk} is invalid: it must be a multiple of index_kpool={kpool} "
                          "(the indexer keeps whole pools; transformers refuses it too)")
    if not c.bool("index_kpool_always_select_tail", True):
        raise UnsupportedModelError(f"{where}: index_kpool_always_select_tail=false is not supported (a query "
                                    "before its first complete pool would attend to nothing)")
    if not [i for i, t in enumerate(mlp_types) if t == "sparse"]:
        raise UnsupportedModelError(f"{where}: no \"sparse\" layer in mlp_layer_types (a dense model) is not "
                                    "supported by the MoE engine")
    lin = _linear_attn(c, text)
    mtp = c.int("num_nextn_predict_layers", 0, lo=0)
    if mtp:
        notes = [*notes, f"{mtp} multi-token-prediction layer(s) are not used: generation predicts one token per "
                 "step"]
    return Config(
        vocab_size=c.pos_int("vocab_size", 154880),
        hidden_size=hidden,
        intermediate_size=c.pos_int("intermediate_size", 12288),
        moe_intermediate_size=c.pos_int("moe_intermediate_size", 2048),
        num_hidden_layers=n,
        num_attention_heads=heads,
        n_routed_experts=n_experts,
        num_experts_per_tok=c.top_k("num_experts_per_tok", n_experts, 8),
        n_shared_experts=n_shared,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=c.bool("norm_topk_prob", True),
        routed_scaling_factor=c.float("routed_scaling_factor", 2.5, positive=True),
        kv_lora_rank=c.pos_int("kv_lora_rank", 512),
        q_lora_rank=c.pos_int("q_lora_rank", 1536),
        qk_nope_head_dim=c.pos_int("qk_nope_head_dim", 256, hi=MAX_HEAD_DIM),
        v_head_dim=c.pos_int("v_head_dim", 256, hi=MAX_HEAD_DIM),
        attention_bias=c.bool("attention_bias", False),
        hidden_act=c.act(),
        rms_norm_eps=c.eps(1e-5),
        max_position_embeddings=c.pos_int("max_position_embeddings", 1048576, hi=MAX_POSITIONS),
        tie_word_embeddings=c.bool("tie_word_embeddings", False),
        layer_types=layer_types,
        mlp_layer_types=mlp_types,
        indexer_types=indexer_types,
        index_topk=topk,
        index_head_dim=c.pos_int("index_head_dim", 128, hi=MAX_HEAD_DIM),
        index_n_heads=c.pos_int("index_n_heads", 32, hi=MAX_HEADS),
        index_kpool=kpool,
        swiglu_limit=c.float("swiglu_limit", 10.0, positive=True),
        linear_head_dim=lin["head_dim"],
        linear_num_heads=lin["heads"],
        linear_conv_kernel_dim=lin["kernel"],
        linear_lower_bound=lin["lower_bound"],
        hc_mult=c.pos_int("hc_mult", 4, hi=64),
        hc_eps=c.float("hc_eps", 1e-6, positive=True),
        hc_sinkhorn_iters=c.pos_int("hc_sinkhorn_iters", 20, hi=1 << 10),
        notes=notes,
        weights=weights,
    )


def _attention(cfg: Config, i: int):
    h, eps = cfg.hidden_size, cfg.rms_norm_eps
    if cfg.layer_types[i] == "linear_attention":
        return kimi_delta(h, heads=cfg.linear_num_heads, head_dim=cfg.linear_head_dim,
                          kernel=cfg.linear_conv_kernel_dim, act=cfg.hidden_act, eps=eps,
                          lower_bound=cfg.linear_lower_bound, a_log_shape=(cfg.linear_num_heads,))
    return dsa_mla(h, cfg.num_attention_heads, topk=cfg.index_topk, index_heads=cfg.index_n_heads,
                   index_head_dim=cfg.index_head_dim, index_interleave=False,
                   source=i - 1 if cfg.shares(i) else None, kpool=cfg.index_kpool, q_lora_rank=cfg.q_lora_rank,
                   kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=0,
                   v_head_dim=cfg.v_head_dim, bias=cfg.attention_bias, scale=cfg.qk_nope_head_dim ** -0.5,
                   interleave=False, norm_eps=eps, weights_proj_linear=True)


def _mlp(cfg: Config, i: int):
    h, act, limit = cfg.hidden_size, cfg.hidden_act, cfg.swiglu_limit
    if cfg.mlp_layer_types[i] == "dense":
        return gated_mlp(h, cfg.intermediate_size, act, limit=limit)
    router = grouped_router(cfg.n_routed_experts, h, cfg.num_experts_per_tok, scoring="sigmoid", n_group=cfg.n_group,
                            topk_group=cfg.topk_group, group_score="top2_sum", normalize=cfg.norm_topk_prob,
                            scale=cfg.routed_scaling_factor)
    shared = gated_mlp(h, cfg.moe_intermediate_size * cfg.n_shared_experts, act, prefix="", limit=limit)
    return moe(router, shared=shared)


def declare(cfg: Config) -> HyperModel:
    h, eps, n = cfg.hidden_size, cfg.rms_norm_eps, cfg.hc_mult

    def hc(prefix: str):
        return hyper_connection(n, h, iters=cfg.hc_sinkhorn_iters, eps=cfg.hc_eps, norm_eps=eps).nested(prefix)

    layers = [HyperLayer(i, f"{PREFIX}layers.{i}.", rms_norm(h, eps), rms_norm(h, eps), hc("hc_attn_"),
                         hc("hc_ffn_"), _attention(cfg, i), _mlp(cfg, i),
                         names={"input_norm": "input_layernorm.", "post_norm": "post_attention_layernorm."})
              for i in range(cfg.num_hidden_layers)]
    return HyperModel(cfg.vocab_size, h, layers, rms_norm(h, eps), cfg.tie_word_embeddings, streams=n,
                      head_part=mean_head(n), embed_name=PREFIX + "embed_tokens.weight", norm_prefix=PREFIX + "norm.",
                      head_name="lm_head.weight", hc_head_prefix=PREFIX + "hc_head.", weights=cfg.weights)


def describe(cfg: Config) -> ModelDescription:
    spec = ExpertSpec(hidden=cfg.hidden_size, intermediate=cfg.moe_intermediate_size, act=cfg.hidden_act,
                      variant="clamped_silu", limit=cfg.swiglu_limit)
    model = declare(cfg)
    n_lin = cfg.layer_types.count("linear_attention")
    n_idx = cfg.num_hidden_layers - n_lin
    shared = sum(1 for i, t in enumerate(cfg.layer_types) if t == "indexed_attention" and cfg.shares(i))
    gate = (f"bounded forget gate ({cfg.linear_lower_bound:g} * sigmoid)" if cfg.linear_lower_bound is not None
            else "softplus forget gate")
    notes = [
        *cfg.notes,
        f"hybrid attention: {n_lin} Kimi Delta Attention layer(s) with a {gate} and a fixed-size recurrent state "
        f"({format_size(model.state()['state_bytes_fixed'])} with {SNAPSHOTS} snapshots kept for prefix reuse), "
        f"{n_idx} MLA layer(s) without positional encoding ({cfg.kv_lora_rank} latent floats per position)",
        f"DeepSeek sparse attention over pools: a query attends over the index_topk / index_kpool = "
        f"{cfg.index_topk // cfg.index_kpool} pools of {cfg.index_kpool} positions its indexer selects "
        f"({cfg.index_n_heads} heads x {cfg.index_head_dim}) and its own incomplete pool; indexer keys: "
        f"{2 * cfg.index_head_dim} floats per position and the key of each complete pool ({cfg.index_head_dim} "
        "floats, computed once) per indexer layer"
        + (f"; {shared} layer(s) reuse the previous layer's selection" if shared else ""),
        f"residual: {cfg.hc_mult} hyper-connection streams (Sinkhorn-Knopp, {cfg.hc_sinkhorn_iters} iterations), "
        "collapsed by their mean",
        f"experts: SwiGLU clamped at {cfg.swiglu_limit:g} (dense, shared and routed)",
    ]
    return model.describe(model_type=MODEL_TYPE, n_experts=cfg.n_routed_experts, top_k=cfg.num_experts_per_tok,
                          **model.routed_experts(spec, EXPERT_TEMPLATE, EXPERT_NAMES),
                          max_position_embeddings=cfg.max_position_embeddings, attn_heads=cfg.num_attention_heads,
                          notes=notes)


def build(cfg: Config, w, experts) -> HyperCausalLM:
    return declare(cfg).build(w, experts)


__all__ = ["Config", "build", "declare", "describe", "parse_config"]
