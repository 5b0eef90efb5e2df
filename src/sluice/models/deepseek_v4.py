"""DeepSeek-V4 (``model_type: deepseek_v4``; V4-Flash, V4-Pro), as transformers 5.24 computes it.

- **Residual**: ``hc_mult`` streams with manifold-constrained hyper-connections around every
  attention and MLP block and a final ``HyperHead`` (``models.hyper``, ``layers.hyper``).
- **Attention** (``layers.compressed_attention``): shared-KV multi-query attention (one
  ``head_dim``-wide head, key = value), low-rank queries with a weightless per-head RMS norm,
  interleaved RoPE on the trailing ``qk_rope_head_dim`` dims and its inverse on the output, learned
  sinks, a sliding window, the grouped low-rank output projection (``o_groups`` x ``o_lora_rank``).
  Per ``layer_types``: ``sliding_attention`` (the window only, RoPE "main"), or with compressed
  entries of the past and RoPE "compress": ``heavily_compressed_attention`` (HCA, one entry per
  ``compress_rates[...]`` = 128 positions, all visible) and ``compressed_sparse_attention`` (CSA,
  one per 4 with overlapping windows, the lightning indexer keeping ``index_topk`` per query),
  ``layers.compressor``.
- **Routing**: ``sqrtsoftplus`` scores (``scoring_func``) with the correction bias ``gate.bias``
  (selection only), renormalised, times ``routed_scaling_factor``; the ``hash_moe`` layers
  (``mlp_layer_types``, legacy ``num_hash_layers``: the first 3) pick experts ``tid2eid[token]``
  (``layers.routing.HashRouter``; the step's token ids reach the MoE block in its
  ``ForwardContext``), only their weights come from the scores. One shared expert.
- **Experts**: SwiGLU with ``swiglu_limit`` clamps (gate above, up both sides), routed and shared.
- **Not used**: the multi-token-prediction layers (``mtp.*``, ``num_nextn_predict_layers``):
  generation predicts one token per step, as transformers does.

Tensor names are the published checkpoint's (``embed.weight``, ``layers.N.attn.wq_a.weight``,
``layers.N.ffn.experts.E.w1.weight``, ``hc_head_fn``, ...); a checkpoint that transformers' own
``save_pretrained`` wrote (``model.`` prefixes, ``model.embed_tokens.weight``,
``model.hc_head.hc_fn``, ``attn.norm.weight``) is read through ``tensor_aliases``.

**As published** (``quantization_config``: ``quant_method: "fp8"``, ``fmt: "e4m3"``,
``scale_fmt: "ue8m0"``, ``weight_block_size: [128, 128]``; ``expert_dtype: "fp4"``, top level or
inside it, as transformers moves it): every linear but the compressors' ``wkv`` / ``wgate`` and the
indexer's ``weights_proj`` (bf16, transformers' ``_keep_in_fp32_modules``), the head, the
embedding, the routers and the hyper-connections is e4m3 ``<module>.weight`` with power-of-two
block scales ``<module>.scale`` (float8_e8m0fnu), kept in FP8 (``quant.fp8.BlockFP8``; ``wo_a``'s
row blocks too); the routed experts are FP4 (``quant/fp4.py``: e2m1 two per byte, one ue8m0 scale
per 32 inputs), read, cached and multiplied as stored; ``expert_dtype: "fp8"`` experts are block
FP8 like the spine. Other quantization configs are refused by name (``_weights``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..errors import UnsupportedModelError
from ..experts.spec import ExpertSpec
from ..layers.attention import WindowKVCache
from ..layers.compressed_attention import CompressedAttention
from ..layers.compressor import Compressor, CompressorState, Indexer
from ..layers.mlp import GatedMLP
from ..layers.rotary import LayerRotary, Rotary
from ..layers.routing import HashRouter
from .base import ModelDescription
from .config import MAX_EXPERTS, MAX_HEAD_DIM, MAX_HEADS, MAX_LAYERS, MAX_POSITIONS, RawConfig, check_rope, number
from .declare import Lin, Part
from .hyper import HyperCausalLM, HyperLayer, HyperModel, hyper_connection, hyper_head
from .parts import grouped_router, moe, rms_norm
from .weight_format import PLAIN, WeightFormat

MODEL_TYPE = "deepseek_v4"
LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
KIND = {"sliding_attention": "sliding", "compressed_sparse_attention": "csa", "heavily_compressed_attention": "hca"}
MLP_TYPES = ("hash_moe", "moe")
_RATIO_TYPE = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
DEFAULT_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
SCORINGS = ("sqrtsoftplus", "sigmoid")  # transformers applies ACT2FN[scoring_func] elementwise
EXPERT_TEMPLATE = "layers.{layer}.ffn.experts.{e}.{name}.weight"
EXPERT_NAMES = {"gate": "w1", "up": "w3", "down": "w2"}
EXPERT_MODULE = "layers.{layer}.ffn.experts.{e}.{name}"
EXPERT_DTYPES = ("fp4", "fp8")
SCALE_FMTS = ("ue8m0", "float")
SCALE_TENSOR = ".scale"  # the published checkpoint's FP8 / FP4 scales: ``<module>.scale``
# linears the published FP8 checkpoints store in bf16 (transformers' ``_keep_in_fp32_modules``)
KEEP_PLAIN = ("attn.compressor.wkv", "attn.compressor.wgate", "attn.indexer.compressor.wkv",
              "attn.indexer.compressor.wgate", "attn.indexer.weights_proj")


@dataclass
class Config:
    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    q_lora_rank: int
    rope_dim: int  # qk_rope_head_dim
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    layer_types: list[str]
    mlp_layer_types: list[str]
    compress_rates: dict
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    n_routed_experts: int
    num_experts_per_tok: int
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float
    hidden_act: str
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope: dict  # "main" / "compress" -> RoPE parameters
    mtp_layers: int  # mtp.* (not used)
    weights: WeightFormat = PLAIN  # how the checkpoint stores its linears and routed experts

    @property
    def moe_layers(self) -> list[int]:
        return list(range(self.num_hidden_layers))

    def rate(self, i: int) -> int:
        return self.compress_rates.get(self.layer_types[i], 0)


def _types(c: RawConfig, key: str, allowed: tuple[str, ...], value, n: int) -> list[str]:
    if not isinstance(value, list) or any(not isinstance(t, str) for t in value):
        raise c.bad(key, value, f"a list of one type per layer ({n})")
    value = value[:n]  # transformers keeps the first num_hidden_layers (published lists are longer)
    if len(value) != n:
        raise c.bad(key, value, f"a list of at least {n} layer types (num_hidden_layers)")
    bad = sorted({repr(t) for t in value if t not in allowed})
    if bad:
        raise UnsupportedModelError(f"config.json: {key} has {', '.join(bad)}, which is not supported "
                                    f"(supported: {', '.join(allowed)})")
    return list(value)


def _layer_types(c: RawConfig, n: int) -> list[str]:
    """transformers' order: ``layer_types``, else the legacy per-layer ``compress_ratios`` (0/4/128),
    else 2 HCA layers then CSA and HCA alternating."""
    if "layer_types" in c:
        return _types(c, "layer_types", LAYER_TYPES, c.raw["layer_types"], n)
    if "compress_ratios" in c:
        ratios = c.raw["compress_ratios"]
        if not isinstance(ratios, list) or any(isinstance(r, bool) or r not in _RATIO_TYPE for r in ratios):
            raise c.bad("compress_ratios", ratios, "a list of 0, 4 or 128 per layer (sliding, CSA, HCA)")
        return _types(c, "compress_ratios", LAYER_TYPES, [_RATIO_TYPE[r] for r in ratios], n)
    rest = ["compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(max(n - 2, 0))]
    return (["heavily_compressed_attention"] * min(n, 2) + rest)[:n]


def _mlp_types(c: RawConfig, n: int) -> list[str]:
    if "mlp_layer_types" in c:
        return _types(c, "mlp_layer_types", MLP_TYPES, c.raw["mlp_layer_types"], n)
    k = c.int("num_hash_layers", 3, lo=0, hi=MAX_LAYERS)
    return (["hash_moe"] * min(n, k) + ["moe"] * max(0, n - k))[:n]


def _rates(c: RawConfig) -> dict:
    rates = dict(DEFAULT_RATES)
    given = c.raw.get("compress_rates")
    if given is not None:
        if not isinstance(given, dict):
            raise c.bad("compress_rates", given, "an object of the compression rate of each compressed layer type")
        for k in given:
            if k not in DEFAULT_RATES:
                raise c.bad(f"compress_rates.{k}", given[k], "only the compressed layer types "
                            f"({', '.join(DEFAULT_RATES)})")
        rates.update(given)
    for key, kind in (("compress_rate_csa", "compressed_sparse_attention"),
                      ("compress_rate_hca", "heavily_compressed_attention")):
        if key in c:
            rates[kind] = c.raw[key]
    for kind, r in rates.items():
        if isinstance(r, bool) or not isinstance(r, int) or not 1 <= r <= MAX_POSITIONS:
            raise c.bad(f"compress_rates.{kind}", r, "a positive integer (positions per compressed entry)")
    return rates


def _rope(c: RawConfig, head_dim: int, partial: float) -> dict:
    """The "main" (sliding layers) and "compress" (compressed layers, compressors, indexer) RoPE
    parameters as transformers' config derives them: nested ``rope_parameters`` as given, else
    main = default at ``rope_theta`` and compress = the flat ``rope_parameters`` / ``rope_scaling``
    (YaRN in the published config) at ``compress_rope_theta``, YaRN with ``attention_factor`` 1."""
    given = c.raw.get("rope_parameters")
    if given is None:
        given = c.raw.get("rope_scaling")
    if given is not None and not isinstance(given, dict):
        raise c.bad("rope_parameters", given, "an object")
    given = dict(given or {})
    if isinstance(given.get("main"), dict) and isinstance(given.get("compress"), dict):
        for key in given:  # transformers keeps only the two nested sets (and drops the rest)
            if key not in ("main", "compress", "rope_type", "type"):
                raise c.bad(f"rope_parameters.{key}", given[key], "only the 'main' and 'compress' parameters "
                            "(transformers ignores anything beside them)")
        out = {"main": dict(given["main"]), "compress": dict(given["compress"])}
    else:
        flat = {k: v for k, v in given.items() if k not in ("main", "compress")}
        main = {"rope_type": "default", "rope_theta": c.float("rope_theta", 10000.0, positive=True),
                "partial_rotary_factor": partial}
        compress = {**flat, "rope_theta": c.float("compress_rope_theta", 160000.0, positive=True),
                    "partial_rotary_factor": partial}
        compress["rope_type"] = flat.get("rope_type", flat.get("type", "default"))
        if compress["rope_type"] == "yarn":
            compress.setdefault("attention_factor", 1.0)
        out = {"main": main, "compress": compress}
    for label, p in out.items():
        p.setdefault("rope_type", p.get("type", "default"))
        if p["rope_type"] not in ("default", "yarn"):
            raise UnsupportedModelError(f"config.json: rope_parameters[{label!r}].rope_type={p['rope_type']!r} is "
                                        "not supported for deepseek_v4 (only 'default' and 'yarn')")
        p.setdefault("partial_rotary_factor", partial)
        if p["rope_type"] == "yarn":
            p.setdefault("original_max_position_embeddings", c.raw.get("max_position_embeddings", 1048576))
        check_rope(p, f"config.json: rope_parameters[{label!r}]")
        if int(head_dim * float(p["partial_rotary_factor"])) != int(head_dim * partial):
            raise UnsupportedModelError(f"config.json: rope_parameters[{label!r}].partial_rotary_factor="
                                        f"{p['partial_rotary_factor']!r} differs from the attention's "
                                        f"{partial!r} (one rope width for every layer kind)")
    return out


# keys transformers ignores, with the value it computes as if they had
_IGNORED = {"num_key_value_heads": (1,), "n_shared_experts": (1,), "norm_topk_prob": (True,),
            "attention_bias": (False,), "mlp_bias": (False,), "topk_method": ("noaux_tc",)}


def parse_config(raw: dict) -> Config:
    c = RawConfig(raw)
    for key, allowed in _IGNORED.items():
        why = ("transformers' DeepSeek-V4 computes as if it were " f"{allowed[0]!r}" if key != "mlp_bias" else
               "the shared expert has no biases in DeepSeek-V4 checkpoints")
        c.refuse(key, allowed, why)
    weights = _weights(raw)
    n = c.layers()
    hidden = c.pos_int("hidden_size")
    heads = c.pos_int("num_attention_heads", hi=MAX_HEADS)
    head_dim = c.pos_int("head_dim", 512, hi=MAX_HEAD_DIM)
    if "partial_rotary_factor" in c:
        partial = number(raw["partial_rotary_factor"], "partial_rotary_factor", positive=True)
    elif "qk_rope_head_dim" in c:
        partial = c.pos_int("qk_rope_head_dim", hi=MAX_HEAD_DIM) / head_dim
    else:
        partial = 64 / 512
    rope_dim = int(head_dim * partial)
    if not 2 <= rope_dim <= head_dim or rope_dim % 2:
        raise UnsupportedModelError(f"config.json: a rope width of {rope_dim} of head_dim={head_dim} "
                                    "(qk_rope_head_dim / partial_rotary_factor) is not supported: expected an even "
                                    "number of dims, at least 2, at most head_dim")
    groups = c.pos_int("o_groups", 8, hi=MAX_HEADS)
    if (heads * head_dim) % groups:
        raise UnsupportedModelError(f"config.json: o_groups={groups} does not divide the attention output "
                                    f"({heads} heads x {head_dim} dims) into equal groups")
    layer_types = _layer_types(c, n)
    mlp_types = _mlp_types(c, n)
    rates = _rates(c)
    index_dim = c.pos_int("index_head_dim", 128, hi=MAX_HEAD_DIM)
    if "compressed_sparse_attention" in layer_types and index_dim < rope_dim:
        raise UnsupportedModelError(f"config.json: index_head_dim={index_dim} is narrower than the "
                                    f"{rope_dim} rope dims the indexer rotates")
    n_experts = c.pos_int("n_routed_experts", 256, "num_local_experts", hi=MAX_EXPERTS)
    scoring = c.str("scoring_func", "sqrtsoftplus")
    if scoring not in SCORINGS:
        raise UnsupportedModelError(f"config.json: scoring_func={scoring!r} is not supported for deepseek_v4 "
                                    f"(supported: {', '.join(SCORINGS)})")
    return Config(
        vocab_size=c.pos_int("vocab_size"),
        hidden_size=hidden,
        moe_intermediate_size=c.pos_int("moe_intermediate_size", 2048, "intermediate_size"),
        num_hidden_layers=n,
        num_attention_heads=heads,
        head_dim=head_dim,
        q_lora_rank=c.pos_int("q_lora_rank", 1024),
        rope_dim=rope_dim,
        o_groups=groups,
        o_lora_rank=c.pos_int("o_lora_rank", 1024),
        sliding_window=c.pos_int("sliding_window", 128, hi=MAX_POSITIONS),
        layer_types=layer_types,
        mlp_layer_types=mlp_types,
        compress_rates=rates,
        index_n_heads=c.pos_int("index_n_heads", 64, hi=MAX_HEADS),
        index_head_dim=index_dim,
        index_topk=c.pos_int("index_topk", 512, hi=MAX_POSITIONS),
        hc_mult=c.pos_int("hc_mult", 4, hi=64),
        hc_sinkhorn_iters=c.pos_int("hc_sinkhorn_iters", 20, hi=1 << 10),
        hc_eps=c.float("hc_eps", 1e-6, positive=True),
        n_routed_experts=n_experts,
        num_experts_per_tok=c.top_k("num_experts_per_tok", n_experts, 6),
        scoring_func=scoring,
        routed_scaling_factor=c.float("routed_scaling_factor", 1.5, positive=True),
        swiglu_limit=c.float("swiglu_limit", 10.0, positive=True),
        hidden_act=c.act(),
        rms_norm_eps=c.eps(1e-6),
        max_position_embeddings=c.pos_int("max_position_embeddings", 1048576, hi=MAX_POSITIONS),
        tie_word_embeddings=c.bool("tie_word_embeddings", False),
        rope=_rope(c, head_dim, partial),
        mtp_layers=c.int("num_nextn_predict_layers", 1, lo=0, hi=MAX_LAYERS),
        weights=weights,
    )


def _weights(raw: dict, where: str = "config.json") -> WeightFormat:
    """The published stored forms (see the module docstring), every other one refused by name."""
    qc, top = raw.get("quantization_config"), raw.get("expert_dtype")
    if qc is None:
        if top is not None:
            raise UnsupportedModelError(f"{where}: expert_dtype={top!r} without a quantization_config is not "
                                        "supported for deepseek_v4 (transformers would read the experts as "
                                        "unquantized; the published FP4 checkpoints declare both)")
        return PLAIN
    if not isinstance(qc, dict):
        raise UnsupportedModelError(f"{where}: quantization_config must be an object, got {qc!r}")
    method = qc.get("quant_method")
    if method != "fp8":
        raise UnsupportedModelError(f"{where}: quantization_config.quant_method={method!r} is not supported for "
                                    "deepseek_v4 (only the published 'fp8': e4m3 with ue8m0 block scales, FP4 or "
                                    "FP8 experts)")
    inner = qc.get("expert_dtype")
    if inner is not None and top is not None and inner != top:
        raise UnsupportedModelError(f"{where}: expert_dtype={top!r} differs from quantization_config.expert_dtype="
                                    f"{inner!r} (transformers reads the latter; which one is meant would be a guess)")
    dtype = inner if inner is not None else top if top is not None else "fp8"
    if dtype not in EXPERT_DTYPES:
        key = "quantization_config.expert_dtype" if inner is not None else "expert_dtype"
        raise UnsupportedModelError(f"{where}: {key}={dtype!r} is not supported for deepseek_v4 (supported: "
                                    f"{', '.join(EXPERT_DTYPES)})")
    scale_fmt = qc.get("scale_fmt", "float")
    if scale_fmt not in SCALE_FMTS:
        raise UnsupportedModelError(f"{where}: quantization_config.scale_fmt={scale_fmt!r} is not supported for "
                                    f"deepseek_v4 (supported: {', '.join(SCALE_FMTS)})")
    if dtype == "fp4" and scale_fmt != "ue8m0":
        raise UnsupportedModelError(f"{where}: quantization_config.scale_fmt={scale_fmt!r} with FP4 experts is not "
                                    "supported (the published FP4 experts carry ue8m0 scales: scale_fmt 'ue8m0')")
    if qc.get("modules_to_not_convert"):
        raise UnsupportedModelError(f"{where}: quantization_config.modules_to_not_convert is not supported for "
                                    "deepseek_v4 (transformers matches it against its own module names, not the "
                                    "published ones; the published checkpoints have none)")
    return WeightFormat(qc, where, scale_tensor=SCALE_TENSOR, keep_plain=KEEP_PLAIN, expert_fp4=dtype == "fp4")


# -- the layers ---------------------------------------------------------------------------------


def _compressor(hidden: int, m: int, dim: int, overlap: bool, eps: float) -> tuple[dict, Callable]:
    w = (2 if overlap else 1) * dim
    tensors = {"wkv": Lin((w, hidden)), "wgate": Lin((w, hidden)), "ape": (m, w), "norm.weight": (dim,)}

    def make(t) -> Compressor:
        return Compressor(t.lin("wkv"), t.lin("wgate"), t("ape"), t("norm.weight"), m=m, dim=dim, overlap=overlap,
                          eps=eps)

    return tensors, make


def attention(cfg: Config, i: int, rotary: Rotary) -> Part:
    """Layer ``i``'s attention at ``attn.`` (published names), and its state per sequence."""
    h, d, nh, qr, eps = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.q_lora_rank, cfg.rms_norm_eps
    g, r = cfg.o_groups, cfg.o_lora_rank
    kind, m = KIND[cfg.layer_types[i]], cfg.rate(i)
    p = "attn."
    # wo_a is read by row blocks (one per output group), so it is a plain tensor, not a ``Lin``
    # ... unless stored in FP8 (``BlockFP8``, multiplied by row ranges)
    fp8_wo_a = cfg.weights.fp8
    wo_a = {p + "wo_a": Lin((g * r, nh * d // g))} if fp8_wo_a else {p + "wo_a.weight": (g * r, nh * d // g)}
    tensors: dict = {p + "wq_a": Lin((qr, h)), p + "q_norm.weight": (qr,), p + "wq_b": Lin((nh * d, qr)),
                     p + "wkv": Lin((d, h)), p + "kv_norm.weight": (d,), **wo_a,
                     p + "wo_b": Lin((h, g * r)), p + "attn_sink": (nh,)}
    comp = index = None
    if kind != "sliding":
        ct, comp = _compressor(h, m, d, kind == "csa", eps)
        tensors.update({p + "compressor." + k: v for k, v in ct.items()})
    if kind == "csa":
        di, hi = cfg.index_head_dim, cfg.index_n_heads
        it, index = _compressor(h, m, di, True, eps)
        tensors.update({p + "indexer.compressor." + k: v for k, v in it.items()})
        tensors.update({p + "indexer.wq_b": Lin((hi * di, qr)), p + "indexer.weights_proj": Lin((hi, h))})

    def make(t):
        indexer = None
        if index is not None:
            indexer = Indexer(index(t.sub(p + "indexer.compressor.")), t.lin(p + "indexer.wq_b"),
                              t.lin(p + "indexer.weights_proj"), heads=cfg.index_n_heads, dim=cfg.index_head_dim,
                              topk=cfg.index_topk)
        return CompressedAttention(
            wq_a=t.lin(p + "wq_a"), q_norm=t(p + "q_norm.weight"), wq_b=t.lin(p + "wq_b"), wkv=t.lin(p + "wkv"),
            kv_norm=t(p + "kv_norm.weight"), wo_a=t.lin(p + "wo_a") if fp8_wo_a else t(p + "wo_a.weight"),
            wo_b=t.lin(p + "wo_b"),
            sinks=t(p + "attn_sink"), n_heads=nh, head_dim=d, window=cfg.sliding_window, groups=g, eps=eps, kind=kind,
            compressor=comp(t.sub(p + "compressor.")) if comp is not None else None, indexer=indexer,
            rotary=rotary)

    # per sequence: rings of the last positions (the window, K = V stored once; the compressors'
    # projections and gates) and the compressed entries, one per m positions
    rings, entries = {WindowKVCache.positions(cfg.sliding_window): 4 * d}, {}
    for dim, on in ((d, kind != "sliding"), (cfg.index_head_dim, kind == "csa")):
        if on:
            n = CompressorState.positions(m, kind == "csa")
            rings[n] = rings.get(n, 0) + 4 * 2 * (2 if kind == "csa" else 1) * dim
            entries[m] = entries.get(m, 0) + 4 * dim
    return Part(tensors, make, entries=entries, rings=rings)


def _shared_expert(hidden: int, inter: int, act: str, limit: float) -> Part:
    names = {"w1": (inter, hidden), "w3": (inter, hidden), "w2": (hidden, inter)}
    return Part({k: Lin(v) for k, v in names.items()},
                lambda t: GatedMLP(t.lin("w1"), t.lin("w3"), t.lin("w2"), act, limit=limit))


def _hash_router(cfg: Config) -> Part:
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    return Part({"weight": (e, cfg.hidden_size), "tid2eid": (cfg.vocab_size, k)},
                lambda t: HashRouter(t("weight"), k, t("tid2eid"), scoring=cfg.scoring_func,
                                     scale=cfg.routed_scaling_factor, name=t.prefix + "tid2eid"))


def _mlp(cfg: Config, i: int) -> Part:
    h = cfg.hidden_size
    if cfg.mlp_layer_types[i] == "hash_moe":
        router = _hash_router(cfg)
    else:
        router = grouped_router(cfg.n_routed_experts, h, cfg.num_experts_per_tok, bias="bias",
                                scoring=cfg.scoring_func, normalize=True, scale=cfg.routed_scaling_factor)
    return moe(router, prefix="ffn.", router_name="gate.",
               shared=_shared_expert(h, cfg.moe_intermediate_size, cfg.hidden_act, cfg.swiglu_limit))


def declare(cfg: Config) -> HyperModel:
    h, eps, n = cfg.hidden_size, cfg.rms_norm_eps, cfg.hc_mult
    main = Rotary(cfg.head_dim, cfg.rope["main"], cfg.max_position_embeddings)
    compress = Rotary(cfg.head_dim, cfg.rope["compress"], cfg.max_position_embeddings)
    of_layer = [0 if t == "sliding_attention" else 1 for t in cfg.layer_types]

    def hc(prefix: str) -> Part:
        return hyper_connection(n, h, iters=cfg.hc_sinkhorn_iters, eps=cfg.hc_eps, norm_eps=eps).nested(prefix)

    layers = [HyperLayer(i, f"layers.{i}.", rms_norm(h, eps), rms_norm(h, eps), hc("hc_attn_"), hc("hc_ffn_"),
                         attention(cfg, i, compress if of_layer[i] else main), _mlp(cfg, i),
                         names={"input_norm": "attn_norm.", "post_norm": "ffn_norm."})
              for i in range(cfg.num_hidden_layers)]
    tables = [f"layers.{i}.ffn.gate.tid2eid" for i, t in enumerate(cfg.mlp_layer_types) if t == "hash_moe"]
    return HyperModel(cfg.vocab_size, h, layers, rms_norm(h, eps), cfg.tie_word_embeddings,
                      lambda: LayerRotary([main, compress], of_layer), streams=n,
                      head_part=hyper_head(n, h, eps=cfg.hc_eps, norm_eps=eps), embed_name="embed.weight",
                      norm_prefix="norm.", head_name="head.weight", hc_head_prefix="hc_head_", tables=tables,
                      weights=cfg.weights)


def describe(cfg: Config) -> ModelDescription:
    spec = ExpertSpec(hidden=cfg.hidden_size, intermediate=cfg.moe_intermediate_size, act=cfg.hidden_act,
                      variant="clamped_silu", limit=cfg.swiglu_limit)
    model = declare(cfg)
    experts = model.routed_experts(spec, EXPERT_MODULE, EXPERT_NAMES)
    kinds = {t: cfg.layer_types.count(t) for t in LAYER_TYPES}
    n_hash = cfg.mlp_layer_types.count("hash_moe")
    notes = [
        f"attention: shared-KV MQA (1 head of {cfg.head_dim} dims, key = value), window {cfg.sliding_window}, "
        f"sinks; {kinds['sliding_attention']} sliding-only, {kinds['compressed_sparse_attention']} CSA (one "
        f"entry per {cfg.compress_rates['compressed_sparse_attention']} positions, indexer top-{cfg.index_topk}), "
        f"{kinds['heavily_compressed_attention']} HCA (one per "
        f"{cfg.compress_rates['heavily_compressed_attention']}) layers",
        f"residual: {cfg.hc_mult} hyper-connection streams (Sinkhorn-Knopp, {cfg.hc_sinkhorn_iters} iterations)",
        f"routing: {cfg.scoring_func} with a correction bias; {n_hash} hash-routed layer(s) (tid2eid, resident)",
        f"experts: SwiGLU clamped at {cfg.swiglu_limit:g}",
    ]
    if cfg.mtp_layers:
        notes.append(f"{cfg.mtp_layers} multi-token-prediction layer(s) (mtp.*) are not used: generation predicts "
                     "one token per step")
    return model.describe(model_type=MODEL_TYPE, n_experts=cfg.n_routed_experts, top_k=cfg.num_experts_per_tok,
                          **experts, max_position_embeddings=cfg.max_position_embeddings,
                          attn_heads=cfg.num_attention_heads, notes=notes)


def build(cfg: Config, w, experts) -> HyperCausalLM:
    return declare(cfg).build(w, experts)


# transformers' save_pretrained writes the published names under ``model.`` with a few of its own
_SAVED_GLOBAL = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
                 "hc_head_fn": "model.hc_head.hc_fn", "hc_head_base": "model.hc_head.hc_base",
                 "hc_head_scale": "model.hc_head.hc_scale"}


def tensor_aliases(cfg: Config) -> dict[str, str]:
    """Where a checkpoint written by transformers' ``save_pretrained`` keeps each published tensor
    (spine and experts)."""
    out = dict(_SAVED_GLOBAL)
    for name in declare(cfg).spine():
        if name.startswith("layers."):
            out[name] = "model." + name.replace(".attn.kv_norm.", ".attn.norm.")
    for layer in cfg.moe_layers:
        for e in range(cfg.n_routed_experts):
            for n in EXPERT_NAMES.values():
                name = EXPERT_TEMPLATE.format(layer=layer, e=e, name=n)
                out[name] = "model." + name
    return out


__all__ = ["Config", "build", "declare", "describe", "parse_config", "tensor_aliases"]
