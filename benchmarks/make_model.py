"""Benchmark checkpoints: synthetic Hugging Face models, and their conversions for the peers.

    # a ~12 GB Mixtral-shaped bf16 checkpoint (tokenizer included), written tensor by tensor
    python benchmarks/make_model.py write --family mixtral --size 12GB --out MODEL_DIR
    # the same checkpoint with transformers' fused expert keys, one shard per layer (for AirLLM)
    python benchmarks/make_model.py airllm MODEL_DIR AIRLLM_DIR
    # GGUF for llama.cpp, with the converter vendored in the llama-cpp-python sdist (see peers.py)
    python benchmarks/make_model.py gguf MODEL_DIR OUT.gguf [--outtype bf16]

``write`` is a thin CLI over ``sluice.synthetic`` (the project's one synthetic writer): the
family's base shape (``sluice.synthetic.BASE_CONFIGS``) with the expert count chosen for
``--size``. ``--std`` sets the weight scale: random models at the usual 0.02 have
near-tied logits, so greedy tokens differ between correct implementations (bf16 vs fp32,
another summation order). The benchmarks use ``--std 0.2`` (decisive logits and routing)
so that "greedy tokens match the reference" is a meaningful column.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

_SRC = Path(__file__).resolve().parent.parent / "src"
if str(_SRC) not in sys.path:
    sys.path.insert(0, str(_SRC))

import sluice  # noqa: E402,F401  (first: it sets OpenMP's wait policy before torch loads)
import torch  # noqa: E402

from sluice.synthetic import BASE_CONFIGS, model_bytes, scaled_config, write_model  # noqa: E402
from sluice.units import parse_size  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def config_for(family: str, size: float | None, dtype: torch.dtype, overrides: dict | None = None,
               experts: int | None = None) -> dict:
    if family not in BASE_CONFIGS:
        raise ValueError(f"unknown family {family!r}; known: {sorted(BASE_CONFIGS)}")
    base = json.loads(json.dumps(BASE_CONFIGS[family]))
    base.update(overrides or {})
    key = "num_local_experts" if family == "mixtral" else "num_experts"
    if experts is not None:
        base[key] = experts
        return base
    if size is None:
        return base
    return scaled_config(size, base, dtype)


def write(out: str | Path, family: str = "mixtral", size: float | None = None, dtype: str = "bf16",
          std: float = 0.2, seed: int = 0, overrides: dict | None = None, experts: int | None = None,
          progress: bool = True, force: bool = False) -> Path:
    """Write the checkpoint unless ``out`` already holds one with the same config."""
    out = Path(out)
    tdtype = DTYPES[dtype]
    cfg = config_for(family, size, tdtype, overrides, experts)
    stamp = {"config": cfg, "dtype": dtype, "std": std, "seed": seed}
    stamp_path = out / "bench_model.json"
    if not force and stamp_path.exists() and json.loads(stamp_path.read_text()) == stamp:
        return out
    write_model(out, cfg, dtype=tdtype, seed=seed, std=std, progress=progress)
    stamp_path.write_text(json.dumps(stamp, indent=2))
    return out


# -- AirLLM layout --------------------------------------------------------------------------
#
# AirLLM builds the transformers model on the meta device and assigns each layer's weights
# by their *in-memory* parameter names. transformers 5 holds MoE experts fused
# (``mlp.experts.gate_up_proj`` [E, 2I, H] = gate rows then up rows per expert,
# ``mlp.experts.down_proj`` [E, H, I]) while checkpoints store one tensor per expert, so
# AirLLM needs a checkpoint with fused keys. This writes one, streamed expert by expert (memory
# stays at one expert's tensor), with one shard per AirLLM module (embeddings, each decoder
# layer, final norm, head): AirLLM then hard-links the shards instead of re-splitting.

_EXPERT_NAMES = {
    # family: (moe block as stored, its in-memory name, (gate, up, down) per-expert names)
    "mixtral": ("block_sparse_moe", "mlp", ("w1", "w3", "w2")),
    "qwen3_moe": ("mlp", "mlp", ("gate_proj", "up_proj", "down_proj")),
}


def _module_of(name: str) -> str:
    parts = name.split(".")
    if "layers" in parts:
        i = parts.index("layers")
        return ".".join(parts[: i + 2])
    if "embed_tokens" in name:
        return "model.embed_tokens"
    if name.startswith("model.norm"):
        return "model.norm"
    return "lm_head"


def _fused_plan(config: dict, names: list[str], info) -> dict[str, list[tuple]]:
    """module -> [(out_name, dtype, shape, [(src_name, ...) parts in write order])]."""
    stored, mem, (g, u, d) = _EXPERT_NAMES[config["model_type"]]
    n_exp = config.get("num_local_experts") or config.get("num_experts")
    plan: dict[str, list[tuple]] = {}
    fused_layers = set()
    for n in names:
        if f".{stored}.experts." in n:
            fused_layers.add(n.split(f".{stored}.experts.")[0])
            continue
        out = n.replace(f".{stored}.gate.", f".{mem}.gate.")
        dtype, shape = info(n)
        plan.setdefault(_module_of(n), []).append((out, dtype, shape, [n]))
    for prefix in sorted(fused_layers, key=lambda p: int(p.split(".")[-1])):
        def src(e, role):
            return f"{prefix}.{stored}.experts.{e}.{role}.weight"

        dtype, (inter, hidden) = info(src(0, g))
        plan[_module_of(prefix + ".x")].extend([
            (f"{prefix}.{mem}.experts.gate_up_proj", dtype, (n_exp, 2 * inter, hidden),
             [src(e, r) for e in range(n_exp) for r in (g, u)]),
            (f"{prefix}.{mem}.experts.down_proj", dtype, (n_exp, hidden, inter), [src(e, d) for e in range(n_exp)]),
        ])
    return plan


def to_airllm(src: str | Path, dst: str | Path) -> Path:
    """Write ``src`` with transformers' fused in-memory keys, one shard per AirLLM module."""
    import math
    import struct

    from safetensors import safe_open

    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    index = src / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
    else:
        with safe_open(src / "model.safetensors", "pt") as f:
            weight_map = {n: "model.safetensors" for n in f.keys()}
    handles: dict[str, object] = {}

    def handle(name):
        fname = weight_map[name]
        if fname not in handles:
            handles[fname] = safe_open(src / fname, "pt")
        return handles[fname]

    def info(name):
        sl = handle(name).get_slice(name)
        return sl.get_dtype(), tuple(sl.get_shape())

    plan = _fused_plan(config, list(weight_map), info)
    tmp = dst.with_name(dst.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    sizes = {"BF16": 2, "F16": 2, "F32": 4}
    modules = list(plan)
    new_map = {}
    for i, module in enumerate(modules):
        fname = f"model-{i + 1:05d}-of-{len(modules):05d}.safetensors"
        header, off = {}, 0
        for out, dtype, shape, _ in plan[module]:
            nbytes = math.prod(shape) * sizes[dtype]
            header[out] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + nbytes]}
            off += nbytes
            new_map[out] = fname
        header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(tmp / fname, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for _, _, _, parts in plan[module]:
                for part in parts:
                    t = handle(part).get_tensor(part).contiguous()
                    f.write(memoryview(t.view(torch.uint8).numpy()))
                    del t
    handles.clear()
    (tmp / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum((tmp / f).stat().st_size for f in set(new_map.values()))},
         "weight_map": new_map}, indent=2))
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy(f, tmp / f.name)
    shutil.rmtree(dst, ignore_errors=True)
    os.replace(tmp, dst)
    return dst


# -- GGUF -----------------------------------------------------------------------------------

def to_gguf(src: str | Path, out: str | Path, python: str, converter: str | Path, outtype: str = "bf16") -> Path:
    """Run llama.cpp's ``convert_hf_to_gguf.py`` (from the llama-cpp-python sdist) in the peer venv.

    The synthetic tokenizer is a byte-level BPE that llama.cpp's pre-tokenizer table does not
    know; the converter refuses unknown ones, so the check is bypassed by naming the "default"
    pre-tokenizer (token ids are passed to every engine directly, so the pre-tokenizer is unused).
    """
    out = Path(out)
    converter = Path(converter)
    env = dict(os.environ)
    env["PYTHONPATH"] = str(converter.parent / "gguf-py") + os.pathsep + env.get("PYTHONPATH", "")
    shim = (
        "import runpy, sys\n"
        f"sys.argv = [{str(converter)!r}] + sys.argv[1:]\n"
        f"sys.path.insert(0, {str(converter.parent)!r})\n"
        "try:\n"
        "    import conversion as base  # newer converters: model classes in a package\n"
        "except ImportError:\n"
        "    import convert_hf_to_gguf as base\n"
        "base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'default'\n"
        # without a tokenizer.model the converter falls back to tokenizer.json on FileNotFoundError,
        # but it imports sentencepiece first: say "no file" before that import is needed
        "_sp = base.TextModel._set_vocab_sentencepiece\n"
        "def _sp_or_missing(self, *a, **k):\n"
        "    if not (self.dir_model / 'tokenizer.model').is_file():\n"
        "        raise FileNotFoundError('tokenizer.model')\n"
        "    return _sp(self, *a, **k)\n"
        "base.TextModel._set_vocab_sentencepiece = _sp_or_missing\n"
        f"runpy.run_path({str(converter)!r}, run_name='__main__')\n"
    )
    tmp = out.with_name(out.name + ".partial")
    subprocess.run([python, "-c", shim, str(src), "--outfile", str(tmp), "--outtype", outtype],
                   check=True, env=env)
    os.replace(tmp, out)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write", help="write a synthetic checkpoint in Hugging Face format")
    w.add_argument("--family", default="mixtral", choices=sorted(BASE_CONFIGS))
    w.add_argument("--size", default=None, help="target size, e.g. 12GB (sets the expert count)")
    w.add_argument("--experts", type=int, default=None, help="experts per layer (instead of --size)")
    w.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    w.add_argument("--std", type=float, default=0.2, help="weight std (default 0.2: decisive logits)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                   help="override a config key, e.g. --set num_hidden_layers=8 (repeatable)")
    w.add_argument("--out", required=True)
    w.add_argument("--force", action="store_true", help="rewrite even if the same model is there")
    a = sub.add_parser("airllm", help="rewrite a checkpoint with fused expert keys, one shard per layer (AirLLM)")
    a.add_argument("src")
    a.add_argument("dst")
    g = sub.add_parser("gguf", help="convert a checkpoint to GGUF with llama.cpp's converter")
    g.add_argument("src")
    g.add_argument("out")
    g.add_argument("--outtype", default="bf16", choices=["bf16", "f16", "f32"])
    g.add_argument("--cache", default=None, help="peer cache directory (default ~/.cache/sluice-bench)")
    args = p.parse_args(argv)
    if args.cmd == "write":
        overrides = {}
        for item in args.set:
            k, _, v = item.partition("=")
            overrides[k] = json.loads(v)
        size = parse_size(args.size) if args.size else None
        path = write(args.out, args.family, size, args.dtype, args.std, args.seed, overrides, args.experts,
                     force=args.force)
        cfg = json.loads((path / "config.json").read_text())
        print(f"wrote {path}: {model_bytes(cfg, DTYPES[args.dtype]) / 1e9:.2f} GB", file=sys.stderr)
    elif args.cmd == "airllm":
        print(f"wrote {to_airllm(args.src, args.dst)}", file=sys.stderr)
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import peers

        cache = peers.cache_dir(args.cache)
        py = peers.venv_python(cache, "llamacpp")
        conv = peers.converter_dir(cache) / "convert_hf_to_gguf.py"
        if not conv.exists():
            p.error(f"{conv} missing: run python benchmarks/peers.py install --peers llamacpp first")
        print(f"wrote {to_gguf(args.src, args.out, str(py), conv, args.outtype)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
