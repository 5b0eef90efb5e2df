"""The backend seam (``sluice.kernels.backend``): every call into the C kernels from outside
``src/sluice/kernels`` goes through the backend object, the CPU backend is the kernels
themselves (no wrapper), and ``assemble``'s placement hook is what a device tier plugs into.

The static check parses every module with ``ast`` (nothing is imported), like
tests/test_imports.py: outside the kernels package, the only import of it allowed is of
``kernels.backend``, and the only operations used on the backend are ``OPS``.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

from sluice import kernels
from sluice.experts.compute import expert_forward, expert_output, expert_outputs
from sluice.experts.spec import ExpertSpec
from sluice.kernels import backend
from sluice.quant import assemble_views

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "src" / "sluice"
BACKEND_MODULE = ("kernels", "backend")
BACKEND_NAMES = ("cpu", "backend")  # what call sites name the backend object: the instance, a parameter


def _module_parts(path: Path) -> list[str]:
    parts = list(path.relative_to(PKG).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def violations(source: str, parts: list[str], is_pkg: bool) -> tuple[list[str], set[str]]:
    """(uses of the kernels package that bypass the backend, backend operations used) in one
    module's source; ``parts`` is the module's dotted name relative to the package."""
    tree = ast.parse(source)
    bad: list[str] = []
    used: set[str] = set()
    here = parts if is_pkg else parts[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)] + (node.module.split(".") if node.module else [])
            elif node.module and (node.module == "sluice" or node.module.startswith("sluice.")):
                base = node.module.split(".")[1:]
            else:
                continue
            for alias in node.names:
                target = base + [alias.name]
                if tuple(base) == BACKEND_MODULE or tuple(target) == BACKEND_MODULE:
                    continue
                if base[:1] == ["kernels"] or target == ["kernels"]:
                    bad.append(f"line {node.lineno}: imports {'.'.join(target)} (use kernels.backend)")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                names = alias.name.split(".")
                if names[:2] == ["sluice", "kernels"] and tuple(names[1:]) != BACKEND_MODULE:
                    bad.append(f"line {node.lineno}: imports {alias.name} (use sluice.kernels.backend)")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "kernels":
                bad.append(f"line {node.lineno}: kernels.{node.attr} (call it on the backend)")
            elif node.value.id in BACKEND_NAMES:
                used.add(node.attr)
    return bad, used


def _outside_kernels():
    for path in sorted(PKG.rglob("*.py")):
        parts = _module_parts(path)
        if parts[:1] != ["kernels"]:
            yield path, parts


def test_every_kernel_call_goes_through_the_backend():
    bad, used = [], set()
    for path, parts in _outside_kernels():
        b, u = violations(path.read_text(encoding="utf-8"), parts, _is_package(path))
        bad += [f"{path.relative_to(ROOT)}: {v}" for v in b]
        used |= u
    assert not bad, "calls into the C kernels that bypass kernels.backend:\n" + "\n".join(bad)
    assert used - {"name"} <= set(backend.OPS), f"operations not named in backend.OPS: {used - set(backend.OPS)}"
    assert set(backend.OPS) <= used, f"OPS that no call site uses: {set(backend.OPS) - used}"


def test_the_checker_finds_bypasses():
    """The walker on known code: each way around the backend is found, the allowed forms are not."""
    mod = ["quant", "dense"]
    for src in ("from .. import kernels\n", "from ..kernels import dense\n", "import sluice.kernels\n",
                "from sluice import kernels\n", "from sluice.kernels import _lib\n", "x = kernels.dense(a, b)\n"):
        bad, _ = violations(src, mod, False)
        assert bad, src
    ok = ("from ..kernels.backend import cpu\nx = cpu.dense(a, b)\n"
          "from ..kernels import backend\nfrom sluice.kernels.backend import Backend\n")
    bad, used = violations(ok, mod, False)
    assert not bad and used == {"dense"}
    assert violations("from . import kernels\n", ["engine"], False)[0]  # a top-level module
    assert not violations("from .kernels.backend import cpu\n", ["engine"], False)[0]


def test_cpu_backend_is_the_kernels_themselves():
    """Zero overhead: each operation is the kernels' own function (no wrapper, no bound method)."""
    cpu = backend.current()
    assert cpu is backend.cpu and isinstance(cpu, backend.Backend)
    for op in backend.OPS:
        if op in ("library_path", "place_experts"):
            continue
        assert getattr(cpu, op) is getattr(kernels, op), op
    assert cpu.library_path is kernels._find_library
    views = {"gate": torch.ones(2, 2)}
    assert cpu.place_experts(views) is views  # on the CPU an expert stays where it was read


def test_protocol_names_exactly_the_ops():
    members = {n for n, v in vars(backend.Backend).items() if inspect.isfunction(v) and not n.startswith("_")}
    assert members == set(backend.OPS)
    for op in backend.OPS:  # the protocol's signatures are the kernels' (less self)
        if op in ("library_path", "place_experts"):
            continue
        proto = list(inspect.signature(getattr(backend.Backend, op)).parameters)[1:]
        assert proto == list(inspect.signature(getattr(kernels, op)).parameters), op


class CopyingBackend(backend.CpuBackend):
    """A second backend with its own memory pool, as a device tier would have: ``place_experts``
    copies the views into the pool (here host memory, fresh tensors) and counts its bytes."""

    name = "copying"

    def __init__(self, pool_bytes: int):
        super().__init__()
        self.pool_bytes, self.used, self.calls = pool_bytes, 0, 0
        self.place_experts = self._place

    def _place(self, views):
        self.calls += 1
        nbytes = sum(t.numel() * t.element_size() for t in views.values())
        if self.used + nbytes > self.pool_bytes:
            raise MemoryError("device pool full")
        self.used += nbytes
        return {name: t.clone() for name, t in views.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_assemble_places_experts_through_the_backend(dtype):
    h, i = 64, 32
    g = torch.Generator().manual_seed(3)
    views = {"gate": torch.randn(i, h, generator=g).to(dtype), "up": torch.randn(i, h, generator=g).to(dtype),
             "down": torch.randn(h, i, generator=g).to(dtype)}
    dev = CopyingBackend(pool_bytes=10 << 20)
    host = assemble_views(views)
    placed = assemble_views(views, backend=dev)
    assert host.backend is backend.cpu and placed.backend is dev and dev.calls == 1
    assert host["gate"].data_ptr() == views["gate"].data_ptr()  # CPU: bound where it was read
    assert placed["gate"].data_ptr() != views["gate"].data_ptr()  # the device copy is what is bound
    assert dev.used == sum(t.numel() * t.element_size() for t in views.values())
    assert placed.swiglu_args[0] == placed["gate"].data_ptr()
    spec = ExpertSpec(hidden=h, intermediate=i)
    for t in (1, 5):
        x = torch.randn(t, h, generator=g)
        assert torch.equal(expert_forward(spec, placed, x), expert_forward(spec, host, x))
        assert torch.equal(expert_output(spec, placed, x, 0.5), expert_output(spec, host, x, 0.5))
    x = torch.randn(1, h, generator=g)
    assert all(torch.equal(a, b) for a, b in zip(expert_outputs(spec, [placed, host], x, [0.25, 2.0]),
                                                 expert_outputs(spec, [host, host], x, [0.25, 2.0])))
    with pytest.raises(MemoryError):
        assemble_views(views, backend=CopyingBackend(pool_bytes=1))


def test_the_expert_cache_assembles_through_its_backend(model_dir):
    """The read path end to end: an engine whose expert cache has a second backend places every
    expert it reads there (one ``place_experts`` per read) and computes the same bits."""
    import sluice
    from conftest import prompt_ids

    path = model_dir("qwen3_moe")
    ids = prompt_ids(n=10, seed=2)
    with sluice.load(path, memory="2GiB", progress=False) as plain, \
            sluice.load(path, memory="2GiB", progress=False) as placed:
        assert plain.cache.backend is backend.cpu and placed.cache.ready_count == 0
        dev = CopyingBackend(pool_bytes=1 << 30)
        placed.cache.backend = dev
        want, got = plain.forward(ids), placed.forward(ids)
        assert torch.equal(want, got)
        assert plain.generate(ids.tolist(), max_new_tokens=4).token_ids == \
            placed.generate(ids.tolist(), max_new_tokens=4).token_ids
        ready = [s for s in placed.cache.slots if s.weights is not None]
        assert ready and all(s.weights.backend is dev for s in ready)
        reads = placed.experts.counters.demand_reads + placed.experts.counters.prefetch_reads
        assert 0 < len(ready) <= dev.calls <= reads  # once per completed read (a cancelled prefetch: none)
