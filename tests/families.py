"""One registry of tiny, decisive test models per family (imported by conftest and the tests).

Every family has one entry: the overrides of a tiny transformers config that exercises what
the family has (dense layers, sliding windows, grouped routing, linear attention, ...), the
seed that makes its logits and router choices decisive on the suite's prompt (proven by
``assert_decisive_model`` against transformers, for the f32 and the bf16 checkpoint), and an
optional ``post`` that sets weights transformers initializes trivially (norm weights, the
correction bias of grouped routers) so that the engine is proven to apply them. Grouped
routers use top-k >= 4, so the order in which selected experts come back matters.

Native-format sources are built from an entry's f32 checkpoint: DeepSeek-V3, GLM-4.7-Flash and MiniMax-M2 with
block-FP8 linear weights (``to_fp8``), GPT-OSS with MXFP4 experts (``to_mxfp4``) and DeepSeek-V4 as
published, an FP8 spine with ue8m0 scales and FP4 experts (``to_published``). Every family's f32
checkpoint can be stored in the quantized forms of ``STORED`` too (``to_stored``: block FP8, compressed-
tensors FP8 per channel or block, compressed-tensors INT4 experts), each with its dequantized fp32 twin.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

LOGIT_MARGIN = 1e-3  # top-1 minus top-2 logit, far above fp32 error (~1e-6)
ROUTER_MARGIN = 1e-5  # k-th minus (k+1)-th router probability (or biased sigmoid score)

# what every tiny config has unless a family overrides it
BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
            num_local_experts=8, num_experts_per_tok=2, initializer_range=0.2, max_position_embeddings=512,
            bos_token_id=1, eos_token_id=None, pad_token_id=0)


def prompt_ids(n: int = 16, seed: int = 1, vocab: int = 256) -> torch.Tensor:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed))


# The prompt every registry checkpoint is proven decisive on (``FamilyModels.expected``; the
# fidelity matrix's baselines): 8 tokens twice, so n-gram speculation drafts (and rolls back)
# from the first generated tokens on; and how many greedy tokens are compared
PROMPT = torch.cat([prompt_ids()[:8], prompt_ids()[:8]])
N_NEW = 32


def _norms_and_correction_bias(model) -> None:
    """Non-trivial norm weights (each proven applied) and a correction bias that changes
    selections (it selects, never weighs)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
        _correction_bias(model)


def correction_bias(mlp):
    """The ``e_score_correction_bias`` of an MoE block: on its gate (DeepSeek-V3, Kimi), on the
    block itself (MiniMax-M2) or in its gate's ``moe_statics`` (ERNIE-4.5, [1, E]); None for
    other routers."""
    gate = getattr(mlp, "gate", None)
    for owner in (gate, mlp, getattr(gate, "moe_statics", None)):
        bias = getattr(owner, "e_score_correction_bias", None)
        if isinstance(bias, torch.Tensor):
            return bias
    return None


SOFTMAX_BIASED = ("ernie4_5_moe",)  # a correction bias added to softmax probabilities (not sigmoid scores)


def _biased_scores(cfg, router_logits: torch.Tensor) -> torch.Tensor:
    """[T, E] the scores a router with a correction bias adds its bias to."""
    rl = router_logits.float().reshape(-1, router_logits.shape[-1])
    if cfg.model_type == "deepseek_v4":  # sqrtsoftplus scores
        return torch.nn.functional.softplus(rl).sqrt()
    return torch.softmax(rl, -1) if cfg.model_type in SOFTMAX_BIASED else torch.sigmoid(rl)


def _norms_biases_and_correction_bias(model) -> None:
    """As ``_norms_and_correction_bias``, and every linear bias random (transformers zeroes them)."""
    _norms_and_correction_bias(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("proj.bias") or name == "lm_head.bias":
                p.copy_(0.1 * torch.randn_like(p))


def _v4_weights(model) -> None:
    """DeepSeek-V4: random norm weights and correction biases, and what transformers initializes
    trivially (sinks, the compressors' position biases, the hyper-connections' biases and scales)
    or degenerately (``tid2eid`` all zeros: every token to expert 0 twice): each token's hash
    experts distinct and random."""
    _norms_and_correction_bias(model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("position_bias", "sinks", "base")):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith("scale"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
        for layer in model.model.layers:
            gate = layer.mlp.gate
            if hasattr(gate, "tid2eid"):
                n = gate.tid2eid.shape[0]
                gate.tid2eid.copy_(torch.stack([torch.randperm(gate.num_experts, generator=g)[:gate.top_k]
                                                for _ in range(n)]))
def _glm5_next_weights(model) -> None:
    """GLM-5.3-Flash: random norm weights (the indexer's LayerNorm bias too) and correction bias, and
    what transformers initializes trivially: the hyper-connections' biases and scales, the KDA decay
    rates (``A_log`` zeros), the indexer's pool position bias (zeros) and pooling gate (ones)."""
    _norms_and_correction_bias(model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.model.language_model.named_parameters():
            if name.endswith(("hc.base", "A_log", "index_kpool_compress_ape")):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith("hc.scale"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("index_kpool_compress_gate"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))


def _norms_and_ple_conv(model) -> None:
    """Random norm weights and PLE convolutions (transformers zeroes the latter)."""
    _norms_and_correction_bias(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("ple.conv1d.weight"):
                p.copy_(0.5 * torch.randn_like(p))


def _correction_bias(model) -> None:
    inner = getattr(model.model, "language_model", model.model)  # a multimodal wrapper's text model
    with torch.no_grad():
        for layer in inner.layers:
            bias = correction_bias(layer.mlp)
            if bias is not None:
                bias.copy_(0.3 * torch.randn_like(bias))


@dataclass(frozen=True)
class Family:
    model_type: str
    overrides: dict = field(default_factory=dict)
    seed: int = 0
    post: Callable | None = None  # model -> None, after from_config (seeded), before saving
    native: str | None = None  # a native quantized source format built from the f32 checkpoint
    # a multimodal wrapper (as the family's checkpoints are published): its own config keys; the
    # text model's config (BASE, overrides) is its text_config and the checkpoint is saved from
    # the image-text model, whose text weights transformers' causal LM reads (the reference)
    wrapper: dict | None = None

    def config(self, **extra):
        from transformers import AutoConfig

        text = {**BASE, **copy.deepcopy(self.overrides), **extra}
        if self.wrapper is None:
            return AutoConfig.for_model(self.model_type, **text)
        return AutoConfig.for_model(self.model_type, text_config=text, initializer_range=text["initializer_range"],
                                    **copy.deepcopy(self.wrapper))

    @property
    def top_k(self) -> int:
        return self.overrides.get("num_experts_per_tok", BASE["num_experts_per_tok"])


REGISTRY: dict[str, Family] = {
    # a dense (mlp-only) layer, normalized top-k weights
    "qwen3_moe": Family("qwen3_moe", dict(mlp_only_layers=[1], norm_topk_prob=True)),
    # sliding-window attention shorter than the prompt
    "mixtral": Family("mixtral", dict(sliding_window=8)),
    # q/k/v clipping
    "olmoe": Family("olmoe", dict(clip_qkv=2.0)),
    # linear, full, linear attention; GQA in both kinds; layer 2 dense; partial rotary (0.25)
    "qwen3_next": Family("qwen3_next", dict(
        layer_types=["linear_attention", "full_attention", "linear_attention"], linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        shared_expert_intermediate_size=48, mlp_only_layers=[2]), seed=1),
    # KDA, MLA, KDA; layer 0 dense; 16 experts in 4 groups, 2 kept, top-4; correction bias
    "kimi_linear": Family("kimi_linear", dict(
        layer_types=["linear_attention", "full_attention", "linear_attention"], linear_num_heads=4,
        linear_head_dim=16, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        num_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, num_key_value_heads=4,
        routed_scaling_factor=2.446), seed=0, post=_correction_bias),
    # MLA with q low-rank; 16 experts in 4 groups, 2 kept, top-4; one leading dense layer; a
    # shared expert; random norm weights and correction bias
    "deepseek_v3": Family("deepseek_v3", dict(
        num_key_value_heads=4, head_dim=8, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
        first_k_dense_replace=1, kv_lora_rank=40, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, n_shared_experts=1, routed_scaling_factor=2.5), seed=1, post=_norms_and_correction_bias,
        native="fp8"),
    # sliding (window 4), full, sliding; yarn with truncate=False and factor 32 as GPT-OSS has
    "gpt_oss": Family("gpt_oss", dict(
        intermediate_size=32, sliding_window=4, max_position_embeddings=2048,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64}),
        seed=1, native="mxfp4"),
    # every layer MoE; q/k norm over the whole projection; partial RoPE (rotary_dim 8 of 16);
    # sigmoid + correction bias on the MoE block, top-4 of 8 without groups; random norm weights
    # and correction bias; block-FP8 attention and experts as the checkpoints ship them
    "minimax_m2": Family("minimax_m2", dict(intermediate_size=32, rotary_dim=8, num_experts_per_tok=4),
                         seed=0, post=_norms_and_correction_bias, native="fp8"),
    # full, sliding (window 5, twice the key/value heads, learned sinks), sliding; layer 0 dense;
    # q/k heads 16 dims, v heads 8, values scaled by 0.6; partial RoPE with its own theta and
    # factor per layer kind; 16 experts in 4 groups, 2 kept, top-4, scaled; random norm weights
    # and correction bias; block-FP8 linears as the checkpoints ship them
    "mimo_v2_flash": Family("mimo_v2_flash", dict(
        intermediate_size=48, v_head_dim=8, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
        routed_scaling_factor=2.0, sliding_window=5, attention_value_scale=0.6,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 0.25}}),
        seed=0, post=_norms_and_correction_bias, native="fp8"),
    # GQA with q/k/v biases and per-head q/k norm; partial RoPE (transformers' default 0.5: 8 of
    # 16 dims); one leading dense layer; 16 experts in 4 groups, 2 kept, top-4, scaled; a shared
    # expert; random norm weights and correction bias; block-FP8 attention, MLPs and experts
    "glm4_moe": Family("glm4_moe", dict(
        n_routed_experts=16, num_local_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
        first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5, attention_bias=True,
        use_qk_norm=True), seed=0, post=_norms_and_correction_bias, native="fp8"),
    # GPT-J RoPE; layers 1 and 3 MoE (start 1, end 3, interval 2), 0 and 2 dense; softmax +
    # correction bias ([1, E] in moe_statics), top-4 of 8, the renormalisation clamped at
    # moe_norm_min 0.8 (above some sums); one shared expert; use_bias (attention, dense and
    # shared MLPs, the tied head) with random biases, norm weights and correction bias
    "ernie4_5_moe": Family("ernie4_5_moe", dict(
        num_hidden_layers=4, moe_layer_start_index=1, moe_layer_end_index=3, moe_layer_interval=2,
        num_experts_per_tok=4, moe_num_shared_experts=1, moe_norm_min=0.8, use_bias=True),
        seed=0, post=_norms_biases_and_correction_bias),
    # full, full, sliding (window 8, max_window_layers 2); layer 0 dense; 16 experts in 4 groups,
    # 2 kept, top-4, renormalised and scaled by 2.5; two shared experts; random norm weights
    # (q/k norms per head) and correction bias
    "dots1": Family("dots1", dict(
        n_routed_experts=16, num_local_experts=16, num_experts=16, num_experts_per_tok=4, n_group=4,
        topk_group=2, first_k_dense_replace=1, n_shared_experts=2, norm_topk_prob=True, routed_scaling_factor=2.5,
        sliding_window=8, max_window_layers=2), seed=0, post=_norms_and_correction_bias),
    # every layer MoE with an always-on shared MLP; q/k norm per head AFTER RoPE (random norm
    # weights); NTK-alpha RoPE as the checkpoints label it ("dynamic" with an alpha); q/k/v/o
    # biases; softmax top-4 of 8 renormalised
    "hunyuan_v1_moe": Family("hunyuan_v1_moe", dict(
        intermediate_size=32, moe_intermediate_size=32, num_experts_per_tok=4, attention_bias=True,
        rope_parameters={"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0}),
        seed=1, post=_norms_and_correction_bias),
    # the published multimodal wrapper (text under model.language_model., a tiny vision tower
    # never read); linear, full, linear attention with split GDN projections, GQA in both kinds
    # (2 key / 4 value heads); every layer MoE with a sigmoid-gated shared expert, top-4 of 8;
    # partial rotary 0.5 with interleaved MRoPE sections; random norm weights
    "qwen3_5_moe": Family("qwen3_5_moe", dict(
        layer_types=["linear_attention", "full_attention", "linear_attention"], linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        shared_expert_intermediate_size=48, num_experts_per_tok=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True}),
        seed=6, post=_norms_and_correction_bias, wrapper=dict(vision_config=dict(
            depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=64, patch_size=4,
            num_position_embeddings=16))),
    # GLM-4.7-Flash: MLA with q low-rank and v_head_dim > qk_nope_head_dim (its 192/64/256 scaled
    # down); mlp_layer_types sparse, dense, sparse; top-4 of 16 in one group, scaled 1.8; a shared
    # expert; random norm weights and correction bias; block-FP8 linears as the FP8 checkpoint ships
    "glm4_moe_lite": Family("glm4_moe_lite", dict(
        num_key_value_heads=4, head_dim=4, n_routed_experts=16, num_experts_per_tok=4, n_group=1, topk_group=1,
        mlp_layer_types=["sparse", "dense", "sparse"], kv_lora_rank=40, q_lora_rank=48, qk_rope_head_dim=4,
        qk_nope_head_dim=12, v_head_dim=16, n_shared_experts=1, routed_scaling_factor=1.8), seed=0,
        post=_norms_and_correction_bias, native="fp8"),
    # layer 0 dense, 1-2 MoE; q/k/v/o biases; per-head q/k norm; sigmoid + correction bias on the
    # MoE block (checkpoint ``mlp.expert_bias``), top-4 of 8 without groups, scaled by 2.826; two
    # shared experts' width; random norm weights and correction bias; block-FP8 linears
    "hy_v3": Family("hy_v3", dict(num_experts_per_tok=4, num_shared_experts=2, attention_bias=True),
                    seed=0, post=_norms_and_correction_bias, native="fp8"),
    # sliding, CSA, HCA, CSA attention (window 6; CSA one entry per 4 positions, the indexer keeping
    # 3 of them; HCA one per 10): the suite's 16 + 32 positions pass the window, 4 HCA and 12 CSA
    # entries; shared-KV MQA of 32 dims, 8 rope dims; grouped output projection (2 x 16); 4
    # hyper-connection streams; MoE layers 0 and 3 sqrtsoftplus + correction bias top-4 of 8, 1
    # and 2 hash-routed; clamped SwiGLU (limit 1.5, reached); random norms, sinks, biases, tables
    "deepseek_v4": Family("deepseek_v4", dict(
        num_key_value_heads=1, head_dim=32, q_lora_rank=24, partial_rotary_factor=0.25, o_groups=2, o_lora_rank=16,
        moe_intermediate_size=32, intermediate_size=32, n_routed_experts=8, num_experts_per_tok=4,
        index_n_heads=8, index_head_dim=16, index_topk=3, sliding_window=6, swiglu_limit=1.5,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 10},
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                     "compressed_sparse_attention"], mlp_layer_types=["moe", "hash_moe", "hash_moe", "moe"],
        num_hidden_layers=4), seed=0, post=_v4_weights, native="fp4"),
    # DeepSeek sparse attention (MLA over the index_topk=8 positions a 16-head indexer selects: the
    # 16-token prompt crosses it, prompt + generation is 6 times it); layer 0 dense; 16 experts in 4
    # groups, 2 kept, top-4; random norm weights (the indexer's LayerNorm weight and bias too)
    "deepseek_v32": Family("deepseek_v32", dict(
        num_key_value_heads=4, n_routed_experts=16, num_experts=16, num_local_experts=16, num_experts_per_tok=4,
        n_group=4, topk_group=2, first_k_dense_replace=1, kv_lora_rank=40, q_lora_rank=48, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, index_topk=8, index_n_heads=16, index_head_dim=16), seed=5,
        post=_norms_and_correction_bias),
    # GLM-5: DSA with interleaved indexer RoPE and indexer_types full, shared (layer 0's selection
    # reused), full; index_topk=18, crossed during generation (speculative drafts verified across it);
    # mlp_layer_types sparse, dense, sparse; top-4 of 16 in one group, scaled 1.8
    "glm_moe_dsa": Family("glm_moe_dsa", dict(
        num_key_value_heads=4, n_routed_experts=16, num_experts=16, num_local_experts=16, num_experts_per_tok=4,
        n_group=1, topk_group=1, mlp_layer_types=["sparse", "dense", "sparse"], kv_lora_rank=40, q_lora_rank=48,
        qk_rope_head_dim=4, qk_nope_head_dim=12, v_head_dim=16, routed_scaling_factor=1.8, index_topk=18,
        index_n_heads=16, index_head_dim=16, indexer_types=["full", "shared", "full"]), seed=2,
        post=_norms_and_correction_bias),
    # Qwen3.8-Flash-Next, the published wrapper: GDN with PLE, QSA attention (budget 8 = 2 blocks of
    # 4, crossed from position 11), GDN with PLE; 3 gated residual streams of rank 8; EOS = the
    # prompt's 4th token (its 16 tokens are 4 EOS-separated segments); PLE tables of 416 rows in 12 pieces
    "qwen4_exp": Family("qwen4_exp", dict(
        layer_types=["linear_attention", "indexed_attention", "linear_attention"], linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, shared_expert_intermediate_size=48,
        num_experts_per_tok=4, eos_token_id=157, hc_count=3, hc_lowrank=8, ple_layer_ids=[1, 3], ple_embed_dim=32,
        heads_per_ngram=2, ngram_vocab_size_base=97, make_ngram_vocab_size_divisible_by=16, split_ngram_parts=12,
        indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True}),
        seed=0, post=_norms_and_ple_conv, wrapper=dict(vision_config=dict(
            depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=64, patch_size=4,
            num_position_embeddings=16))),
    # GLM-5.3-Flash, the published wrapper: KDA (bounded forget gate), MLA without RoPE with DSA over pools
    # of 4 (index_topk 8: 2 pools kept, crossed from position 11; prompt + generation 6 times it), MLA
    # reusing that selection, KDA; layer 0 dense; top-4 of 8; 4 hyper-connection streams; clamped SwiGLU
    "glm5_next": Family("glm5_next", dict(
        num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=4, kv_lora_rank=32, q_lora_rank=48,
        qk_rope_head_dim=0, qk_nope_head_dim=16, v_head_dim=16, index_topk=8, index_kpool=4, index_n_heads=8,
        index_head_dim=16, linear_head_dim=16, linear_num_heads=4, swiglu_limit=1.5, num_hidden_layers=4,
        layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
        indexer_types=["full", "full", "shared", "full"], mlp_layer_types=["dense", "sparse", "sparse", "sparse"]),
        seed=0, post=_glm5_next_weights, wrapper=dict(vision_config=dict(
            depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=64, patch_size=4))),
}
FAMILY_NAMES = list(REGISTRY)


def describe(family: str, **extra):
    """The engine's ``ModelDescription`` of ``family``'s tiny config (what its declaration derives)."""
    from sluice.models import get_family

    mod = get_family(family)
    return mod.describe(mod.parse_config(REGISTRY[family].config(**extra).to_dict()))


def recurrent(family: str) -> bool:
    """``family`` has linear-attention layers (a fixed-size recurrent state), from its declaration."""
    return describe(family).state_bytes_fixed > 0


def save_family(path: Path, family: str, dtype=torch.float32, seed: int | None = None, **extra) -> Path:
    """Save ``family``'s tiny checkpoint (its registry seed unless given) as ``dtype``."""
    from transformers import AutoModelForCausalLM

    fam = REGISTRY[family]
    torch.manual_seed(fam.seed if seed is None else seed)
    if fam.wrapper is not None:
        from transformers import AutoModelForImageTextToText as AutoModelForCausalLM  # noqa: N814
    model = AutoModelForCausalLM.from_config(fam.config(**extra)).eval()
    if fam.post is not None:
        fam.post(model)
    model.to(dtype).save_pretrained(path)
    return path


def reference(path: Path, dtype=torch.float32, **kwargs):
    """transformers model on the checkpoint's weights upcast to fp32 (or ``dtype``; ``kwargs`` to
    ``from_pretrained``; the image-text model of a wrapper transformers has no causal LM for:
    GLM-5.3-Flash)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    known = type(AutoConfig.from_pretrained(path)) in AutoModelForCausalLM._model_mapping
    cls = AutoModelForCausalLM if known else AutoModelForImageTextToText
    return cls.from_pretrained(path, dtype=dtype, **kwargs).eval()


def text_layers(ref):
    """The decoder layers of a transformers model (a multimodal wrapper's text model's)."""
    return getattr(ref.model, "language_model", ref.model).layers


def selection_scores(ref, router_logits: torch.Tensor, moe_layer: int) -> torch.Tensor:
    """[T, E] scores transformers selects the experts of its ``moe_layer``-th MoE layer by:
    softmax probabilities, or (grouped routers, with a correction bias) the biased sigmoid
    scores with the experts of groups not kept at -inf."""
    cfg = ref.config.get_text_config()  # a wrapper: its text model's
    rl = router_logits.float().reshape(-1, router_logits.shape[-1])
    biases = [b for b in (correction_bias(layer.mlp) for layer in text_layers(ref)) if b is not None]
    if not biases:
        return torch.softmax(rl, -1)
    s = _biased_scores(cfg, rl) + biases[moe_layer].float().reshape(-1)
    t, e = s.shape
    g, tg = getattr(cfg, "n_group", None) or 1, getattr(cfg, "topk_group", None) or 1
    if g == 1:
        return s
    gs = s.view(t, g, e // g).topk(2, dim=-1).values.sum(-1)
    keep = torch.zeros(t, g, dtype=torch.bool).scatter_(1, gs.topk(tg, dim=-1).indices, True)
    return s.masked_fill(~keep[:, :, None].expand(t, g, e // g).reshape(t, e), float("-inf"))


def assert_decisive_model(ref, ids: torch.Tensor, first: int) -> None:
    """A clear top-1 logit from ``first`` on, and clear router choices at every position under
    the model's own selection rule (``selection_scores``): the k-th and (k+1)-th scores apart,
    and for grouped routers the kept groups and the rank of every selected expert too."""
    cfg = ref.config.get_text_config()  # a wrapper: its text model's
    k = cfg.num_experts_per_tok
    with torch.no_grad():
        out = ref(ids[None], output_router_logits=True)
    top = out.logits[0, first:].topk(2, dim=-1).values
    margin = (top[:, 0] - top[:, 1]).min().item()
    assert margin > LOGIT_MARGIN, f"top-1/top-2 logit margin {margin:.2e} is a near-tie: pick another seed"
    grouped = correction_bias(text_layers(ref)[-1].mlp) is not None  # scores + bias (groups or not)
    n_group, topk_group = getattr(cfg, "n_group", None) or 1, getattr(cfg, "topk_group", None) or 1
    for layer, rl in enumerate(out.router_logits or ()):
        if grouped and topk_group < n_group:
            s = torch.sigmoid(rl.float().reshape(-1, rl.shape[-1]))
            biases = [b for b in (correction_bias(x.mlp) for x in text_layers(ref)) if b is not None]
            s = s + biases[layer].float()
            t, e = s.shape
            gs = s.view(t, n_group, -1).topk(2, dim=-1).values.sum(-1).topk(topk_group + 1, dim=-1).values
            gm = (gs[:, -2] - gs[:, -1]).min().item()
            assert gm > ROUTER_MARGIN, f"group margin {gm:.2e} in MoE layer {layer}: pick another seed"
        v = selection_scores(ref, rl, layer).topk(k + 1, dim=-1).values
        # grouped: every selected expert's rank is clear too (moe_top_k < k keeps the first ones)
        gaps = (v[:, :-1] - v[:, 1:]).min().item() if grouped else (v[:, k - 1] - v[:, k]).min().item()
        assert gaps > ROUTER_MARGIN, f"router margin {gaps:.2e} in MoE layer {layer} is a near-tie: pick another seed"


# -- stored (quantized) formats --------------------------------------------------------------
#
# Written here from the formats' descriptions, independently of sluice.quant: the quantized
# checkpoint and its twin, the same model with the quantized weights dequantized to fp32 (the
# model the checkpoint stands for, which transformers runs as the reference).

FP8_BLOCK = (16, 16)  # small blocks so tiny matrices span several of them
E4M3_MAX = 448.0
EXPERT_MATRIX = re.compile(r"\.experts\.\d+\.[^.]+\.weight$")  # a routed expert's matrix, one per expert
ROUTER = re.compile(r"\.gate(\.wg)?\.weight$")  # routers stay plain in every released quantized checkpoint
STORED = ("fp8", "ct-fp8", "ct-fp8-block", "int4")  # block FP8; compressed-tensors FP8 per channel / block; INT4
# linears outside the decoder layers that transformers' FP8 integration converts (the head aside):
# qwen4_exp's final stream mixer; no other family of the registry has one
OUTSIDE_LAYERS = re.compile(r"\.hyper_connection_mixer\.")


def _linear_leaves(src: Path) -> set[str]:
    """The last name of every linear module (``nn.Linear``) of transformers' model of ``src``: what
    its FP8 integration converts (the head and the model's ``_keep_in_fp32_modules`` aside: DSA's
    ``indexer.weights_proj``)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    cfg = AutoConfig.from_pretrained(src)
    cls = AutoModelForImageTextToText if hasattr(cfg, "vision_config") else AutoModelForCausalLM
    with torch.device("meta"):
        model = cls.from_config(cfg)
    kept = getattr(model, "_keep_in_fp32_modules", None) or []
    return {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"
            and not any(k in n for k in kept)}


def e4m3_quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (e4m3 [N, K], fp32 scales [ceil(N/bn), ceil(K/bk)]): each block's amax maps to 448."""
    n, k = w.shape
    bn, bk = block
    sn, sk = -(-n // bn), -(-k // bk)
    pad = torch.zeros(sn * bn, sk * bk)
    pad[:n, :k] = w.float()
    amax = pad.view(sn, bn, sk, bk).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    return (w.float() / e4m3_expand(scale, block, n, k)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def e4m3_expand(scale: torch.Tensor, block: tuple[int, int], n: int, k: int) -> torch.Tensor:
    """Block scales [ceil(N/bn), ceil(K/bk)] -> one per element [N, K] (element (r, c): scale[r // bn, c // bk])."""
    return scale.float()[torch.arange(n) // block[0]][:, torch.arange(k) // block[1]]


def e4m3_dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """W[r, c] = float(q[r, c]) * scale[r // bn, c // bk], in fp32 (exact: 4 x 8 significant bits)."""
    return q.float() * e4m3_expand(scale, block, *q.shape)


def int4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] -> (levels int8 in -8..7, bf16 scales [N, K/32], the exact fp32 dequantization)."""
    n, k = w.shape
    g = w.float().reshape(n, k // 32, 32)
    scale = (g.abs().amax(-1) / 7).to(torch.bfloat16)
    levels = (g / scale.float()[..., None]).round().clamp(-8, 7)
    deq = (levels.double() * scale.double()[..., None]).float().reshape(n, k)
    return levels.reshape(n, k).to(torch.int8), scale, deq


def int4_pack(levels: torch.Tensor) -> torch.Tensor:
    """levels [N, K] -> int32 [N, K/8]: element 8j + i's code (level + 8) in bits 4i..4i+3 of word j."""
    n, k = levels.shape
    codes = (levels.to(torch.int64) + 8).reshape(n, k // 8, 8)
    word = torch.zeros(n, k // 8, dtype=torch.int64)
    for i in range(8):
        word |= codes[..., i] << (4 * i)
    return torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)


_INT4_WEIGHTS = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32,
                 "dynamic": False, "actorder": None, "observer": "minmax"}


def _stored_config(kind: str, block, routers: list[str]) -> dict:
    if kind == "fp8":
        qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
        return {**qc, "modules_to_not_convert": routers} if routers else qc
    ct = {"quant_method": "compressed-tensors", "quantization_status": "compressed", "kv_cache_scheme": None,
          "sparsity_config": {}, "ignore": ["lm_head", *routers]}
    if kind == "int4":  # the routed experts only, named by a pattern
        group = {"targets": [r"re:.*\.experts\.\d+\..*"], "input_activations": None, "output_activations": None,
                 "weights": _INT4_WEIGHTS}
        return {**ct, "format": "pack-quantized", "config_groups": {"group_0": group}}
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "group_size": None,
               "actorder": None, "observer": "minmax", "strategy": "block" if kind == "ct-fp8-block" else "channel",
               "block_structure": list(block) if kind == "ct-fp8-block" else None}
    acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token"}  # GLM-4.5-FP8's
    group = {"targets": ["Linear"], "input_activations": acts, "output_activations": None, "weights": weights}
    return {**ct, "format": "float-quantized", "config_groups": {"group_0": group}}


def to_stored(src: Path, dst: Path, ref: Path, kind: str, block=FP8_BLOCK,
              plain: re.Pattern | None = None) -> tuple[Path, Path]:
    """``src`` (an f32 checkpoint) stored as ``kind`` (one of ``STORED``) in ``dst``, and its twin
    ``ref``: the FP8 kinds quantize every linear transformers' FP8 integration converts (the
    routers aside, listed as kept plain, and the modules ``plain`` finds, listed as well) and every
    routed expert; ``int4`` the routed experts."""
    from safetensors.torch import load_file, save_file

    block = tuple(block)
    leaves = _linear_leaves(src)
    q, deq, routers = {}, {}, []
    for name, t in load_file(src / "model.safetensors").items():
        module = name[: -len(".weight")]
        linear = name.endswith(".weight") and t.dim() == 2 and (".layers." in name or OUTSIDE_LAYERS.search(name)) \
            and "visual" not in name and module.rsplit(".", 1)[-1] in leaves
        if linear and (ROUTER.search(name) or (plain is not None and plain.search(module))):
            routers.append(module)
            linear = False
        expert = EXPERT_MATRIX.search(name) is not None and t.dim() == 2
        if kind == "int4" and expert:
            levels, scale, deq[name] = int4_quantize(t)
            q[module + ".weight_packed"], q[module + ".weight_scale"] = int4_pack(levels), scale
            q[module + ".weight_shape"] = torch.tensor(list(t.shape), dtype=torch.int64)
        elif kind != "int4" and (expert or linear):
            b = (1, t.shape[1]) if kind == "ct-fp8" else block  # per channel: one row as wide as the row
            w, s = e4m3_quantize(t, b)
            if kind == "ct-fp8":  # llm-compressor stores channel scales [N, 1] in the model's dtype
                s = s.to(torch.bfloat16)
                w = (t.float() / s.float()).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
            q[name], q[name + ("_scale_inv" if kind == "fp8" else "_scale")] = w, s
            deq[name] = e4m3_dequantize(w, s, b)
        else:
            q[name] = deq[name] = t
    cfg = json.loads((src / "config.json").read_text())
    for d, data, qc in ((dst, q, True), (ref, deq, False)):
        d.mkdir(parents=True, exist_ok=True)
        save_file(data, d / "model.safetensors", metadata={"format": "pt"})
        c = dict(cfg)
        if qc:
            c["quantization_config"] = _stored_config(kind, block, routers)
        (d / "config.json").write_text(json.dumps(c, indent=1))
    return dst, ref


def to_fp8(src: Path, dst: Path, ref: Path, block=FP8_BLOCK) -> tuple[Path, Path]:
    """``src`` with its linear weights in block FP8 (``dst``) and its dequantized fp32 twin (``ref``)."""
    return to_stored(src, dst, ref, "fp8", block)


_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., out, in] -> (blocks u8 [..., out, in/32, 16], scales u8 [..., out, in/32]) as GPT-OSS
    checkpoints store them: E2M1 codes (bit 3 the sign), element 2i in the low nibble of byte i,
    E8M0 scales biased by 127. Written here independently of Sluice's own quantizer."""
    *lead, n, k = w.shape
    g = w.float().reshape(*lead, n, k // 32, 32)
    amax = g.abs().amax(-1)
    e = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.zeros_like(amax)).clamp(-127, 127)
    q = g / torch.exp2(e)[..., None]
    idx = (q.abs()[..., None] - _E2M1).abs().argmin(-1)
    code = (idx | ((q < 0) & (idx > 0)).long() << 3).to(torch.uint8)
    return (code[..., 0::2] | (code[..., 1::2] << 4)).contiguous(), (e + 127).to(torch.uint8)


def to_mxfp4(src: Path, dst: Path) -> tuple[Path, dict]:
    """A real-layout MXFP4 GPT-OSS checkpoint of ``src`` (experts as blocks/scales, everything
    else bf16); transformers dequantizes it itself on CPU (the reference)."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True)
    tensors = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [E, in, out] -> [E, out, in]
            tensors[name + "_blocks"], tensors[name + "_scales"] = mxfp4_quantize(t.transpose(1, 2))
        else:
            tensors[name] = t.to(torch.bfloat16)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    cfg["dtype"] = "bfloat16"
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return dst, tensors


# DeepSeek-V4 as published: an FP8 spine with ue8m0 (power-of-two) block scales ``<module>.scale``
# and FP4 routed experts (e2m1 two per byte, one ue8m0 scale per 32 inputs), written here from
# the format (tests/models/test_deepseek_v4_fp4.py checks it against transformers' readings).
V4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E8M0 = torch.float8_e8m0fnu
V4_BLOCK = [16, 16]  # small blocks so the tiny matrices span several (the published: [128, 128])
V4_QC = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0"}
V4_EXPERT = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
# the linears transformers' FP8 integration converts (its nn.Linear modules less the head and
# DeepseekV4's _keep_in_fp32_modules), by their published names
V4_FP8_LINEAR = re.compile(r"\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)\.weight$"
                           r"|\.shared_experts\.w[123]\.weight$")


def fp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (int8 [N, K/2], e8m0 [N, K/32]): per 32 inputs the power of two 2^e with
    e = ceil(log2(amax / 6)), codes the nearest V4_E2M1 value (bit 3 the sign), element 2i in the
    low nibble of byte i."""
    n, k = w.shape
    g = w.float().reshape(n, k // 32, 32)
    amax = g.abs().amax(-1)
    e = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.zeros_like(amax)).clamp(-127, 127)
    q = g / torch.exp2(e)[..., None]
    mags = torch.tensor(V4_E2M1[:8])
    idx = (q.abs()[..., None] - mags).abs().argmin(-1)
    code = (idx | ((q < 0) & (idx > 0)).long() << 3).reshape(n, k).to(torch.uint8)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    return packed.view(torch.int8).contiguous(), (e + 127).to(torch.uint8).view(E8M0)


def fp4_dequantize(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """W[n, k] = V4_E2M1(nibble k of row n) * 2^(e[n, k // 32] - 127), in fp32 (exact)."""
    u8 = packed.view(torch.uint8).long()
    codes = torch.stack((u8 & 15, u8 >> 4), dim=-1).flatten(-2)
    exps = scale.view(torch.uint8).long() - 127
    return torch.tensor(V4_E2M1)[codes] * torch.exp2(exps.float()).repeat_interleave(32, dim=-1)


def fp8_quantize(w: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (e4m3 [N, K], e8m0 [ceil(N/bn), ceil(K/bk)]): each block divided by the power of
    two 2^ceil(log2(amax / 448)), as transformers' ue8m0 quantizer rounds its scales."""
    n, k = w.shape
    bn, bk = block
    sn, sk = -(-n // bn), -(-k // bk)
    pad = torch.zeros(sn * bn, sk * bk)
    pad[:n, :k] = w.float()
    amax = pad.view(sn, bn, sk, bk).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(amax / 448.0))), torch.ones_like(amax))
    full = scale[torch.arange(n) // bn][:, torch.arange(k) // bk]
    return (w.float() / full).clamp(-448, 448).to(torch.float8_e4m3fn), scale.to(E8M0)


def fp8_dequantize(q: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    n, k = q.shape
    return q.float() * scale.float()[torch.arange(n) // block[0]][:, torch.arange(k) // block[1]]


def to_published(src: Path, dst: Path, twin: Path, block=V4_BLOCK, expert_dtype: str = "fp4") -> tuple[Path, Path]:
    """``src`` (a transformers-saved V4 checkpoint) in the published form and names (``dst``) and
    its twin (``twin``, transformers' names, every quantized tensor exactly dequantized to fp32)."""
    from safetensors.torch import load_file, save_file

    from sluice.models import get_family

    v4 = get_family("deepseek_v4")
    cfg = json.loads((src / "config.json").read_text())
    published = {saved: name for name, saved in v4.tensor_aliases(v4.parse_config(cfg)).items()}
    q, deq = {}, {}
    for saved, t in load_file(src / "model.safetensors").items():
        name = published.get(saved, saved)
        module = name[: -len(".weight")]
        if V4_EXPERT.search(name) and expert_dtype == "fp4":
            q[name], q[module + ".scale"] = fp4_quantize(t)
            deq[saved] = fp4_dequantize(q[name], q[module + ".scale"])
        elif V4_EXPERT.search(name) or V4_FP8_LINEAR.search(name):
            q[name], q[module + ".scale"] = fp8_quantize(t, block)
            deq[saved] = fp8_dequantize(q[name], q[module + ".scale"], block)
        else:
            q[name], deq[saved] = t, t.float()
    for d, data, extra in ((dst, q, True), (twin, deq, False)):
        d.mkdir(parents=True, exist_ok=True)
        save_file(data, d / "model.safetensors", metadata={"format": "pt"})
        c = dict(cfg)
        if extra:  # as the published config.json: expert_dtype beside the quantization_config
            c.update(quantization_config={**V4_QC, "weight_block_size": list(block)}, expert_dtype=expert_dtype)
        (d / "config.json").write_text(json.dumps(c, indent=1))
    return dst, twin


# -- built once per session -----------------------------------------------------------------

KINDS = ("f32", "bf16")  # every family; plus its native format, if it has one
# kind -> (dtype, config overrides) of the plain checkpoints. "bf16-std": transformers' usual
# initializer scale (0.02) instead of the suite's 0.2, whose logits are decisive but so chaotic
# that any 4-bit perturbation of the experts flips most top-1 choices (the quantized containers'
# agreement is measured on it; format quality on a trained model is in docs/quantization.md)
PLAIN = {"f32": (torch.float32, {}), "bf16": (torch.bfloat16, {}),
         "bf16-std": (torch.bfloat16, dict(initializer_range=0.02))}


def kinds(family: str) -> tuple[str, ...]:
    native = REGISTRY[family].native
    return KINDS + ((native,) if native else ())


class FamilyModels:
    """Checkpoints and containers of the registry, built on first use and kept for the session.

    ``hf(family, kind)``: the Hugging Face directory (kind ``f32``, ``bf16`` or the family's
    native format); ``reference_path``: what transformers runs as the reference for it (the
    fp32-dequantized twin of an FP8 checkpoint); ``transformers`` and ``expected``: that
    reference model and its logits and greedy tokens on ``PROMPT``, shared by the matrix and
    the model tests; ``container(family, kind, experts)``: that directory converted
    (``experts=None``: the experts as stored)."""

    def __init__(self, root: Path):
        self.root = root
        self._made: dict = {}

    def _once(self, key, build):
        if key not in self._made:
            self._made[key] = build()
        return self._made[key]

    def hf(self, family: str, kind: str = "f32") -> Path:
        """``kind``: ``PLAIN``'s, the family's native format, or one of ``STORED`` (any family)."""
        if kind in PLAIN:
            dtype, extra = PLAIN[kind]
            return self._once(("hf", family, kind),
                              lambda: save_family(self.root / f"{family}-{kind}", family, dtype, **extra))
        return self._native(family, kind)[0]

    def reference_path(self, family: str, kind: str = "f32") -> Path:
        return self.hf(family, kind) if kind in PLAIN else self._native(family, kind)[1]

    def _native(self, family: str, kind: str):
        if REGISTRY[family].native != kind and kind not in STORED:
            raise ValueError(f"{family} has no native {kind} source in the registry")

        def build():
            src = self.hf(family, "f32")
            if kind in STORED:
                return to_stored(src, self.root / f"{family}-{kind}", self.root / f"{family}-{kind}-dequantized", kind)
            if kind == "fp4":  # DeepSeek-V4 as published (FP8 spine, FP4 experts) and its dequantized twin
                return to_published(src, self.root / f"{family}-fp4", self.root / f"{family}-fp4-dequantized")
            path, _ = to_mxfp4(src, self.root / f"{family}-mxfp4")
            return path, path

        return self._once(("native", family, kind), build)

    def transformers(self, family: str, kind: str = "f32"):
        """transformers' fp32 model on ``reference_path(family, kind)``, loaded once (read-only use)."""
        return self._once(("transformers", family, kind), lambda: reference(self.reference_path(family, kind)))

    def expected(self, family: str, kind: str = "f32") -> tuple[torch.Tensor, list[int]]:
        """transformers' logits at every position of ``PROMPT`` and its ``N_NEW`` greedy tokens on
        ``(family, kind)``, proven decisive (``assert_decisive_model``); computed once a session."""

        def run():
            ref = self.transformers(family, kind)
            with torch.no_grad():
                logits = ref(PROMPT[None]).logits[0]
                out = ref.generate(PROMPT[None], max_new_tokens=N_NEW, do_sample=False)[0]
            assert_decisive_model(ref, out, len(PROMPT) - 1)
            return logits, out[len(PROMPT):].tolist()

        return self._once(("expected", family, kind), run)

    def container(self, family: str, kind: str = "f32", experts: str | None = None, spine: str | None = None) -> Path:
        from sluice.convert import convert

        name = f"{family}-{kind}-{experts or 'stored'}" + (f"-spine-{spine}" if spine else "")
        return self._once(("box", family, kind, experts, spine), lambda: convert(
            self.hf(family, kind), self.root / f"{name}.sluice", experts=experts, spine=spine, progress=False))
