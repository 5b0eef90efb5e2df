"""Install the peer engines into their own virtual environments (never into Sluice's).

    python benchmarks/peers.py install [--peers hf,llamacpp,airllm] [--cache DIR]
    python benchmarks/peers.py status  [--cache DIR]

Each peer gets a venv under ``<cache>/venvs/<peer>`` (default cache ``~/.cache/sluice-bench``,
or ``$SLUICE_BENCH_CACHE``). torch 2.13.0 (CPU) is installed first in each one so that no
peer's dependencies pull a CUDA build. Everything comes from the package registries at
install time; nothing is downloaded when a benchmark runs.

- ``hf``: transformers + accelerate (disk offload through ``device_map``/``max_memory``).
- ``llamacpp``: llama-cpp-python, built from its sdist (about 12 minutes on 2 cores); the
  sdist's vendored ``convert_hf_to_gguf.py`` and ``gguf-py`` are kept for the conversion.
- ``airllm``: AirLLM 4.0.0, used on CPU.

``status`` also says whether ``$SLUICE_LLAMA_CPP`` names a llama.cpp tree with ``llama-server``
and ``llama-bench`` built (``benchmarks/concurrency.py`` and ``benchmarks/warm_vs_llamacpp.py``
use those; how to build them: ``benchmarks/llamacpp.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

TORCH = "torch==2.13.0"
TRANSFORMERS = "transformers==5.24.0"
LLAMA_CPP = "llama-cpp-python==0.3.36"
AIRLLM = "airllm==4.0.0"

PEERS = {
    # peer: (packages installed after torch, the import that proves it works)
    "hf": ([TRANSFORMERS, "accelerate>=1.0", "safetensors"], "import transformers, accelerate"),
    "llamacpp": ([TRANSFORMERS, "numpy", "sentencepiece", "safetensors", LLAMA_CPP], "import llama_cpp"),
    # transformers pinned as for the others: AirLLM builds the transformers model and loads
    # weights by its in-memory parameter names, which change between transformers versions
    "airllm": ([TRANSFORMERS, AIRLLM], "import airllm"),
}


def cache_dir(path: str | None = None) -> Path:
    return Path(path or os.environ.get("SLUICE_BENCH_CACHE") or Path.home() / ".cache" / "sluice-bench").expanduser()


def venv_python(cache: Path, peer: str) -> Path:
    return cache / "venvs" / peer / "bin" / "python"


def installed(cache: Path, peer: str) -> bool:
    return (cache / "venvs" / peer / ".installed").exists()


def converter_dir(cache: Path) -> Path:
    """Where the llama.cpp sdist's ``convert_hf_to_gguf.py`` (and its ``gguf-py``) are unpacked."""
    return cache / "llama.cpp-convert"


def _run(cmd: list[str], log, env=None) -> None:
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT, env=env)


def _unpack_converter(cache: Path, py: Path, log) -> None:
    """Fetch the llama-cpp-python sdist (the same version, from the registry) and keep its converter."""
    dest = converter_dir(cache)
    if (dest / "convert_hf_to_gguf.py").exists():
        return
    tmp = cache / "sdist"
    shutil.rmtree(tmp, ignore_errors=True)
    _run([str(py), "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(tmp), LLAMA_CPP], log)
    archive = next(tmp.glob("llama_cpp_python-*.tar.gz"))
    with tarfile.open(archive) as tf:
        members = [m for m in tf.getmembers()
                   if "/vendor/llama.cpp/" in m.name and (m.name.endswith("convert_hf_to_gguf.py")
                                                           or "/vendor/llama.cpp/gguf-py/" in m.name
                                                           or "/vendor/llama.cpp/conversion/" in m.name)]
        tf.extractall(tmp / "x", members=members, filter="data")
    root = next((tmp / "x").glob("*/vendor/llama.cpp"))
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(root / "convert_hf_to_gguf.py", dest / "convert_hf_to_gguf.py")
    shutil.copytree(root / "gguf-py", dest / "gguf-py", dirs_exist_ok=True)
    if (root / "conversion").is_dir():  # newer converters keep the model classes in a package
        shutil.copytree(root / "conversion", dest / "conversion", dirs_exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)


def install(peer: str, cache: Path, python: str = sys.executable) -> Path:
    pkgs, probe = PEERS[peer]
    root = cache / "venvs" / peer
    py = venv_python(cache, peer)
    log_path = cache / f"install-{peer}.log"
    cache.mkdir(parents=True, exist_ok=True)
    if installed(cache, peer):
        return py
    t0 = time.time()
    with open(log_path, "a") as log:
        if not py.exists():
            base = getattr(sys, "_base_executable", None) or python
            _run([base, "-m", "venv", str(root)], log)
        pip = [str(py), "-m", "pip", "install", "--no-input"]
        _run(pip + ["--upgrade", "pip", "setuptools", "wheel"], log)
        _run(pip + [TORCH], log)
        env = dict(os.environ)
        if peer == "llamacpp":
            env.setdefault("CMAKE_ARGS", "-DGGML_NATIVE=ON")  # build for this CPU (AVX2 here)
            env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
        # the torch pin keeps the CPU build whatever the peer's requirements say
        _run(pip + [TORCH] + pkgs, log, env=env)
        if peer == "llamacpp":
            _unpack_converter(cache, py, log)
        _run([str(py), "-c", probe], log)
        (root / ".installed").write_text(json.dumps({"seconds": time.time() - t0, "packages": [TORCH] + pkgs}))
    return py


def status(cache: Path) -> dict:
    out = {}
    for peer in PEERS:
        py = venv_python(cache, peer)
        out[peer] = {"installed": installed(cache, peer), "python": str(py) if py.exists() else None}
    # llama.cpp's own programs, built with cmake (benchmarks/llamacpp.py), for the benchmarks
    # that run llama-server and llama-bench
    tree = os.environ.get("SLUICE_LLAMA_CPP")
    found = {}
    if tree:
        for name in ("llama-server", "llama-bench"):
            hits = [d / name for d in (Path(tree) / "build" / "bin", Path(tree) / "bin", Path(tree))
                    if (d / name).is_file()]
            found[name] = str(hits[0]) if hits else None
    out["llamacpp-cmake"] = {"SLUICE_LLAMA_CPP": tree, **found}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=["install", "status"])
    p.add_argument("--peers", default=",".join(PEERS), help="comma-separated: " + ",".join(PEERS))
    p.add_argument("--cache", default=None, help="cache directory (default ~/.cache/sluice-bench)")
    args = p.parse_args(argv)
    cache = cache_dir(args.cache)
    if args.action == "status":
        print(json.dumps(status(cache), indent=2))
        return 0
    failed = []
    for peer in [s.strip() for s in args.peers.split(",") if s.strip()]:
        if peer not in PEERS:
            p.error(f"unknown peer {peer!r}")
        print(f"installing {peer} (log: {cache / f'install-{peer}.log'}) ...", flush=True)
        try:
            install(peer, cache)
            print(f"  {peer}: ok", flush=True)
        except subprocess.CalledProcessError as e:
            failed.append(peer)
            print(f"  {peer}: FAILED ({e}); see the log", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
