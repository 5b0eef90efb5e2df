"""Import rules of ``src/sluice``: which layer may import which, and no cycles.

Every module is parsed with ``ast`` (nothing is imported); relative imports are resolved, and
imports inside functions count like module-level ones: deferring an import is for start-up
time (``sluice --help`` must not load torch), never a way around a rule or a cycle. The
rules live in ``LAYERS`` and ``MAY_IMPORT`` below and nowhere else; docs/architecture.md
shows them as the table ``python tests/test_imports.py`` prints, and a test keeps the two equal.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
PACKAGE = "sluice"

# layer -> (what it is, the modules in it). A module is named relative to the package ("" is
# the package itself, sluice/__init__.py); a name covers its submodules ("storage" is
# storage/ and everything under it). Every module of the package is in exactly one layer.
LAYERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "base": ("errors, sizes, progress bars, system memory, the decayed-frequency rule",
             ("errors", "units", "progress", "sysmem", "decay")),
    "kernels": ("C kernels, their ctypes bindings, the backend every call goes through", ("kernels",)),
    "quant": ("weight formats and their matrix products", ("quant",)),
    "storage": ("files and bytes: reads, buffers, the disk tier of remote models, safetensors tables, the container "
                "format, where a named model is",
                ("storage", "checkpoint", "container", "container_files", "resolve", "outputs")),
    "layers": ("attention, MLA, linear attention, norms, rotary, routing, sampling", ("layers",)),
    "experts": ("the expert interface: sources, layouts, cache and policies, readers, compute", ("experts",)),
    "rows": ("the row store: token-keyed tables read by row, resident or through a bounded cache", ("rows",)),
    "models": ("one module per model family, and what families share (config checks, the int8 spine)",
               ("models",)),
    "planner": ("memory budget -> spine residency, KV cache, buffers, expert cache", ("plan",)),
    "cluster": ("experts sharded over Ray actors: the driver's provider, the workers, placement, signatures",
                ("cluster",)),
    "runtime": ("the engine's moving parts: generation, scheduler, model runner, stats, speculation, spine "
                "streaming, tokenizer, chat templates, traces",
                ("generation", "scheduler", "runner", "speculative", "spine", "stats", "text", "tokenizer",
                 "chat_template", "trace")),
    "api": ("sluice.load, Engine, ModelInfo, their options and the checks of their arguments",
            ("", "engine", "model_info", "options", "validate", "lossy", "prompt_fit")),
    "tools": ("programs over the API",
              ("convert", "convert_install", "check", "replay", "synthetic", "model_report", "bench")),
    "faces": ("what users run: the command line, terminal chat, demo, HTTP server",
              ("cli", "cli_args", "cli_flags", "cli_prompt", "chat", "demo", "server")),
}

# layer -> the other layers its modules may import (modules of the same layer may import each other)
MAY_IMPORT: dict[str, tuple[str, ...]] = {
    "base": (),
    "kernels": ("base",),
    "quant": ("kernels", "base"),
    "storage": ("kernels", "base"),
    "layers": ("quant", "kernels", "base"),
    "experts": ("layers", "quant", "kernels", "storage", "base"),
    "rows": ("storage", "kernels", "base"),
    "models": ("experts", "layers", "quant", "kernels", "base"),
    "planner": ("base",),
    "cluster": ("planner", "models", "experts", "layers", "quant", "kernels", "storage", "base"),
    "runtime": ("layers", "storage", "base"),
    "api": ("runtime", "planner", "cluster", "models", "rows", "experts", "layers", "quant", "kernels", "storage",
            "base"),
    "tools": ("api", "runtime", "planner", "cluster", "models", "rows", "experts", "layers", "quant", "kernels",
              "storage", "base"),
    "faces": ("tools", "api", "runtime", "planner", "cluster", "models", "rows", "experts", "layers", "quant",
              "kernels", "storage", "base"),
}

ENTRY_POINT = "cli"  # the ``sluice`` command: nothing imports it

# third-party packages only some modules may import (everything else may import any)
THIRD_PARTY_ONLY: dict[str, tuple[str, ...]] = {
    "transformers": (),  # a test and benchmark dependency only
    "fastapi": ("server",),
    "starlette": ("server",),
    "uvicorn": ("server",),
    "pydantic": ("server",),
    "ray": ("cluster",),  # the optional ray extra (docs/scale-out.md)
}


@dataclass(frozen=True)
class Edge:
    source: str  # importing module, dotted relative name ("" = the package)
    target: str  # imported module of the package, or a top-level third-party name
    line: int
    in_function: bool
    internal: bool


def _modules() -> dict[str, tuple[Path, bool]]:
    """Relative dotted name -> (file, is a package __init__)."""
    out = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC / PACKAGE).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        out[".".join(parts)] = (path, is_pkg)
    return out


def _rel(absolute: str) -> str | None:
    if absolute == PACKAGE:
        return ""
    if absolute.startswith(PACKAGE + "."):
        return absolute[len(PACKAGE) + 1:]
    return None


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _imports(name: str, path: Path, is_pkg: bool, modules: dict) -> list[Edge]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    edges: list[Edge] = []

    def internal(target: str, node, in_function: bool) -> None:
        if target not in modules:
            raise AssertionError(f"{path}:{node.lineno}: import of {_join(PACKAGE, target)!r} resolves to no module")
        edges.append(Edge(name, target, node.lineno, in_function, True))

    def visit(node, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    rel = _rel(alias.name)
                    if rel is None:
                        edges.append(Edge(name, alias.name.split(".")[0], child.lineno, in_function, False))
                    else:
                        internal(rel, child, in_function)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    here = name.split(".") if name else []
                    if not is_pkg:
                        here = here[:-1]
                    if child.level - 1 > len(here):
                        raise AssertionError(f"{path}:{child.lineno}: relative import beyond the package")
                    base = _join(*here[: len(here) - (child.level - 1)], child.module or "")
                else:
                    base = _rel(child.module or "")
                    if base is None:
                        edges.append(Edge(name, child.module.split(".")[0], child.lineno, in_function, False))
                        continue
                for alias in child.names:
                    sub = _join(base, alias.name)
                    # ``from . import generation`` imports a module; ``from .errors import X`` a name
                    internal(sub if sub in modules else base, child, in_function)
            visit(child, inner)

    visit(tree, False)
    return edges


def _graph() -> tuple[dict, list[Edge]]:
    modules = _modules()
    edges = [e for name, (path, is_pkg) in modules.items() for e in _imports(name, path, is_pkg, modules)]
    return modules, edges


def layer_of(module: str) -> str:
    hits = [layer for layer, (_, names) in LAYERS.items()
            for n in names if module == n or (n and module.startswith(n + "."))]
    if len(hits) != 1:
        raise AssertionError(f"module {_join(PACKAGE, module) or PACKAGE} is in {len(hits)} layers {hits}: "
                             "place it in exactly one layer of LAYERS (tests/test_imports.py) and docs/architecture.md")
    return hits[0]


def _where(e: Edge, modules) -> str:
    path = modules[e.source][0].relative_to(ROOT)
    return f"{path}:{e.line}{' (inside a function)' if e.in_function else ''}"


def _cycles(edges: list[Edge]) -> list[list[str]]:
    """Strongly connected components with more than one module (or a module importing itself)."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.source, set()).add(e.target)
        graph.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:  # Tarjan; the package is small enough for recursion
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph[v]:
                out.append(sorted(_join(PACKAGE, m) or PACKAGE for m in comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def render_table() -> str:
    """The layer table of docs/architecture.md, from LAYERS and MAY_IMPORT."""
    def mods(names):
        return ", ".join("`__init__.py`" if n == "" else f"`{n}/`" if (SRC / PACKAGE / n).is_dir() else f"`{n}.py`"
                         for n in names)

    rows = ["| layer | modules | what it is | may import |", "|---|---|---|---|"]
    for layer, (what, names) in LAYERS.items():
        rows.append(f"| {layer} | {mods(names)} | {what} | {', '.join(MAY_IMPORT[layer]) or 'nothing'} |")
    return "\n".join(rows)


# ---------------------------------------------------------------------------------- tests ----

def test_rules_are_consistent():
    assert set(LAYERS) == set(MAY_IMPORT)
    for layer, allowed in MAY_IMPORT.items():
        assert layer not in allowed and set(allowed) <= set(LAYERS), layer
    order = list(LAYERS)  # the layers are listed bottom-up: a layer imports only layers listed before it
    for layer, allowed in MAY_IMPORT.items():
        assert all(order.index(a) < order.index(layer) for a in allowed), layer


def test_every_module_is_in_exactly_one_layer():
    modules, _ = _graph()
    for module in modules:
        layer_of(module)
    for layer, (_, names) in LAYERS.items():
        for n in names:
            assert any(m == n or (n and m.startswith(n + ".")) for m in modules), f"{layer}: {n!r} names no module"


def test_layers_import_only_what_they_may():
    modules, edges = _graph()
    bad = []
    for e in edges:
        if not e.internal:
            continue
        src, dst = layer_of(e.source), layer_of(e.target)
        if src != dst and dst not in MAY_IMPORT[src]:
            bad.append(f"{_where(e, modules)}: {src} imports {dst} ({_join(PACKAGE, e.target)})")
    assert not bad, "imports against the layer rules:\n" + "\n".join(sorted(set(bad)))


def test_nothing_imports_the_entry_point():
    modules, edges = _graph()
    bad = [_where(e, modules) for e in edges if e.internal and layer_of(e.target) == layer_of(ENTRY_POINT)
           and (e.target == ENTRY_POINT or e.target.startswith(ENTRY_POINT + ".")) and e.source != ENTRY_POINT]
    assert not bad, f"{PACKAGE}.{ENTRY_POINT} is imported by: {sorted(set(bad))}"


def test_restricted_third_party_imports():
    modules, edges = _graph()
    bad = []
    for e in edges:
        if e.internal or e.target not in THIRD_PARTY_ONLY:
            continue
        allowed = THIRD_PARTY_ONLY[e.target]
        if not any(e.source == a or e.source.startswith(a + ".") for a in allowed):
            bad.append(f"{_where(e, modules)}: imports {e.target}")
    assert not bad, "\n".join(sorted(set(bad)))


@pytest.mark.parametrize("scope", ["module level", "with function-level imports"])
def test_no_import_cycles(scope):
    modules, edges = _graph()
    if scope == "module level":
        edges = [e for e in edges if not e.in_function]
    cycles = _cycles([e for e in edges if e.internal])
    assert not cycles, f"import cycles ({scope}): {cycles}"


def test_the_checker_finds_what_it_should():
    """The walker on known code: relative levels, function-level imports, ``from . import module``."""
    modules, edges = _graph()
    got = {(e.source, e.target, e.in_function) for e in edges if e.internal}
    assert ("engine", "generation", False) in got  # from . import generation
    assert ("engine", "validate", False) in got  # from . import validate
    assert ("engine", "kernels.backend", False) in got  # from .kernels.backend import cpu (a name)
    assert ("layers.attention", "quant", False) in got  # from ..quant import linear
    assert ("", "engine", True) in got  # the lazy exports of sluice/__init__.py
    assert ("cli", "server", True) in got  # from .server import serve_command, inside cmd_serve
    assert ("quant", "quant.int8", False) in got
    assert any(not e.internal and e.source == "engine" and e.target == "torch" for e in edges)
    assert _cycles([Edge("a", "b", 1, False, True), Edge("b", "c", 1, True, True), Edge("c", "a", 1, False, True),
                    Edge("c", "d", 1, False, True)]) == [["sluice.a", "sluice.b", "sluice.c"]]


def test_architecture_doc_shows_these_rules():
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert render_table() in doc, ("docs/architecture.md's layer table differs from the rules in "
                                   "tests/test_imports.py; paste the output of: python tests/test_imports.py")


if __name__ == "__main__":
    sys.stdout.write(render_table() + "\n")
