"""Qwen3.8-Flash-Next (``model_type: qwen4_exp``; the text model alone is ``qwen4_exp_text``).

As transformers 5.24 computes it (modeling_qwen4_exp.py, the oracle):

- **Gated DeltaNet** linear-attention layers (Qwen3.5's split projections,
  ``layers.gated_delta.SplitGatedDeltaNet``; the output gate's activation
  ``output_gate_type``, SiLU or sigmoid) and **QSA** attention layers (``indexed_attention``, or
  ``full_attention`` as the published configs name them): Qwen3.5's gated attention (sigmoid
  output gate, (1 + w) per-head q/k norms, partial RoPE) over the tokens a block indexer keeps
  (``layers/qsa.py``: keys averaged into blocks of ``indexer_compress_ratio``, the best
  ``indexer_budget / ratio`` blocks per query plus the incomplete last block);
- **gated-residual hyper-connections** (``hc_count`` streams, a low-rank gate of rank
  ``hc_lowrank`` before each block; ``layers/gated_residual.py``): no decoder-layer norms and
  no final norm, a last mixer collapses the streams before the head;
- **PLE** on the one-indexed ``ple_layer_ids`` (linear-attention layers): n-gram embedding
  rows looked up by a hash of each token and the ``ngram_size - 1`` before it (the history
  resets at EOS: the first ``eos_token_id``), gated into the streams (``layers/ple.py``). The
  tables (``ple.ple_embedding.ngram_embedding``, tens of GB in the published model, stored in
  ``split_ngram_parts`` pieces) are read through the row store (``rows/``), resident or by row;
- every layer an MoE block: softmax top-k (renormalised with ``norm_topk_prob``) and a
  sigmoid-gated shared expert, as Qwen3-Next's.

The hash constants (multipliers, prime head sizes, offsets) follow from the config; the
checkpoint's copies of them (``layer_multipliers``, ``ngram_heads_vocab_sizes``,
``ngram_heads_offsets``) are checked against them at load. The published checkpoints are the
multimodal wrapper (text under ``model.language_model.``, ``lm_head.weight`` at the top): the
vision tower (``model.visual.*``) is never read, requests with images are refused.
Multi-token-prediction weights (``mtp.*``) are not used (transformers ignores them too).

FP8 (block and compressed-tensors) and INT4-expert checkpoints are read as every family reads
them (``models/weight_format.py``), the wrapper's top-level ``quantization_config`` applying to
the text model: every linear transformers' FP8 integration converts is declared one (``Lin``:
the projections, the shared expert and its gate, the QSA indexer's ``index_qk_proj``, PLE's
``key_proj`` / ``value_proj``, the gated residuals' ``input_mix_weight_down`` / ``_up`` /
``block_inject_weight``, the final ``hyper_connection_mixer``'s too); the router, norms,
convolutions, the embedding, the head and the PLE n-gram tables (``nn.Embedding``s, read by row)
stay as stored. ``modules_to_convert`` (transformers' FP8 embeddings) is refused by name: the
tables are read in their plain form only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ConfigError, UnsupportedModelError
from ..experts.spec import ExpertSpec
from ..layers.gated_delta import SNAPSHOTS
from ..layers.ple import NGramHash, PLELayer
from ..layers.qsa import QSAAttention, QSACache, QSAIndexer
from ..layers.rotary import Rotary
from ..units import format_size
from . import qwen3_next
from .base import CausalLM, ModelDescription
from .config import MAX_DIM, MAX_HEAD_DIM, MAX_HEADS, MAX_LAYERS, RawConfig
from .declare import Lin, Part
from .parts import gated_delta, gated_mlp, moe, softmax_router
from .standard import PROJ_NAMES
from .streams import StreamLayer, StreamModel, gated_residual
from .weight_format import WeightFormat, text_quantization

MODEL_TYPE = "qwen4_exp"
ALIASES = ("qwen4_exp_text",)
TEXT_MODEL_TYPE = "qwen4_exp_text"
WRAPPER_PREFIX = "model.language_model."
TABLE = "ple.ple_embedding.ngram_embedding"  # under model.layers.<i>.
HASH_BUFFERS = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")
MAX_NGRAM = 8

_IGNORED = {  # keys the text model does not read: the value it computes with
    "mlp_only_layers": ([],), "decoder_sparse_step": (1,), "attn_output_gate": (True,),
}


@dataclass
class Config(qwen3_next.Config):
    hc_count: int = 4
    hc_lowrank: int = 320
    ple_layers: list[int] = field(default_factory=list)  # zero-indexed
    ple_embed_dim: int = 0
    ple_conv_kernel_size: int = 4
    ngram_size: int = 3
    heads_per_ngram: int = 8
    ngram_vocab_size_base: int = 20_000_000
    ngram_divisor: int = 128
    seed: int = 1234
    eos: int = 0
    indexer: dict | None = None  # n_heads, head_dim, budget, ratio
    gate_act: str = "silu"


def _text_config(raw: dict) -> tuple[dict, str, str, list[str]]:
    if raw.get("model_type") == TEXT_MODEL_TYPE:
        return raw, "config.json", "model.", []
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"config.json: model_type {MODEL_TYPE!r} needs a text_config object (the text model's "
                          f"config), got {text!r}")
    inner = text.get("model_type", TEXT_MODEL_TYPE)
    if inner != TEXT_MODEL_TYPE:
        raise UnsupportedModelError(f"config.json: text_config.model_type={inner!r} is not supported (expected "
                                    f"{TEXT_MODEL_TYPE!r})")
    if raw.get("tie_word_embeddings", False) != text.get("tie_word_embeddings", False):
        raise UnsupportedModelError("config.json: tie_word_embeddings and text_config.tie_word_embeddings disagree")
    notes = ["multimodal checkpoint: the text model only (the vision tower, model.visual.*, is not read; "
             "requests with images or video are refused)"]
    return text, "config.json text_config", WRAPPER_PREFIX, notes


def _indexer(c: RawConfig, where: str, head_dim: int, rope: dict) -> dict | None:
    keys = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")
    given = {k: c.get(k, None) for k in keys}
    if all(v is None for v in given.values()):
        return None
    missing = [k for k, v in given.items() if v is None]
    if missing:
        raise ConfigError(f"{where}: QSA config is missing {missing} (all of {list(keys)} or none)")
    heads = c.pos_int("indexer_n_heads", hi=MAX_HEADS)
    c.refuse("indexer_kv_heads", (1,), "Qwen4-Exp QSA has one index key head")
    d = c.pos_int("indexer_head_dim", hi=MAX_HEAD_DIM)
    ratio = c.pos_int("indexer_compress_ratio", hi=1 << 20)
    budget = c.pos_int("indexer_budget", hi=1 << 24)
    if budget % ratio:
        raise ConfigError(f"{where}: indexer_budget={budget} must be a multiple of indexer_compress_ratio={ratio}")
    if int(head_dim * rope.get("partial_rotary_factor", 1.0)) > d:
        raise ConfigError(f"{where}: the rotary dims of the attention heads must fit the QSA index head "
                          f"(indexer_head_dim={d})")
    return dict(n_heads=heads, head_dim=d, budget=budget, ratio=ratio)


def parse_config(raw: dict) -> Config:
    if not isinstance(raw, dict):
        raise ConfigError(f"config.json: must be a JSON object, got {type(raw).__name__}")
    text, where, prefix, notes = _text_config(raw)
    quantization = text_quantization(raw, text) if text is not raw else raw.get("quantization_config")
    if isinstance(quantization, dict) and quantization.get("modules_to_convert"):
        raise UnsupportedModelError(
            f"config.json: quantization_config.modules_to_convert={quantization['modules_to_convert']!r} is not "
            f"supported for {MODEL_TYPE}: its embeddings, the PLE n-gram tables ({TABLE}) among them, are read (by "
            "row) in their plain f32 / bf16 / f16 form only; FP8 embedding tables are not read")
    weights = WeightFormat(quantization, checkpoint_name=lambda m: _renamed(m, prefix))
    c = RawConfig(text, where)
    for key, allowed in _IGNORED.items():
        c.refuse(key, allowed, f"transformers' Qwen4-Exp computes as if it were {allowed[0]!r}")
    n_layers = c.layers()
    types = c.get("layer_types", None)
    if types is None:
        interval = c.pos_int("full_attention_interval", 4, hi=MAX_LAYERS)
        types = ["indexed_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
    if not isinstance(types, list) or len(types) != n_layers:
        raise ConfigError(f"{where}: layer_types must list {n_layers} layer types, got {types!r}")
    bad = sorted({str(t) for t in types if t not in ("linear_attention", "indexed_attention", "full_attention")})
    if bad:
        raise UnsupportedModelError(f"{where}: layer type(s) {bad} are not supported (supported: linear_attention, "
                                    "indexed_attention, full_attention)")
    rope = dict(text.get("rope_parameters") or {})
    rope.setdefault("partial_rotary_factor", 1.0)  # transformers' Qwen4-Exp default (not Qwen3-Next's 0.25)
    mapped = {**text, "layer_types": ["linear_attention" if t == "linear_attention" else "full_attention"
                                      for t in types], "rope_parameters": rope, "quantization_config": None}
    base = qwen3_next.parse_config(mapped, dense_layers=False, where=where)
    cfg = Config(**{k: getattr(base, k) for k in qwen3_next.Config.__dataclass_fields__})
    cfg.norm_topk_prob = c.bool("norm_topk_prob", True)
    cfg.model_type, cfg.split_projections, cfg.text_prefix = MODEL_TYPE, True, prefix
    cfg.weights = weights
    gate = (c.str("output_gate_type") if text.get("output_gate_type") is not None else None) or cfg.hidden_act
    if gate not in ("silu", "sigmoid"):
        raise UnsupportedModelError(f"{where}: output_gate_type={gate!r} is not supported (silu, sigmoid)")
    cfg.gate_act = gate
    cfg.hc_count = c.int("hc_count", 4, lo=2, hi=64)
    cfg.hc_lowrank = c.pos_int("hc_lowrank", 320)
    cfg.indexer = _indexer(c, where, cfg.head_dim, cfg.rope)
    if cfg.full_layers and cfg.indexer is None:
        raise UnsupportedModelError(f"{where}: attention layers without a QSA indexer (indexer_* keys) are not "
                                    "supported: transformers' Qwen4-Exp always builds one")
    ple_ids = c.int_list("ple_layer_ids", (), lo=1, hi=n_layers)
    cfg.ple_layers = sorted({i - 1 for i in ple_ids})
    if cfg.ple_layers:
        cfg.ple_embed_dim = c.pos_int("ple_embed_dim") if text.get("ple_embed_dim") is not None else cfg.hidden_size
        cfg.ple_conv_kernel_size = c.pos_int("ple_conv_kernel_size", 4, hi=64)
        cfg.ngram_size = c.int("ngram_size", 3, lo=2, hi=MAX_NGRAM)
        cfg.heads_per_ngram = c.pos_int("heads_per_ngram", 8, hi=MAX_HEADS)
        cfg.ngram_vocab_size_base = c.int("ngram_vocab_size_base", 20_000_000, lo=2, hi=1 << 40)
        cfg.ngram_divisor = c.pos_int("make_ngram_vocab_size_divisible_by", 128, hi=1 << 20)
        cfg.seed = c.int("seed", 1234, lo=0, hi=(1 << 63) - 1)
        heads = (cfg.ngram_size - 1) * cfg.heads_per_ngram
        if cfg.ple_embed_dim % heads:
            raise ConfigError(f"{where}: ple_embed_dim={cfg.ple_embed_dim} must be a multiple of the {heads} n-gram "
                              "heads ((ngram_size - 1) x heads_per_ngram)")
        not_linear = [i + 1 for i in cfg.ple_layers if cfg.layer_types[i] != "linear_attention"]
        if not_linear:
            raise ConfigError(f"{where}: ple_layer_ids {not_linear} are not linear_attention layers (PLE runs on "
                              "linear-attention layers only)")
        eos = text.get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) and eos else eos
        if isinstance(eos, bool) or not isinstance(eos, int) or not 0 <= eos < cfg.vocab_size:
            raise ConfigError(f"{where}: eos_token_id={text.get('eos_token_id')!r} must be a token id when PLE "
                              "layers are enabled (the n-gram history resets at it)")
        cfg.eos = eos
    mtp = c.int("mtp_num_hidden_layers", 0, lo=0, hi=MAX_LAYERS)
    if mtp:
        notes = [*notes, f"{mtp} multi-token-prediction layer(s) (mtp.*) are not used"]
    cfg.notes = notes
    if cfg.hidden_size * cfg.hc_count > MAX_DIM * 64:
        raise ConfigError(f"{where}: hc_count x hidden_size is implausibly large")
    return cfg


def _renamed(name: str, prefix: str) -> str:
    return prefix + name[len("model."):] if name.startswith("model.") else name


def hasher(cfg: Config, layer: int) -> NGramHash:
    return NGramHash(vocab=cfg.vocab_size, ngram=cfg.ngram_size, heads=cfg.heads_per_ngram,
                     base=cfg.ngram_vocab_size_base, divisor=cfg.ngram_divisor, seed=cfg.seed,
                     ple_index=cfg.ple_layers.index(layer), eos=cfg.eos)


def _ple(cfg: Config, layer: int) -> Part:
    n, h, e, k = cfg.hc_count, cfg.hidden_size, cfg.ple_embed_dim, cfg.ple_conv_kernel_size
    c = n * h
    hashed = hasher(cfg, layer)
    table = _renamed(f"model.layers.{layer}.{TABLE}", cfg.text_prefix)  # its name in the checkpoint
    tensors = {"key_proj": Lin((c, e)), "value_proj": Lin((h, e)), "norm_key.weight": (c,),
               "norm_query.weight": (c,), "norm_conv.weight": (c,), "conv1d.weight": (c, 1, k)}

    def make(t):
        return PLELayer(key=t.lin("key_proj"), value=t.lin("value_proj"), norm_key=t("norm_key.weight"),
                        norm_query=t("norm_query.weight"), norm_conv=t("norm_conv.weight"), conv=t("conv1d.weight"),
                        n=n, hidden=h, dilation=cfg.ngram_size, eps=cfg.rms_norm_eps, hasher=hashed, table=table)

    one = PLELayer.nbytes(c, k, cfg.ngram_size, cfg.ngram_size)
    return Part(tensors, make, fixed=one * (1 + SNAPSHOTS), transient=4 * one)


def _qsa(cfg: Config, rotary: Rotary) -> Part:
    h, hq, kv, d, ix = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.indexer
    p = "self_attn."
    tensors = {p + "q_proj": Lin((2 * hq * d, h)), p + "k_proj": Lin((kv * d, h)), p + "v_proj": Lin((kv * d, h)),
               p + "o_proj": Lin((h, hq * d)), p + "q_norm.weight": (d,), p + "k_norm.weight": (d,),
               p + "indexer.index_qk_proj": Lin(((ix["n_heads"] + 1) * ix["head_dim"], h)),
               p + "indexer.q_layernorm.weight": (ix["head_dim"],), p + "indexer.k_layernorm.weight": (ix["head_dim"],)}

    def make(t):
        indexer = QSAIndexer(qk=t.lin(p + "indexer.index_qk_proj"), q_norm=t(p + "indexer.q_layernorm.weight"),
                             k_norm=t(p + "indexer.k_layernorm.weight"), n_heads=ix["n_heads"],
                             head_dim=ix["head_dim"], budget=ix["budget"], ratio=ix["ratio"], eps=cfg.rms_norm_eps)
        return QSAAttention(indexer=indexer, rotary=rotary, wq=t.lin(p + "q_proj"), wk=t.lin(p + "k_proj"),
                            wv=t.lin(p + "v_proj"), wo=t.lin(p + "o_proj"), q_norm=t(p + "q_norm.weight"),
                            k_norm=t(p + "k_norm.weight"), norm_eps=cfg.rms_norm_eps, n_heads=hq, n_kv=kv,
                            head_dim=d)

    # per position: keys, values, the raw index key and a share of the block keys
    per = QSACache.nbytes(kv, 1, d, ix["head_dim"], 1) - 4 * ix["head_dim"] + -(-4 * ix["head_dim"] // ix["ratio"])
    return Part(tensors, make, kv_per_token=per)


def declare(cfg: Config) -> StreamModel:
    h, eps, n = cfg.hidden_size, cfg.rms_norm_eps, cfg.hc_count
    rotary = Rotary(cfg.head_dim, cfg.rope, cfg.max_position_embeddings)

    def attn(i: int) -> Part:
        if cfg.layer_types[i] == "linear_attention":
            return gated_delta(h, n_k=cfg.linear_num_key_heads, n_v=cfg.linear_num_value_heads,
                               dk=cfg.linear_key_head_dim, dv=cfg.linear_value_head_dim,
                               kernel=cfg.linear_conv_kernel_dim, act=cfg.hidden_act, eps=eps, split=True,
                               gate=cfg.gate_act)
        return _qsa(cfg, rotary)

    def mlp() -> Part:
        return moe(softmax_router(cfg.num_experts, h, cfg.num_experts_per_tok, cfg.norm_topk_prob),
                   shared=gated_mlp(h, cfg.shared_expert_intermediate_size, cfg.hidden_act, prefix=""),
                   shared_name="shared_expert.", shared_gate=h)

    layers = [StreamLayer(i, gated_residual(n, h, cfg.hc_lowrank, eps), gated_residual(n, h, cfg.hc_lowrank, eps),
                          attn(i), mlp(), _ple(cfg, i) if i in cfg.ple_layers else None)
              for i in range(cfg.num_hidden_layers)]
    tables = {f"model.layers.{i}.{TABLE}": (hasher(cfg, i).rows, cfg.ple_embed_dim // (
        (cfg.ngram_size - 1) * cfg.heads_per_ngram)) for i in cfg.ple_layers}
    return StreamModel(cfg.vocab_size, h, layers, Part({}, lambda t: None), cfg.tie_word_embeddings,
                       lambda: rotary, weights=cfg.weights, streams=n,
                       mixer=gated_residual(n, h, cfg.hc_lowrank, eps, injects=False), tables=tables)


def describe(cfg: Config) -> ModelDescription:
    spec = ExpertSpec(hidden=cfg.hidden_size, intermediate=cfg.moe_intermediate_size, act=cfg.hidden_act)
    model = declare(cfg)
    tables = model.tables
    table_bytes = sum(r * d for r, d in tables.values())
    notes = [f"hybrid attention: {len(cfg.linear_layers)} Gated DeltaNet layer(s), {len(cfg.full_layers)} QSA "
             f"attention layer(s) (budget {cfg.indexer['budget'] if cfg.indexer else 0} tokens); {cfg.hc_count} "
             "gated residual streams"]
    if tables:
        notes.append(f"{len(tables)} PLE n-gram table(s), {format_size(4 * table_bytes)} as f32, read through the "
                     "row store")
    desc = model.describe(
        model_type=cfg.model_type, n_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
        **model.routed_experts(spec, cfg.text_prefix + "layers.{layer}.mlp.experts.{e}.{name}", PROJ_NAMES),
        max_position_embeddings=cfg.max_position_embeddings, attn_heads=cfg.num_attention_heads,
        notes=[*notes, *cfg.notes])
    desc.row_tables = {_renamed(name, cfg.text_prefix): shape for name, shape in tables.items()}
    return desc


def tensor_aliases(cfg: Config) -> dict[str, str]:
    if cfg.text_prefix == "model.":
        return {}
    return {name: _renamed(name, cfg.text_prefix) for name in declare(cfg).spine() if name.startswith("model.")}


def build(cfg: Config, w, experts) -> CausalLM:
    return declare(cfg).build(w, experts)


def check_row_tables(cfg: Config, checkpoint) -> None:
    """The checkpoint's copies of the hash constants (transformers loads them, persistent buffers)
    must be what the config implies: a table hashed differently would be read at other rows."""
    from ..errors import CheckpointError

    for i in cfg.ple_layers:
        hashed = hasher(cfg, i)
        want = {"layer_multipliers": hashed.mult, "ngram_heads_vocab_sizes": hashed.sizes,
                "ngram_heads_offsets": hashed.offsets}
        for buf, values in want.items():
            name = _renamed(f"model.layers.{i}.ple.ple_embedding.{buf}", cfg.text_prefix)
            if name not in checkpoint.tensors:
                continue  # not saved: transformers derives it from the config as Sluice does
            info = checkpoint.info(name)
            if info.dtype != "I64" or list(info.shape) != [len(values)]:
                raise CheckpointError(f"{info.file}: {name!r} is {info.dtype} {list(info.shape)}, expected I64 "
                                      f"[{len(values)}]")
            got = checkpoint.read(name).tolist()
            if got != list(values):
                raise CheckpointError(f"{info.file}: {name!r} is {got}, but config.json implies {list(values)} "
                                      "(config and weights disagree: the n-gram hash would read other rows)")
