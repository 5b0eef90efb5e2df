"""llama.cpp built from source with cmake: find its binaries, convert a checkpoint to GGUF, run its server.

The benchmarks that compare with llama.cpp's own programs (``llama-server``, ``llama-bench``)
take the llama.cpp directory as ``--llama-cpp DIR`` or ``$SLUICE_LLAMA_CPP``: a llama.cpp
source tree (for example the one vendored in the llama-cpp-python sdist that
``benchmarks/peers.py`` pins, ``llama_cpp_python-0.3.36/vendor/llama.cpp``) built with

    cmake -S DIR -B DIR/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \\
          -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF
    cmake --build DIR/build --target llama-server llama-bench

Binaries are looked for in ``DIR/build/bin``, ``DIR/bin`` and ``DIR``. The tree's
``convert_hf_to_gguf.py`` and ``gguf-py`` convert a Hugging Face checkpoint to GGUF (with this
Python: it needs torch, numpy, safetensors and transformers, which Sluice's test extra has);
conversions are cached under ``<bench cache>/gguf`` (``$SLUICE_BENCH_CACHE``, default
``~/.cache/sluice-bench``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import make_model
import peers

ENV = "SLUICE_LLAMA_CPP"


class LlamaCppMissing(RuntimeError):
    pass


def root(path: str | None = None) -> Path:
    p = path or os.environ.get(ENV)
    if not p:
        raise LlamaCppMissing(f"no llama.cpp given: pass --llama-cpp DIR or set ${ENV} (a llama.cpp source tree "
                              "built with cmake; see benchmarks/llamacpp.py)")
    p = Path(p).expanduser()
    if not p.is_dir():
        raise LlamaCppMissing(f"{p} is not a directory")
    return p


def binary(name: str, path: str | None = None) -> Path:
    r = root(path)
    for d in (r / "build" / "bin", r / "bin", r):
        if (d / name).is_file() and os.access(d / name, os.X_OK):
            return d / name
    raise LlamaCppMissing(f"{name} not found under {r} (build/bin, bin): build it with "
                          f"`cmake --build {r}/build --target {name}`")


def version(path: str | None = None) -> str:
    try:
        out = subprocess.run([str(binary("llama-server", path)), "--version"], capture_output=True, text=True,
                             timeout=30)
        return (out.stdout + out.stderr).strip().splitlines()[0]
    except (LlamaCppMissing, OSError, IndexError, subprocess.TimeoutExpired):
        return "unknown"


def outtype_for(model: Path) -> str:
    """The GGUF type that keeps the checkpoint's precision: f32 stays f32, bf16 stays bf16."""
    dtype = json.loads((model / "config.json").read_text()).get("dtype") or json.loads(
        (model / "config.json").read_text()).get("torch_dtype")
    return {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}.get(dtype, "bf16")


def gguf(model: Path, path: str | None = None, out_dir: Path | None = None, outtype: str | None = None) -> Path:
    """``model`` converted to GGUF at its own precision (converted once, then reused)."""
    model = Path(model).resolve()
    outtype = outtype or outtype_for(model)
    out_dir = out_dir or peers.cache_dir() / "gguf"
    out = out_dir / f"{model.name}-{outtype}.gguf"
    if out.exists() and out.stat().st_mtime >= (model / "config.json").stat().st_mtime:
        return out
    conv = root(path) / "convert_hf_to_gguf.py"
    if not conv.exists():
        raise LlamaCppMissing(f"{conv} not found: --llama-cpp must be a llama.cpp source tree to convert models")
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    print(f"converting {model} to {out} ({outtype}) ...", flush=True)
    make_model.to_gguf(model, out, sys.executable, conv, outtype)
    print(f"  converted in {time.time() - t0:.0f} s", flush=True)
    return out
