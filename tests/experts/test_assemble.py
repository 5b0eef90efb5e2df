"""One assembly point for expert weights (``sluice.quant.assemble``).

Source rules (``ast``, nothing imported): no module outside ``quant/`` turns an expert record's
bytes into weights, and expert compute (``experts/compute.py``, ``experts/fused.py``) never
branches on view or format names. Behaviour: ``assemble`` runs once per completed read (a
cached expert keeps its assembled weights however often it is computed), and its weights are
views over the slot memory. Bit-identical logits across families and formats are checked by
the family, fidelity, batch-invariance and kernel-ISA tests.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import sluice
from conftest import prompt_ids
from sluice.experts import cache as cache_module
from sluice.quant import FORMATS, assemble
from sluice.quant.assembly import BIASES

SRC = Path(__file__).resolve().parents[2] / "src" / "sluice"
ROLES = ("gate", "up", "down", "gate_up", "gate_up_t", "down_t")
# the builders of expert weights from bytes or views: only quant/ calls them
BUILDERS = {"record_views", "assemble_views", "ExpertWeights"}
# matrix wrappers that the expert path gets from assemble only (the spine builds its own: models/)
MATRICES = {"QuantMatrix", "BlockFP8"}
EXPERT_PATH = ("experts/", "cluster/", "convert.py", "container.py", "engine.py", "runner.py", "storage/")


def _modules():
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if not rel.startswith("quant/"):
            yield rel, ast.parse(path.read_text(), filename=str(path))


def _called_name(call: ast.Call) -> str | None:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def _violations(rel: str, tree: ast.AST) -> list[str]:
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = _called_name(node)
            if name in BUILDERS:
                bad.append(f"{rel}:{node.lineno}: calls {name}")
            if name in MATRICES and rel.startswith(EXPERT_PATH):
                bad.append(f"{rel}:{node.lineno}: builds a {name}")
            # a tensor over a buffer at a view's slot offset: bytes -> weights by hand
            if name == "tensor" and any(isinstance(a, ast.Attribute) and a.attr == "slot_offset"
                                        for arg in node.args for a in ast.walk(arg)):
                bad.append(f"{rel}:{node.lineno}: makes tensors at views' slot offsets")
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if alias.name == "assemble" and (node.module or "").split(".")[-1] not in ("quant", "assembly"):
                    bad.append(f"{rel}:{node.lineno}: imports assemble from {node.module}")
    return bad


def test_only_quant_assembles_expert_weights():
    bad = [v for rel, tree in _modules() for v in _violations(rel, tree)]
    assert not bad, "\n".join(bad)


def test_the_rule_catches_assembly_by_hand():
    """The checker flags what the expert path did before ``assemble`` existed."""
    old = ast.parse(
        "from ..quant.fp8 import assemble\n"
        "from ..quant import QuantMatrix\n"
        "def views(buf, base, layout):\n"
        "    return {v.name: buf.tensor(base + v.slot_offset, v.dtype, v.shape) for v in layout.views}\n"
        "w = QuantMatrix('q4', parts, 2, 32)\n")
    assert len(_violations("experts/cache.py", old)) == 3


NAMES = set(ROLES) | set(BIASES) | set(FORMATS) | {r + "_scale_inv" for r in ROLES}


def _name_branches(tree: ast.AST) -> list[str]:
    """String constants that are view or format names (or "<role>.<part>") used in a comparison,
    a subscript or a ``.get``; and ``isinstance`` calls (branching on a weight's type)."""
    found = []

    def check(node, where):
        for c in ast.walk(node):
            if isinstance(c, ast.Constant) and isinstance(c.value, str) and (
                    c.value in NAMES or any(c.value.startswith(r + ".") for r in ROLES)):
                found.append(f"{where} line {c.lineno}: {c.value!r}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            check(node, "comparison")
        elif isinstance(node, ast.Subscript):
            check(node.slice, "subscript")
        elif isinstance(node, ast.Call) and _called_name(node) == "get":
            check(node, ".get")
        elif isinstance(node, ast.Call) and _called_name(node) == "isinstance":
            found.append(f"isinstance at line {node.lineno}")
    return found


@pytest.mark.parametrize("module", ["experts/compute.py", "experts/fused.py"])
def test_compute_does_not_branch_on_view_or_format_names(module):
    tree = ast.parse((SRC / module).read_text())
    assert not _name_branches(tree), _name_branches(tree)


def test_the_name_rule_catches_branching():
    old = ast.parse('if "gate_up_t" in w: pass\n'
                    'b = w.get("down_bias")\n'
                    'if spec.input_major and isinstance(w["gate"], torch.Tensor): pass\n'
                    'if fmt == "q4": pass\n')
    assert len(_name_branches(old)) == 5


def _counting(monkeypatch) -> list:
    calls = []

    def counted(buf, base, record, backend):
        calls.append(base)
        return assemble(buf, base, record, backend)

    monkeypatch.setattr(cache_module, "assemble", counted)
    return calls


@pytest.mark.parametrize("prefetch", [False, True])
def test_assemble_runs_once_per_completed_read(model_dir, monkeypatch, prefetch):
    """A short generation with a small cache: experts are read, evicted and read again, and
    computed far more often than read; ``assemble`` runs once per read that completed (never per
    forward), and the cached slot's weights are views over the slot memory."""
    calls = _counting(monkeypatch)
    eng = sluice.load(model_dir("qwen3_moe"), memory="2GiB", cache_experts=6, prefetch=prefetch, progress=False)
    eng.generate(prompt_ids(n=6, seed=4).tolist(), max_new_tokens=6)
    p = eng.experts
    p.drain()  # settle reads still in flight (prefetches)
    c = p.counters
    completed = c.demand_reads + c.prefetch_reads - c.prefetch_cancelled - c.prefetch_aborted
    assert len(calls) == completed, (len(calls), c)
    assert eng.cache.evictions > 0 and c.compute_calls > len(calls)
    if prefetch:
        assert c.prefetch_reads > 0
    arena = eng.cache.arena.tensor(0, torch.uint8, (eng.cache.arena.nbytes,))
    lo, hi = arena.data_ptr(), arena.data_ptr() + arena.numel()
    slot = next(s for s in eng.cache.slots if s.weights is not None)
    for name in slot.weights:
        t = slot.weights[name]
        assert lo <= t.data_ptr() < hi, name  # a view of the slot, not a copy
    eng.close()


def test_fused_layouts_canonical_form_matches_its_plan():
    """GPT-OSS's fused records (input-major dense, row-interleaved MXFP4): ``canonical()`` (what
    convert writes) is what ``canonical_views`` plans, and computes the same bits as the fused
    record (``input_major``: both summed in the checkpoint's order)."""
    from sluice.experts.compute import expert_forward
    from sluice.experts.spec import ExpertSpec
    from sluice.quant import QuantMatrix, assemble_views
    from sluice.quant.assembly import canonical_views

    h, i = 64, 32
    spec = ExpertSpec(hidden=h, intermediate=i, variant="clamped_swiglu", bias=True)
    g = torch.Generator().manual_seed(0)
    dense = {"gate_up_t": torch.randn(h, 2 * i, generator=g).bfloat16(),
             "gate_up_bias": torch.randn(2 * i, generator=g),
             "down_t": torch.randn(i, h, generator=g).bfloat16(), "down_bias": torch.randn(h, generator=g)}
    q = {role: FORMATS["mxfp4"].quantize(torch.randn(n, k, generator=g)) for role, (n, k) in
         {"gate_up": (2 * i, h), "down": (h, i)}.items()}
    mx = {f"{role}.{part}": t for role, parts in q.items() for part, t in parts.items()}
    mx.update(gate_up_bias=dense["gate_up_bias"], down_bias=dense["down_bias"])
    x = torch.randn(3, h, generator=g)
    for views, fmt, shapes in ((dense, None, None), (mx, "mxfp4", {"gate_up": (2 * i, h), "down": (h, i)})):
        fused = assemble_views(views, fmt, shapes, exact=True, input_major=True)
        canon = fused.canonical()
        plan = canonical_views([(n, t.dtype, tuple(t.shape)) for n, t in views.items()], spec.matrix_shapes())
        got = [(n, torch.float32 if isinstance(t, QuantMatrix) else t.dtype, tuple(t.shape)) for n, t in canon.items()]
        assert sorted(got, key=str) == sorted(plan, key=str)
        again = assemble_views({n: t for n, t in canon.items() if isinstance(t, torch.Tensor)}, input_major=True) \
            if fmt is None else assemble_views(
                {f"{r}.{p}": t for r, m in canon.items() if isinstance(m, QuantMatrix) for p, t in m.parts.items()}
                | {n: t for n, t in canon.items() if not isinstance(t, QuantMatrix)},
                fmt, spec.matrix_shapes(), exact=True, input_major=True)
        assert torch.equal(expert_forward(spec, fused, x), expert_forward(spec, again, x)), fmt
