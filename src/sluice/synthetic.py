"""Synthetic checkpoints in real Hugging Face format, written tensor by tensor.

One writer serves ``sluice demo``, the tests and the benchmarks. It asks the family module
which tensors a config implies (names and shapes), so every supported family can be
written; data is generated per tensor from a seed derived from (seed, tensor name), in
bounded chunks, so memory stays small whatever the model size. The directory is written
under a temporary name and renamed when complete.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import sysconfig
import zlib
from pathlib import Path

import torch

from .checkpoint import DTYPE_NAMES
from .models import get_family
from .progress import Progress

_CHUNK_ELEMS = 8 << 20

DEMO_CONFIG = {
    # ~2 GB in bf16: a Qwen3-MoE shape scaled down (16 layers x 32 experts x 3.1 MB, top-4)
    "model_type": "qwen3_moe",
    "architectures": ["Qwen3MoeForCausalLM"],
    "vocab_size": 32000,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "moe_intermediate_size": 512,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "num_experts": 32,
    "num_experts_per_tok": 4,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "tie_word_embeddings": False,
    "attention_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


MIXTRAL_CONFIG = {
    # ~1.5 GB in bf16 at 4 experts: a Mixtral shape scaled down (16 layers, 22 MB experts, top-2);
    # scaled_config() sets the expert count for a target size
    "model_type": "mixtral",
    "architectures": ["MixtralForCausalLM"],
    "vocab_size": 32000,
    "hidden_size": 1024,
    "intermediate_size": 3584,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

DEEPSEEK_V4_CONFIG = {
    # ~1.8 GB in bf16 at 64 experts: a DeepSeek-V4-Flash shape scaled down (8 layers: 2 sliding, then
    # CSA and HCA at the real rates; the first 3 hash-routed, top-6; 3 MiB experts; 4 hyper-connection
    # streams); the hash tables (tid2eid) are written as valid integer rows (``model_tables``)
    "model_type": "deepseek_v4",
    "architectures": ["DeepseekV4ForCausalLM"],
    "vocab_size": 32000,
    "hidden_size": 1024,
    "moe_intermediate_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "qk_rope_head_dim": 32,
    "q_lora_rank": 256,
    "o_groups": 4,
    "o_lora_rank": 128,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "sliding_attention"]
    + ["compressed_sparse_attention", "heavily_compressed_attention"] * 3,
    "mlp_layer_types": ["hash_moe"] * 3 + ["moe"] * 5,
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    "index_n_heads": 8,
    "index_head_dim": 64,
    "index_topk": 64,
    "hc_mult": 4,
    "n_routed_experts": 64,
    "num_experts_per_tok": 6,
    "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

_QWEN4_LAYERS = ["linear_attention", "linear_attention", "linear_attention", "indexed_attention"] * 2
QWEN4_EXP_CONFIG = {
    # a Qwen3.8-Flash-Next shape scaled down (Gated DeltaNet + QSA, 4 gated residual streams, every
    # layer MoE) with PLE n-gram tables on its six linear-attention layers: 16 heads of 16 bf16
    # values (32 bytes a row), ``ngram_vocab_size_base`` rows per head: ~0.5 GB of tables (the
    # experts scale to the size asked; ``with_tables`` resizes the tables)
    "model_type": "qwen4_exp_text", "architectures": ["Qwen4ExpForCausalLM"], "vocab_size": 32000,
    "hidden_size": 256, "num_hidden_layers": len(_QWEN4_LAYERS), "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "layer_types": _QWEN4_LAYERS, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_key_head_dim": 64, "linear_value_head_dim": 64, "num_experts": 64,
    "num_experts_per_tok": 4, "moe_intermediate_size": 256, "shared_expert_intermediate_size": 256,
    "hc_count": 4, "hc_lowrank": 32, "ple_layer_ids": [1, 2, 3, 5, 6, 7], "ple_embed_dim": 256, "ngram_size": 3,
    "heads_per_ngram": 8, "ngram_vocab_size_base": 162_000, "make_ngram_vocab_size_divisible_by": 128,
    "indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 64, "indexer_budget": 64,
    "indexer_compress_ratio": 4, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "eos_token_id": 2,
    "bos_token_id": 1, "pad_token_id": 0,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    "tie_word_embeddings": False, "hidden_act": "silu",
}


def with_tables(config: dict, table_bytes: float) -> dict:
    """``QWEN4_EXP_CONFIG``-shaped ``config`` with ``ngram_vocab_size_base`` chosen so its PLE tables
    hold about ``table_bytes`` (16 heads of 32-byte rows per PLE layer)."""
    heads, row = (config["ngram_size"] - 1) * config["heads_per_ngram"], 2 * config["ple_embed_dim"] // 16
    return {**config, "ngram_vocab_size_base": max(1000, int(table_bytes / len(config["ple_layer_ids"]) / heads / row))}


BASE_CONFIGS = {"qwen3_moe": DEMO_CONFIG, "mixtral": MIXTRAL_CONFIG, "deepseek_v4": DEEPSEEK_V4_CONFIG,
                "qwen4_exp": QWEN4_EXP_CONFIG}
# the config key of each base's routed-expert count (``scaled_config``)
_EXPERT_KEYS = {"mixtral": "num_local_experts", "deepseek_v4": "n_routed_experts"}  # else num_experts


def model_tensors(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor a config implies, layer by layer (spine then that layer's experts)."""
    fam = get_family(config.get("model_type"))
    desc = fam.describe(fam.parse_config(config))
    by_layer: dict[int, list[tuple[str, tuple[int, ...]]]] = {}
    for name, shape in desc.spine.items():
        layer = _layer_of(name)
        by_layer.setdefault(layer, []).append((name, shape))
    for layer in desc.moe_layers:
        for e in range(desc.n_experts):
            for ref in desc.expert_tensors(layer, e).values():
                if ref.index is not None or ref.row0:
                    raise ValueError("the synthetic writer handles per-expert tensors only")
                by_layer.setdefault(layer, []).append((ref.name, tuple(ref.shape)))
    for name, (rows, dim) in desc.row_tables.items():  # token-keyed tables (rows/): one tensor each
        by_layer.setdefault(_layer_of(name), []).append((name + ".weight", (rows, dim)))
    out = []
    for layer in sorted(by_layer):
        out.extend(by_layer[layer])
    return out


def model_tables(config: dict) -> dict[str, tuple[int, int]]:
    """The integer lookup tables among a config's tensors (hash routing's ``tid2eid`` [V, K]):
    name -> (experts, K). The writer fills each row with K distinct experts below ``experts``."""
    fam = get_family(config.get("model_type"))
    desc = fam.describe(fam.parse_config(config))
    return {name: (desc.n_experts, desc.spine[name][1]) for name in desc.tables}


def _layer_of(name: str) -> int:
    parts = name.split(".")
    if "layers" in parts:
        i = parts.index("layers")
        if i + 1 < len(parts) and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return -1 if "embed" in name else 1 << 30


def model_bytes(config: dict, dtype: torch.dtype = torch.bfloat16) -> int:
    size, tables = torch.empty((), dtype=dtype).element_size(), model_tables(config)
    return sum(math.prod(s) * (8 if n in tables else size) for n, s in model_tensors(config))


def scaled_config(target_bytes: float, base: dict | None = None, dtype: torch.dtype = torch.bfloat16) -> dict:
    """``base`` (default: the demo config) with the expert count chosen to reach ``target_bytes``."""
    cfg = json.loads(json.dumps(base or DEMO_CONFIG))
    key = _EXPERT_KEYS.get(cfg.get("model_type"), "num_experts")
    n0 = max(4, cfg.get("num_experts_per_tok", 2))  # a valid expert count to measure from
    cfg[key] = n0
    small = model_bytes(cfg, dtype)
    cfg[key] = n0 + 1
    per_expert_all_layers = model_bytes(cfg, dtype) - small
    cfg[key] = max(cfg.get("num_experts_per_tok", 2) * 2, n0 + int((target_bytes - small) // per_expert_all_layers))
    return cfg


def _init(name: str, shape: tuple[int, ...], gen: torch.Generator, std: float, out: torch.Tensor) -> None:
    """Fill ``out`` (flat fp32 chunk) for tensor ``name``: ones for norms, zero biases, and
    otherwise uniform noise with standard deviation ``std`` (uniform is ~2x faster to draw)."""
    if len(shape) == 1 and ("norm" in name or "layernorm" in name):
        out.fill_(1.0)
    elif name.endswith(".bias"):
        out.zero_()
    else:
        a = std * math.sqrt(3.0)
        out.uniform_(-a, a, generator=gen)


def _table(shape: tuple[int, ...], experts: int, gen: torch.Generator) -> torch.Tensor:
    """A hash table [V, K] (int64): each row K distinct experts below ``experts``, drawn at random."""
    rows, k = shape
    out = torch.empty(rows, k, dtype=torch.int64)
    for r0 in range(0, rows, 4096):
        n = min(4096, rows - r0)
        out[r0 : r0 + n] = torch.rand(n, experts, generator=gen).argsort(dim=1)[:, :k]
    return out


def write_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype, seed: int,
                      std: float, bar: Progress | None = None, tables: dict[str, tuple[int, int]] | None = None
                      ) -> None:
    """``tensors`` in ``dtype`` with random values, except ``tables`` (``model_tables``: int64
    hash tables of valid rows)."""
    size = torch.empty((), dtype=dtype).element_size()
    tables = tables or {}
    header, off = {}, 0
    for name, shape in tensors:
        n = math.prod(shape) * (8 if name in tables else size)
        kind = DTYPE_NAMES[torch.int64 if name in tables else dtype]
        header[name] = {"dtype": kind, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        buf = torch.empty(_CHUNK_ELEMS, dtype=torch.float32)
        for name, shape in tensors:
            gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) & ((1 << 63) - 1))
            if name in tables:
                f.write(memoryview(_table(shape, tables[name][0], gen).view(torch.uint8).numpy().reshape(-1)))
                if bar is not None:
                    bar.update(math.prod(shape) * 8)
                continue
            total = math.prod(shape)
            for c0 in range(0, total, _CHUNK_ELEMS):
                n = min(_CHUNK_ELEMS, total - c0)
                chunk = buf[:n]
                _init(name, shape, gen, std, chunk)
                f.write(memoryview(chunk.to(dtype).view(torch.uint8).numpy()))
                if bar is not None:
                    bar.update(n * size)


def write_model(path: str | os.PathLike, config: dict, *, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                std: float = 0.02, shard_bytes: int = 2 << 30, tokenizer: bool = True, progress: bool = True) -> Path:
    """Write a complete Hugging Face model directory for ``config`` at ``path`` (atomically)."""
    path = Path(path)
    tensors, tables = model_tensors(config), model_tables(config)
    size = torch.empty((), dtype=dtype).element_size()
    total = sum(math.prod(s) * (8 if n in tables else size) for n, s in tensors)
    path.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(path.parent).free
    if free < total * 1.05 + (64 << 20):
        raise OSError(f"not enough free disk at {path.parent}: the model needs {total / 1e9:.2f} GB, "
                      f"{free / 1e9:.2f} GB free")
    tmp = path.with_name(path.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    cur = 0
    for name, shape in tensors:
        n = math.prod(shape) * (8 if name in tables else size)
        if shards[-1] and cur + n > shard_bytes:
            shards.append([])
            cur = 0
        shards[-1].append((name, shape))
        cur += n
    bar = Progress(total, f"writing {path.name}", enabled=progress)
    if len(shards) == 1:
        write_safetensors(tmp / "model.safetensors", shards[0], dtype, seed, std, bar, tables)
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(tmp / fname, shard, dtype, seed, std, bar, tables)
            weight_map.update({name: fname for name, _ in shard})
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    bar.close()
    cfg = dict(config)
    cfg["dtype"] = str(dtype).replace("torch.", "")
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    gen_cfg = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in cfg}
    (tmp / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2))
    if tokenizer:
        write_tokenizer(tmp, cfg["vocab_size"])
    if path.exists():
        shutil.rmtree(path)
    os.replace(tmp, path)
    return path


def _corpus(max_bytes: int) -> list[str]:
    """Deterministic training text available on every machine: Python's own stdlib sources."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for p in sorted(root.glob("*.py")):
        try:
            t = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        texts.append(t)
        total += len(t)
        if total >= max_bytes:
            break
    return texts


def write_tokenizer(directory: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer trained offline on stdlib sources, ``vocab_size`` entries."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<pad>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(2_000_000 if vocab_size > 4096 else 400_000), trainer=trainer)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "pad_token": "<pad>", "add_bos_token": False, "model_max_length": 4096,
    }, indent=2))
