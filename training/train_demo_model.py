#!/usr/bin/env python
"""Train Sluice's small demo Mixture-of-Experts model.

The model is a Hugging Face ``qwen3_moe`` checkpoint (``Qwen3MoeForCausalLM``)
trained from scratch on the source code of the Python standard library of the
interpreter that runs this script.  Everything is deterministic given the seed
and the interpreter (the stdlib source is the corpus):

1. Corpus: every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]``,
   skipping ``site-packages``, test directories, generated tables and very
   large files.  Files are sorted by relative path; a file belongs to the
   held-out split when ``sha256(relpath) % 1000 < heldout_permille``.
2. Tokenizer: byte-level BPE (``tokenizers``) trained on the training split
   only.  ``<|endoftext|>`` (id 0) is bos, eos and pad and separates files.
3. Model: ``Qwen3MoeForCausalLM`` trained with AdamW, linear warmup and cosine
   decay, next-token cross entropy plus the router load-balancing aux loss.
4. Output: ``save_pretrained`` checkpoint (config.json, model.safetensors,
   generation_config.json, tokenizer.json, tokenizer_config.json) plus
   ``training_metrics.json``, a loss-curve PNG and a Markdown report with
   greedy sample completions produced by transformers from the saved files.

Examples::

    # the shipped checkpoint (about one hour on 2 CPU cores)
    python training/train_demo_model.py

    # a seconds-long end-to-end run, e.g. for CI
    python training/train_demo_model.py --tiny --out /tmp/demo-tiny

Run ``python training/train_demo_model.py --help`` for every option.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import math
import os
import platform
import random
import shlex
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
EOS = "<|endoftext|>"

# Directory names skipped anywhere below the stdlib root.
SKIP_DIRS = {
    "site-packages",
    "dist-packages",
    "__pycache__",
    "test",
    "tests",
    "idle_test",
    "encodings",  # mostly generated character-map tables
    "pydoc_data",  # one huge generated file of docs text
    "ensurepip",
}
# Generated or data-like files skipped by name prefix.
SKIP_FILE_PREFIXES = ("_sysconfigdata",)

PROMPTS = [
    "def fibonacci(n):\n",
    "import os\n\n\ndef ",
    "class Stack:\n    def __init__(self):\n",
    "def read_lines(path):\n    with open(path) as f:\n",
    "for i in range(10):\n",
]


# --------------------------------------------------------------------------
# options


@dataclass(frozen=True)
class Preset:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    seq_len: int
    batch_size: int
    steps: int
    lr: float
    warmup_steps: int
    eval_every: int
    eval_windows: int
    log_every: int
    max_new_tokens: int


FULL = Preset(
    vocab_size=4096,
    hidden_size=256,
    num_layers=6,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    num_experts=32,
    top_k=4,
    moe_intermediate_size=48,
    seq_len=512,
    batch_size=8,
    steps=1100,
    lr=2e-3,
    warmup_steps=100,
    eval_every=100,
    eval_windows=48,
    log_every=20,
    max_new_tokens=96,
)

TINY = Preset(
    vocab_size=384,
    hidden_size=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=32,
    num_experts=8,
    top_k=2,
    moe_intermediate_size=32,
    seq_len=64,
    batch_size=4,
    steps=30,
    lr=3e-3,
    warmup_steps=5,
    eval_every=10,
    eval_windows=8,
    log_every=5,
    max_new_tokens=16,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("run")
    g.add_argument("--tiny", action="store_true",
                   help="seconds-long smoke run: small corpus subset, tiny model, few steps; "
                        "defaults to writing under out/ instead of the shipped checkpoint")
    g.add_argument("--out", default=None,
                   help="checkpoint directory (default: src/sluice/demo_model; "
                        "with --tiny: out/demo_model_tiny)")
    g.add_argument("--plot", default=None,
                   help="loss-curve PNG (default: docs/img/demo-model-loss.png; "
                        "with --tiny: <out>/loss.png)")
    g.add_argument("--doc", default=None,
                   help="Markdown report (default: docs/demo-model.md; with --tiny: <out>/report.md)")
    g.add_argument("--no-docs", action="store_true", help="write neither the plot nor the report")
    g.add_argument("--report-only", action="store_true",
                   help="train nothing: rewrite the plot and report from <out>/training_metrics.json")
    g.add_argument("--seed", type=int, default=1234, help="seed for data order, init and sampling")
    g.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's choice)")
    g.add_argument("--adaptive-threads", action="store_true",
                   help="on a shared machine, keep probing 1 thread against --threads and use "
                        "whichever is currently faster (a busy core stalls multi-threaded steps)")
    g.add_argument("--experts-impl", default="grouped_mm", choices=["eager", "grouped_mm"],
                   help="transformers experts kernel used while training (does not change the math)")

    g = p.add_argument_group("corpus and tokenizer")
    g.add_argument("--corpus-root", default=None,
                   help="directory of .py files to train on (default: this interpreter's stdlib)")
    g.add_argument("--heldout-permille", type=int, default=30,
                   help="per-mille of files held out (chosen by a hash of the relative path)")
    g.add_argument("--max-file-bytes", type=int, default=200_000,
                   help="skip larger (usually generated) files")
    g.add_argument("--vocab-size", type=int, default=None, help="BPE vocabulary size incl. specials")

    g = p.add_argument_group("model (Qwen3MoeConfig)")
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--layers", type=int, default=None)
    g.add_argument("--heads", type=int, default=None)
    g.add_argument("--kv-heads", type=int, default=None)
    g.add_argument("--head-dim", type=int, default=None)
    g.add_argument("--experts", type=int, default=None, help="routed experts per layer")
    g.add_argument("--top-k", type=int, default=None, help="experts per token")
    g.add_argument("--moe-intermediate-size", type=int, default=None)
    g.add_argument("--norm-topk-prob", type=int, default=1, choices=[0, 1],
                   help="renormalise the top-k routing weights to sum to 1")
    g.add_argument("--router-aux-loss-coef", type=float, default=0.01,
                   help="weight of the load-balancing loss")

    g = p.add_argument_group("optimisation")
    g.add_argument("--seq-len", type=int, default=None, help="context length of training windows")
    g.add_argument("--batch-size", type=int, default=None, help="windows per step")
    g.add_argument("--steps", type=int, default=None, help="optimizer steps")
    g.add_argument("--lr", type=float, default=None, help="peak learning rate")
    g.add_argument("--min-lr-ratio", type=float, default=0.1, help="final lr as a fraction of --lr")
    g.add_argument("--warmup-steps", type=int, default=None)
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--grad-clip", type=float, default=1.0)
    g.add_argument("--eval-every", type=int, default=None, help="steps between held-out evaluations")
    g.add_argument("--eval-windows", type=int, default=None,
                   help="held-out windows used by the periodic evaluation (the final one uses all)")
    g.add_argument("--log-every", type=int, default=None, help="steps between progress lines")
    g.add_argument("--max-new-tokens", type=int, default=None, help="length of sample completions")

    args = p.parse_args(argv)
    preset = TINY if args.tiny else FULL
    mapping = {
        "vocab_size": "vocab_size", "hidden_size": "hidden_size", "layers": "num_layers",
        "heads": "num_heads", "kv_heads": "num_kv_heads", "head_dim": "head_dim",
        "experts": "num_experts", "top_k": "top_k",
        "moe_intermediate_size": "moe_intermediate_size", "seq_len": "seq_len",
        "batch_size": "batch_size", "steps": "steps", "lr": "lr", "warmup_steps": "warmup_steps",
        "eval_every": "eval_every", "eval_windows": "eval_windows", "log_every": "log_every",
        "max_new_tokens": "max_new_tokens",
    }
    for arg_name, field in mapping.items():
        if getattr(args, arg_name) is None:
            setattr(args, arg_name, getattr(preset, field))
    if args.out is None:
        args.out = "out/demo_model_tiny" if args.tiny else "src/sluice/demo_model"
    if args.plot is None:
        args.plot = str(Path(args.out) / "loss.png") if args.tiny else "docs/img/demo-model-loss.png"
    if args.doc is None:
        args.doc = str(Path(args.out) / "report.md") if args.tiny else "docs/demo-model.md"
    if args.top_k > args.experts:
        p.error("--top-k must not exceed --experts")
    return args


def command_line(argv: list[str]) -> str:
    """The command as typed, with the script path relative to the repository."""
    script = Path(sys.argv[0]).resolve()
    try:
        script_txt = str(script.relative_to(REPO_ROOT))
    except ValueError:
        script_txt = script.name
    return " ".join(["python", shlex.quote(script_txt), *map(shlex.quote, argv)])


def log(msg: str) -> None:
    print(msg, flush=True)


def fmt_time(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:d}:{s:02d}"


def tune_malloc() -> None:
    """Keep freed activation buffers in the heap (glibc) instead of returning them
    to the OS after every step; saves page faults, changes no results."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 32 * 1024 * 1024)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD
        libc.mallopt(-2, 256 * 1024 * 1024)  # M_TOP_PAD
    except (OSError, AttributeError):
        pass


# --------------------------------------------------------------------------
# corpus


def collect_files(root: Path, max_bytes: int) -> list[str]:
    """Sorted relative paths of the corpus's .py files."""
    rels = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
        for name in filenames:
            if not name.endswith(".py") or name.startswith(SKIP_FILE_PREFIXES):
                continue
            if name.startswith("test_"):
                continue
            path = Path(dirpath) / name
            size = path.stat().st_size
            if size == 0 or size > max_bytes:
                continue
            rels.append(path.relative_to(root).as_posix())
    return sorted(rels)


def is_heldout(rel: str, permille: int) -> bool:
    return int(hashlib.sha256(rel.encode()).hexdigest(), 16) % 1000 < permille


def read_texts(root: Path, rels: list[str]) -> tuple[list[str], list[str]]:
    names, texts = [], []
    for rel in rels:
        try:
            text = (root / rel).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if EOS in text:
            continue
        names.append(rel)
        texts.append(text)
    return names, texts


def build_corpus(args) -> dict:
    root = Path(args.corpus_root or sysconfig.get_paths()["stdlib"])
    rels = collect_files(root, args.max_file_bytes)
    train_rels = [r for r in rels if not is_heldout(r, args.heldout_permille)]
    held_rels = [r for r in rels if is_heldout(r, args.heldout_permille)]
    if args.tiny:
        # a small, still deterministic slice: small files only
        small = [r for r in train_rels if (root / r).stat().st_size < 12_000]
        train_rels = small[: 40]
        held_rels = [r for r in held_rels if (root / r).stat().st_size < 12_000][:4]
    train_names, train_texts = read_texts(root, train_rels)
    held_names, held_texts = read_texts(root, held_rels)
    if not train_texts or not held_texts:
        raise SystemExit(f"no usable corpus under {root}")
    digest = hashlib.sha256()
    for name, text in zip(train_names + held_names, train_texts + held_texts):
        digest.update(name.encode() + b"\0" + text.encode() + b"\0")
    return {
        "root": root,
        "train_names": train_names,
        "train_texts": train_texts,
        "heldout_names": held_names,
        "heldout_texts": held_texts,
        "sha256": digest.hexdigest(),
    }


# --------------------------------------------------------------------------
# tokenizer


# Pre-token boundaries for source code, applied before the byte-level mapping: every
# newline alone, runs of other whitespace (indentation) alone, and words or punctuation
# runs each with at most one *trailing* space.  GPT-2's split instead glues a newline to
# the next line's indentation and a space to the *next* word, so prompts that end in
# "\n" or " " (e.g. "def f(n):\n", "import os\n\n\ndef ") would end on a token the
# model never saw in that position, and greedy completions derail.
PRE_TOKENIZER_PATTERN = r"\n|[^\S\n]+|\w+ ?|[^\s\w]+ ?"


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRE_TOKENIZER_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    # byte-level offsets only; no bos/eos is added when encoding (add_bos_token = false)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    assert tok.token_to_id(EOS) == 0
    return tok


def encode_stream(tok, texts: list[str]) -> np.ndarray:
    """Concatenate files, each followed by <|endoftext|>."""
    eos_id = tok.token_to_id(EOS)
    parts = []
    for enc in tok.encode_batch(texts):
        parts.append(np.asarray(enc.ids, dtype=np.int32))
        parts.append(np.asarray([eos_id], dtype=np.int32))
    return np.concatenate(parts)


def save_tokenizer(tok, out: Path, model_max_length: int) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        pad_token=EOS,
        unk_token=None,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(out)
    # Normalise tokenizer_config.json to a plain, chat-free completion setup.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template", None)
    cfg.update({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    })
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for extra in ("special_tokens_map.json", "chat_template.jinja"):
        if (out / extra).exists():
            (out / extra).unlink()


# --------------------------------------------------------------------------
# model and training


def make_config(args, vocab_size: int):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=4 * args.hidden_size,  # dense-MLP size; unused, every layer is MoE
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        hidden_act="silu",
        max_position_embeddings=args.seq_len,
        initializer_range=0.02,
        rms_norm_eps=1e-6,
        use_cache=True,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        attention_bias=False,
        use_sliding_window=False,
        attention_dropout=0.0,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.moe_intermediate_size,
        norm_topk_prob=bool(args.norm_topk_prob),
        output_router_logits=False,  # turned on per call while training
        router_aux_loss_coef=args.router_aux_loss_coef,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )


def param_counts(model, config) -> dict:
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    embed = model.model.embed_tokens.weight.numel()
    per_expert = experts // (config.num_experts * config.num_hidden_layers)
    active = total - embed - experts + per_expert * config.num_experts_per_tok * config.num_hidden_layers
    return {
        "total": total,
        "experts": experts,
        "per_expert": per_expert,
        "embedding": embed,
        "lm_head": model.lm_head.weight.numel(),
        "active_per_token_excluding_embedding": active,
    }


def lr_at(step: int, args) -> float:
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cos)


class Batches:
    """Non-overlapping (seq_len + 1)-token windows of the training stream, reshuffled
    every epoch with a fresh random phase; fully determined by the seed."""

    def __init__(self, stream: np.ndarray, seq_len: int, batch_size: int, seed: int):
        self.stream, self.T, self.B = stream, seq_len, batch_size
        self.rng = np.random.default_rng(seed)
        self.epoch = 0
        self.order: list[int] = []

    def _new_epoch(self):
        offset = int(self.rng.integers(0, self.T))
        n = (len(self.stream) - offset - 1) // self.T
        starts = offset + self.T * np.arange(n)
        self.order = list(self.rng.permutation(starts))
        self.epoch += 1

    def next(self):
        import torch

        rows = []
        for _ in range(self.B):
            if not self.order:
                self._new_epoch()
            s = self.order.pop()
            rows.append(self.stream[s : s + self.T + 1])
        return torch.from_numpy(np.stack(rows).astype(np.int64))


def heldout_windows(stream: np.ndarray, seq_len: int):
    import torch

    n = (len(stream) - 1) // seq_len
    rows = [stream[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)]
    return torch.from_numpy(np.stack(rows).astype(np.int64))


# The first this many held-out windows are also scored on their own and recorded, so a
# test can re-score them with another engine in seconds (the full split takes minutes).
HELDOUT_CHECK_WINDOWS = 16


def heldout_check(model, windows) -> dict:
    loss, _ = evaluate(model, windows[:HELDOUT_CHECK_WINDOWS], 8, 1, 1)
    return {"windows": int(min(HELDOUT_CHECK_WINDOWS, len(windows))), "seq_len": int(windows.shape[1] - 1),
            "loss": loss}


def evaluate(model, windows, batch_size: int, num_experts: int, top_k: int, with_routing=False):
    """Mean next-token cross entropy (nats/token) over the windows, and optionally the
    per-layer fraction of top-k routing assignments per expert."""
    import torch
    import torch.nn.functional as F

    model.eval()
    total, count = 0.0, 0
    usage = None
    with torch.no_grad():
        for i in range(0, len(windows), batch_size):
            x = windows[i : i + batch_size]
            out = model(input_ids=x[:, :-1], output_router_logits=with_routing, use_cache=False)
            ce = F.cross_entropy(out.logits.flatten(0, 1).float(), x[:, 1:].flatten(), reduction="sum")
            total += ce.item()
            count += x[:, 1:].numel()
            if with_routing:
                layers = []
                for rl in out.router_logits:
                    idx = torch.topk(rl, top_k, dim=-1).indices.flatten()
                    layers.append(torch.bincount(idx, minlength=num_experts).double())
                u = torch.stack(layers)
                usage = u if usage is None else usage + u
    model.train()
    frac = None
    if usage is not None:
        frac = (usage / usage.sum(dim=1, keepdim=True)).tolist()
    return total / count, frac


def routing_summary(frac: list[list[float]]) -> dict:
    per_layer = []
    for row in frac:
        p = np.asarray(row)
        nz = p[p > 0]
        ent = float(-(nz * np.log(nz)).sum() / math.log(len(p)))
        per_layer.append({
            "min_share": float(p.min()),
            "max_share": float(p.max()),
            "normalized_entropy": ent,
        })
    return {
        "uniform_share": 1.0 / len(frac[0]),
        "per_layer": per_layer,
        "share_per_layer_and_expert": [[round(v, 5) for v in row] for row in frac],
    }


class ThreadTuner:
    """Switch torch between 1 and ``max_threads`` intra-op threads, whichever steps faster.

    With every core busy with other work, a multi-threaded step waits for its slowest
    thread and can run many times slower than a single-threaded one; on an idle machine
    it is the other way round. Every ``period`` steps the other setting is tried for
    ``probe_len`` steps and kept if its median step time beats the running average.
    Only floating-point summation order depends on the choice."""

    def __init__(self, max_threads: int, period: int = 25, probe_len: int = 3):
        import torch

        self.torch = torch
        self.options = sorted({1, max_threads})
        self.current = max_threads
        self.period, self.probe_len = period, probe_len
        self.avg: dict[int, float] = {}
        self.probe: int | None = None
        self.probe_times: list[float] = []
        self.steps_at = {opt: 0 for opt in self.options}

    def before_step(self, step: int) -> None:
        if len(self.options) < 2 or self.probe is not None:
            return
        if step > 0 and step % self.period == 0:
            self.probe = next(o for o in self.options if o != self.current)
            self.probe_times = []
            self.torch.set_num_threads(self.probe)

    def after_step(self, seconds: float) -> None:
        if self.probe is not None:
            self.steps_at[self.probe] += 1
            self.probe_times.append(seconds)
            if len(self.probe_times) == self.probe_len:
                median = float(np.median(self.probe_times))
                if median < self.avg.get(self.current, float("inf")):
                    self.current = self.probe
                    self.avg[self.current] = median
                self.probe = None
                self.torch.set_num_threads(self.current)
            return
        self.steps_at[self.current] += 1
        prev = self.avg.get(self.current)
        self.avg[self.current] = seconds if prev is None else 0.7 * prev + 0.3 * seconds

    def threads(self) -> int:
        return self.probe if self.probe is not None else self.current


def train(args, model, train_stream, held_stream):
    import torch
    import torch.nn.functional as F

    decay, no_decay = [], []
    for _name, p in model.named_parameters():
        (decay if p.dim() >= 2 else no_decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
    )
    batches = Batches(train_stream, args.seq_len, args.batch_size, args.seed)
    held = heldout_windows(held_stream, args.seq_len)
    # periodic evaluation on an evenly spaced subset of held-out windows
    pick = np.linspace(0, len(held) - 1, num=min(args.eval_windows, len(held))).round().astype(int)
    held_subset = held[np.unique(pick)]

    tokens_per_step = args.batch_size * args.seq_len
    history = {"train": [], "heldout": []}
    run_ce, run_aux, run_n = 0.0, 0.0, 0
    recent = []
    model.train()
    tuner = ThreadTuner(torch.get_num_threads()) if args.adaptive_threads else None
    t0 = time.time()
    eval_time = 0.0
    for step in range(args.steps):
        if tuner:
            tuner.before_step(step)
        t_step = time.time()
        lr = lr_at(step, args)
        for group in opt.param_groups:
            group["lr"] = lr
        x = batches.next()
        out = model(input_ids=x[:, :-1], output_router_logits=True, use_cache=False)
        ce = F.cross_entropy(out.logits.flatten(0, 1).float(), x[:, 1:].flatten())
        aux = out.aux_loss
        loss = ce + args.router_aux_loss_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()

        ce_v, aux_v = ce.item(), aux.item()
        if tuner:
            tuner.after_step(time.time() - t_step)
        if not math.isfinite(ce_v):
            raise SystemExit(f"non-finite loss at step {step}")
        run_ce += ce_v
        run_aux += aux_v
        run_n += 1
        recent.append(ce_v)
        done = step + 1
        tokens = done * tokens_per_step

        if done % args.log_every == 0 or done == args.steps:
            elapsed = time.time() - t0
            train_time = elapsed - eval_time
            tps = tokens / max(train_time, 1e-9)
            eta = (args.steps - done) * train_time / done
            history["train"].append({"step": done, "tokens": tokens, "loss": run_ce / run_n,
                                     "aux_loss": run_aux / run_n})
            log(f"step {done:5d}/{args.steps} | tokens {tokens / 1e6:7.3f}M | "
                f"loss {run_ce / run_n:.4f} | aux {run_aux / run_n:.3f} | lr {lr:.2e} | "
                f"{tps:,.0f} tok/s | elapsed {fmt_time(elapsed)} | ETA {fmt_time(eta)}"
                + (f" | threads {tuner.threads()}" if tuner else ""))
            run_ce, run_aux, run_n = 0.0, 0.0, 0

        if done % args.eval_every == 0 or done == args.steps:
            te = time.time()
            held_loss, _ = evaluate(model, held_subset, args.batch_size, args.experts, args.top_k)
            eval_time += time.time() - te
            history["heldout"].append({"step": done, "tokens": tokens, "loss": held_loss})
            log(f"  eval @ {tokens / 1e6:.3f}M tokens | held-out loss {held_loss:.4f} "
                f"| ppl {math.exp(held_loss):.2f}")

    wall = time.time() - t0
    tail = recent[-max(1, min(len(recent), 50)):]
    return {
        "history": history,
        "train_wall_seconds": wall,
        "eval_seconds_during_training": eval_time,
        "final_train_loss": float(np.mean(tail)),
        "final_train_loss_window_steps": len(tail),
        "tokens_trained": args.steps * tokens_per_step,
        "epochs": batches.epoch,
        "heldout_windows": held,
        "heldout_eval_subset_windows": len(held_subset),
        "steps_per_thread_count": ({str(k): v for k, v in tuner.steps_at.items()}
                                   if tuner else {str(torch.get_num_threads()): args.steps}),
    }


# --------------------------------------------------------------------------
# samples, plot, report


def generate_samples(out: Path, max_new_tokens: int) -> list[dict]:
    """Greedy completions from the *saved* checkpoint, via transformers' Auto classes."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    model.eval()
    samples = []
    for prompt in PROMPTS:
        enc = tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            gen = model.generate(
                **enc, do_sample=False, max_new_tokens=max_new_tokens,
                output_scores=True, return_dict_in_generate=True,
                pad_token_id=tokenizer.pad_token_id,
            )
        new_ids = gen.sequences[0, enc["input_ids"].shape[1]:]
        margins = []
        for score in gen.scores:
            top2 = torch.topk(score[0].float(), 2).values
            margins.append(float(top2[0] - top2[1]))
        samples.append({
            "prompt": prompt,
            "completion": tokenizer.decode(new_ids, skip_special_tokens=False),
            "new_tokens": int(new_ids.numel()),
            "min_top1_top2_logit_margin": min(margins) if margins else None,
            "median_top1_top2_logit_margin": float(np.median(margins)) if margins else None,
        })
    return samples


def write_plot(path: Path, history: dict, heldout_final: float, tokens: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    tr = history["train"]
    ho = history["heldout"]
    ax.plot([p["tokens"] / 1e6 for p in tr], [p["loss"] for p in tr], label="train (interval mean)",
            lw=1.2)
    ax.plot([p["tokens"] / 1e6 for p in ho], [p["loss"] for p in ho], "o-", ms=3,
            label="held-out (subset)", lw=1.2)
    ax.plot([tokens / 1e6], [heldout_final], "k*", ms=9, label=f"held-out, all ({heldout_final:.3f})")
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("cross entropy (nats / token)")
    ax.set_title("Sluice demo MoE: loss vs tokens")
    lo = min([p["loss"] for p in tr + ho] + [heldout_final])
    ax.set_ylim(max(0.0, lo - 0.3), min(max(p["loss"] for p in tr + ho), lo + 5.0))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def md_code(text: str) -> str:
    fence = "```"
    while fence in text:
        fence += "`"
    return f"{fence}python\n{text}\n{fence}"


def write_report(path: Path, m: dict, out_rel: str, plot_rel: str) -> None:
    a, c, p = m["architecture"], m["corpus"], m["parameters"]
    sizes = "\n".join(f"| `{k}` | {v / 1e6:.2f} MB |" for k, v in m["files_bytes"].items())
    lines = [
        "# The Sluice demo model",
        "",
        f"`{out_rel}` is a small Mixture-of-Experts language model in Hugging Face `qwen3_moe` "
        "format, trained from scratch on the source code of the Python standard library. "
        "It gives Sluice's demo meaningful text and its routing measurements real, trained "
        "router statistics, and it loads in transformers as is:",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f'tok = AutoTokenizer.from_pretrained("{out_rel}")',
        f'model = AutoModelForCausalLM.from_pretrained("{out_rel}")',
        'ids = tok("def fibonacci(n):\\n", return_tensors="pt")',
        "print(tok.decode(model.generate(**ids, do_sample=False, max_new_tokens=60)[0]))",
        "```",
        "",
        "It is a code-completion model without a chat template. No bos token is "
        "prepended; `<|endoftext|>` (id 0) is bos, eos and pad and separates files in training.",
        "",
        "## Architecture",
        "",
        "| | |",
        "|---|---|",
        "| model type | `qwen3_moe` (`Qwen3MoeForCausalLM`) |",
        f"| layers | {a['num_hidden_layers']}, every one a sparse-MoE layer |",
        f"| hidden size | {a['hidden_size']} |",
        f"| attention | {a['num_attention_heads']} query heads, {a['num_key_value_heads']} KV heads, "
        f"head dim {a['head_dim']}, RoPE θ = {a['rope_theta']:g}, q/k RMSNorm |",
        f"| experts | {a['num_experts']} routed experts per layer, top-{a['num_experts_per_tok']}, "
        f"expert intermediate size {a['moe_intermediate_size']}, SwiGLU, "
        f"`norm_topk_prob` = {str(a['norm_topk_prob']).lower()} |",
        f"| vocabulary | {a['vocab_size']} byte-level BPE tokens |",
        f"| context | {a['max_position_embeddings']} tokens (training window) |",
        "| embeddings | untied (`lm_head` is a separate matrix) |",
        f"| parameters | {p['total'] / 1e6:.2f} M total; experts {p['experts'] / 1e6:.2f} M "
        f"({p['per_expert']:,} per expert); "
        f"{p['active_per_token_excluding_embedding'] / 1e6:.2f} M active per token "
        "(excluding the embedding lookup) |",
        f"| weights | {m['weights_dtype']}, one `model.safetensors` |",
        "",
        "## Training",
        "",
        f"* Corpus: the `.py` files of the CPython {c['python_version']} standard library, without "
        "`site-packages`, test directories, the generated `encodings` tables, `pydoc_data`, "
        "`ensurepip` and files "
        f"over {c['max_file_bytes'] // 1000} kB. {c['train_files']} files "
        f"({c['train_bytes'] / 1e6:.2f} MB, {c['train_tokens']:,} tokens) for training, "
        f"{c['heldout_files']} files ({c['heldout_bytes'] / 1e6:.2f} MB, {c['heldout_tokens']:,} "
        "tokens) held out, chosen by a hash of the relative path. "
        f"The tokenizer averages {c['train_bytes_per_token']:.2f} bytes per token.",
        "* Tokenizer: byte-level BPE trained with `tokenizers` on the training split only. Before "
        "the byte-level mapping, text is split into single newlines, runs of other whitespace "
        "(indentation), and words or punctuation runs that each keep at most one trailing space, "
        "so prompts that end in a newline or a space (`\"def f(n):\\n\"`, `\"import os\\n\\n\\ndef \"`) "
        "end on a natural token boundary.",
        f"* Objective: next-token cross entropy + {m['hyperparameters']['router_aux_loss_coef']} × "
        "the load-balancing aux loss on the router logits.",
        f"* Optimiser: AdamW (β = 0.9, 0.95; weight decay {m['hyperparameters']['weight_decay']}), "
        f"peak lr {m['hyperparameters']['lr']:g}, {m['hyperparameters']['warmup_steps']} warmup steps, "
        f"cosine decay to {m['hyperparameters']['min_lr_ratio']:g} × peak, gradient clip "
        f"{m['hyperparameters']['grad_clip']}; {m['hyperparameters']['steps']} steps of "
        f"{m['hyperparameters']['batch_size']} × {m['hyperparameters']['seq_len']} tokens.",
        f"* Tokens trained: {m['tokens_trained'] / 1e6:.2f} M "
        f"({m['tokens_trained'] / c['train_tokens']:.2f} passes over the training split).",
        f"* Wall time: {fmt_time(m['train_wall_seconds'])} of training "
        f"({fmt_time(m['total_wall_seconds'])} in all) on {m['threads']} CPU thread{'s' if m['threads'] != 1 else ''} "
        f"({m['platform']}), torch {m['versions']['torch']}, "
        f"transformers {m['versions']['transformers']}.",
        f"* Seed: {m['seed']}.",
        "",
        "## Results",
        "",
        f"* Final train loss (mean of the last {m['final_train_loss_window_steps']} steps): "
        f"{m['final_train_loss']:.4f} nats/token.",
        f"* Held-out loss over all {m['heldout_eval_windows']} held-out windows: "
        f"**{m['heldout_loss']:.4f} nats/token, perplexity {m['heldout_perplexity']:.2f}** "
        f"({m['heldout_bits_per_byte']:.3f} bits per byte).",
        f"* Routing on the held-out set (uniform share {m['routing']['uniform_share']:.4f}): "
        "normalised entropy of the expert load per layer "
        + ", ".join(f"{r['normalized_entropy']:.3f}" for r in m["routing"]["per_layer"])
        + "; busiest expert share per layer "
        + ", ".join(f"{r['max_share']:.3f}" for r in m["routing"]["per_layer"])
        + ". Balanced, but not uniform.",
    ]
    if "heldout_check" in m:
        hc = m["heldout_check"]
        lines.append(f"* The first {hc['windows']} held-out windows alone: {hc['loss']:.4f} nats/token "
                     "(`tests/models/test_demo_model.py` re-scores them with Sluice and requires the same value).")
    lines += [
        "* How its decode-time routing compares with a real MoE's (OLMoE) and with random weights: "
        "[routing-realism.md](routing-realism.md).",
        "",
        f"![loss curve]({plot_rel})",
        "",
        "## Sample completions",
        "",
        f"Greedy decoding with transformers (`do_sample=False`, {m['max_new_tokens']} new tokens) "
        "from the saved checkpoint. The prompt is shown first, then the completion, verbatim. "
        "The smallest gap between the top two logits along each greedy path is given in nats.",
        "",
    ]
    for s in m["samples"]:
        lines += [
            f"Prompt `{json.dumps(s['prompt'])}` (min top-1/top-2 margin "
            f"{s['min_top1_top2_logit_margin']:.3f}, median {s['median_top1_top2_logit_margin']:.2f}):",
            "",
            md_code(s["prompt"] + s["completion"]),
            "",
        ]
    lines += [
        "## Files",
        "",
        "| file | size |",
        "|---|---|",
        sizes,
        f"| total | {sum(m['files_bytes'].values()) / 1e6:.2f} MB |",
        "",
        "`training_metrics.json` also holds the loss history, the per-expert load on the "
        "held-out set and the margins above.",
        "",
        "## Reproduce",
        "",
        "```sh",
        m["command"],
        "```",
        "",
        "The corpus is the running interpreter's standard library, so another Python version "
        f"gives a different corpus (this one: sha256 `{c['sha256'][:16]}…`). Results also depend "
        "slightly on the thread count and CPU, through floating-point summation order. "
        "`--tiny` runs the whole pipeline in seconds for tests.",
        "",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))


def rel_display(path: Path) -> str:
    try:
        return path.resolve().relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return path.name


def write_docs(args, metrics: dict) -> None:
    out, plot_path, doc_path = Path(args.out), Path(args.plot), Path(args.doc)
    write_plot(plot_path, metrics["history"], metrics["heldout_loss"], metrics["tokens_trained"])
    plot_rel = os.path.relpath(plot_path.resolve(), doc_path.resolve().parent)
    write_report(doc_path, metrics, rel_display(out), Path(plot_rel).as_posix())


def report_only(args) -> int:
    metrics = json.loads((Path(args.out) / "training_metrics.json").read_text())
    write_docs(args, metrics)
    log(f"wrote {args.plot} and {args.doc}")
    return 0


# --------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.report_only:
        return report_only(args)
    t_start = time.time()
    tune_malloc()

    import tokenizers
    import torch
    import transformers
    from transformers import Qwen3MoeForCausalLM

    if args.threads:
        torch.set_num_threads(args.threads)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    transformers.logging.set_verbosity_error()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    log(f"[1/5] corpus: collecting .py files (held out: {args.heldout_permille}/1000 of files)")
    corpus = build_corpus(args)
    train_bytes = sum(len(t.encode()) for t in corpus["train_texts"])
    held_bytes = sum(len(t.encode()) for t in corpus["heldout_texts"])
    log(f"      {len(corpus['train_texts'])} train files ({train_bytes / 1e6:.2f} MB), "
        f"{len(corpus['heldout_texts'])} held-out files ({held_bytes / 1e6:.2f} MB)")

    log(f"[2/5] tokenizer: byte-level BPE, vocab {args.vocab_size}, training split only")
    t = time.time()
    tok = train_tokenizer(corpus["train_texts"], args.vocab_size)
    vocab_size = tok.get_vocab_size()
    train_stream = encode_stream(tok, corpus["train_texts"])
    held_stream = encode_stream(tok, corpus["heldout_texts"])
    log(f"      vocab {vocab_size}; {len(train_stream):,} train tokens "
        f"({train_bytes / len(train_stream):.2f} bytes/token), {len(held_stream):,} held-out tokens "
        f"[{time.time() - t:.1f}s]")

    log("[3/5] model")
    config = make_config(args, vocab_size)
    config._experts_implementation = args.experts_impl
    model = Qwen3MoeForCausalLM(config)
    counts = param_counts(model, config)
    log(f"      qwen3_moe: {args.layers} layers, hidden {args.hidden_size}, {args.experts} experts "
        f"top-{args.top_k} (intermediate {args.moe_intermediate_size}); {counts['total'] / 1e6:.2f}M "
        f"params, {counts['active_per_token_excluding_embedding'] / 1e6:.2f}M active/token; "
        f"{torch.get_num_threads()} threads")

    tokens_total = args.steps * args.batch_size * args.seq_len
    log(f"[4/5] training: {args.steps} steps x {args.batch_size} x {args.seq_len} = "
        f"{tokens_total / 1e6:.2f}M tokens ({tokens_total / len(train_stream):.2f} passes)")
    result = train(args, model, train_stream, held_stream)

    log("[5/5] final held-out evaluation, save, samples")
    held_loss, frac = evaluate(model, result["heldout_windows"], args.batch_size, args.experts,
                               args.top_k, with_routing=True)
    held_ppl = math.exp(held_loss)
    check = heldout_check(model, result["heldout_windows"])
    held_tokens_scored = result["heldout_windows"][:, 1:].numel()
    # bits per byte over the scored held-out tokens (bytes estimated at the split's average)
    bpb = held_loss / math.log(2) * len(held_stream) / held_bytes
    log(f"      held-out loss {held_loss:.4f} nats/token, perplexity {held_ppl:.2f}")

    model.config.output_router_logits = False
    model.save_pretrained(out)
    # transformers 5 writes the expert count as "num_local_experts"; Qwen3-MoE checkpoints
    # on the Hub call it "num_experts". Write both (equal) so either reader finds it.
    cfg_path = out / "config.json"
    cfg_json = json.loads(cfg_path.read_text())
    cfg_json["num_experts"] = config.num_experts
    cfg_path.write_text(json.dumps(cfg_json, indent=2, sort_keys=True) + "\n")
    save_tokenizer(tok, out, args.seq_len)
    from transformers import GenerationConfig

    GenerationConfig(bos_token_id=0, eos_token_id=0, pad_token_id=0, do_sample=False,
                     max_new_tokens=128).save_pretrained(out)

    samples = generate_samples(out, args.max_new_tokens)
    for s in samples:
        log("      " + json.dumps(s["prompt"] + s["completion"])[:200])

    files_bytes = {p.name: p.stat().st_size for p in sorted(out.iterdir())
                   if p.is_file() and p.name != "training_metrics.json"}
    metrics = {
        "seed": args.seed,
        "tiny": args.tiny,
        "command": command_line(argv),
        "python_version": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "threads": torch.get_num_threads(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "tokenizers": tokenizers.__version__, "numpy": np.__version__},
        "corpus": {
            "source": "python stdlib (sysconfig.get_paths()['stdlib'])" if not args.corpus_root
            else "custom --corpus-root",
            "python_version": platform.python_version(),
            "skipped_dirs": sorted(SKIP_DIRS),
            "max_file_bytes": args.max_file_bytes,
            "heldout_permille": args.heldout_permille,
            "train_files": len(corpus["train_texts"]),
            "heldout_files": len(corpus["heldout_texts"]),
            "heldout_file_names": corpus["heldout_names"],
            "train_bytes": train_bytes,
            "heldout_bytes": held_bytes,
            "train_tokens": int(len(train_stream)),
            "heldout_tokens": int(len(held_stream)),
            "train_bytes_per_token": train_bytes / len(train_stream),
            "sha256": corpus["sha256"],
        },
        "tokenizer": {"type": "byte-level BPE", "vocab_size": vocab_size, "special_tokens": [EOS],
                      "bos_eos_pad_id": 0, "add_bos_token": False},
        "architecture": {
            "model_type": "qwen3_moe",
            "vocab_size": vocab_size,
            "hidden_size": config.hidden_size,
            "num_hidden_layers": config.num_hidden_layers,
            "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_key_value_heads,
            "head_dim": config.head_dim,
            "num_experts": config.num_experts,
            "num_experts_per_tok": config.num_experts_per_tok,
            "moe_intermediate_size": config.moe_intermediate_size,
            "norm_topk_prob": config.norm_topk_prob,
            "max_position_embeddings": config.max_position_embeddings,
            "rope_theta": config.rope_parameters["rope_theta"],
            "tie_word_embeddings": False,
        },
        "parameters": counts,
        "weights_dtype": "float32",
        "hyperparameters": {
            "seq_len": args.seq_len, "batch_size": args.batch_size, "steps": args.steps,
            "lr": args.lr, "min_lr_ratio": args.min_lr_ratio, "warmup_steps": args.warmup_steps,
            "weight_decay": args.weight_decay, "grad_clip": args.grad_clip,
            "betas": [0.9, 0.95], "router_aux_loss_coef": args.router_aux_loss_coef,
            "experts_impl_during_training": args.experts_impl,
        },
        "tokens_trained": result["tokens_trained"],
        "epochs_started": result["epochs"],
        "train_wall_seconds": round(result["train_wall_seconds"], 1),
        "eval_seconds_during_training": round(result["eval_seconds_during_training"], 1),
        "steps_per_thread_count": result["steps_per_thread_count"],
        "final_train_loss": result["final_train_loss"],
        "final_train_loss_window_steps": result["final_train_loss_window_steps"],
        "heldout_loss": held_loss,
        "heldout_perplexity": held_ppl,
        "heldout_bits_per_byte": bpb,
        "heldout_eval_windows": int(len(result["heldout_windows"])),
        "heldout_tokens_scored": int(held_tokens_scored),
        "heldout_check": check,
        "routing": routing_summary(frac),
        "max_new_tokens": args.max_new_tokens,
        "samples": samples,
        "history": result["history"],
        "files_bytes": files_bytes,
    }

    metrics["total_wall_seconds"] = round(time.time() - t_start, 1)
    if not args.no_docs:
        write_docs(args, metrics)
    (out / "training_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    total = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    log(f"done in {fmt_time(metrics['total_wall_seconds'])}: {out} ({total / 1e6:.2f} MB), "
        f"held-out perplexity {held_ppl:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
