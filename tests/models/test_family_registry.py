"""Every family is declared once and registered once: its module (found by ``MODEL_TYPE``), its
tiny-config entry in ``tests/families.py`` and its row in ``docs/families.md``; ``describe()``
and ``build()`` both come from its declaration (``models/declare.py``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from families import FAMILY_NAMES, REGISTRY, describe
from sluice.errors import UnsupportedModelError
from sluice.models import families, get_family
from sluice.models.declare import Lin, Part, Tensors

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "families.md"


def _modules() -> set[str]:
    return set(families().values())


def test_every_family_module_has_a_tiny_config_and_every_entry_a_module():
    assert _modules() == set(REGISTRY), "a family module without a tests/families.py entry, or the reverse"
    for name, entry in REGISTRY.items():
        assert families()[entry.model_type] == name


def test_every_family_has_a_docs_row():
    text = DOCS.read_text()
    table = text[text.index("## Families at a glance"):]
    rows = {m.group(1) for m in re.finditer(r"^\| `([a-z0-9_]+)` \|", table, re.M)}
    assert set(families()) <= rows, f"docs/families.md lacks a row for {sorted(set(families()) - rows)}"


def test_every_registry_family_is_in_the_readme_table():
    """README's supported-families table names every family of the registry in its first column."""
    text = (ROOT / "README.md").read_text()
    start = text.index("| `model_type` | what is covered")
    table = text[start:text.index("\n\n", start)]
    named = {n for m in re.finditer(r"^\| ([^|]+) \|", table, re.M) for n in re.findall(r"`([a-z0-9_]+)`", m.group(1))}
    missing = {e.model_type for e in REGISTRY.values()} - named
    assert not missing, f"README's families table lacks {sorted(missing)}"


def test_unknown_model_type_names_the_supported_ones():
    """The error lists every registered model_type, sorted (the first seven families among them)."""
    with pytest.raises(UnsupportedModelError) as err:
        get_family("llama")
    names = sorted(families())
    assert f"(supported: {', '.join(names)})" in str(err.value)
    first_seven = {"deepseek_v3", "gpt_oss", "kimi_k2", "kimi_linear", "mixtral", "olmoe", "qwen3_moe", "qwen3_next"}
    assert first_seven <= set(names)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_build_reads_exactly_the_declared_spine(family):
    """build() asks for every spine tensor describe() lists and nothing else, each of its shape."""
    desc = describe(family)
    mod = get_family(family)
    cfg = mod.parse_config(REGISTRY[family].config().to_dict())
    asked: list[str] = []

    def w(name):
        asked.append(name)
        return torch.zeros(desc.spine[name])

    model = mod.build(cfg, w, experts=None)
    assert set(asked) == set(desc.spine)
    assert len(model.layers) == desc.n_layers
    assert [i for i in range(desc.n_layers) if model.is_moe(i)] == desc.moe_layers


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_declared_state_matches_the_built_layers(family):
    """The KV bytes the declaration states are what the built attention layers allocate."""
    desc = describe(family)
    mod = get_family(family)
    cfg = mod.parse_config(REGISTRY[family].config().to_dict())
    model = mod.build(cfg, lambda n: torch.zeros(desc.spine[n]), experts=None)
    n = 1000
    built = sum(layer.attn.cache_bytes(n) for layer in model.layers if hasattr(layer.attn, "cache_bytes"))
    declared = desc.state_bytes(n) - desc.state_bytes_fixed
    assert built == declared


def test_a_part_builds_only_from_what_it_declared():
    part = Part({"weight": (4,), "proj": Lin((2, 4))}, lambda t: (t("weight"), t.lin("proj"), t.opt("bias")))
    from sluice.models.declare import Model

    model = Model(8, 4, [], part, tied=True)
    got = part.make(Tensors(model, lambda n: n, "p.", part.tensors, None, None))
    assert got == ("p.weight", "p.proj.weight", None)
    t = Tensors(model, lambda n: n, "p.", part.tensors, None, None)
    with pytest.raises(KeyError, match="p.bias is not declared"):
        t("bias")
    with pytest.raises(KeyError, match="not declared as a linear"):
        t.lin("weight")
    assert model.spine() == {"model.embed_tokens.weight": (8, 4), "model.norm.weight": (4,),
                             "model.norm.proj.weight": (2, 4)}
