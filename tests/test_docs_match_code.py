"""The documentation names what the code has: load() options, stream() arguments, Result and Step
fields (README), metrics (docs/server.md), container format ids (docs/container.md), and every
environment variable the package reads. Static: reads the sources and docs, loads no model."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "sluice"


def _python_api_section() -> str:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    start = readme.index("### Python API")
    return readme[start:readme.index("\n### ", start + 1)]


def test_readme_names_every_load_option():
    from sluice.engine import Options

    section = _python_api_section()
    missing = [f.name for f in dataclasses.fields(Options) if f"`{f.name}`" not in section]
    assert not missing, f"README's Python API section does not name the load() options {missing}"


def test_readme_names_every_stream_argument_and_result_field():
    from sluice.engine import Engine
    from sluice.generation import Result, Step

    section = _python_api_section()
    stream = re.search(r"`Engine\.stream\((.*?)\)`", section, re.S)
    assert stream, "README's Python API section does not show Engine.stream(...)"
    shown = {p.split("=")[0].strip() for p in stream.group(1).split(",")}
    params = [p for p in inspect.signature(Engine.stream).parameters if p != "self"]
    assert set(params) == shown, f"Engine.stream takes {params}, README shows {sorted(shown)}"
    result = re.search(r"`Result\((.*?)\)`", section, re.S)
    assert result and [s.strip() for s in result.group(1).split(",")] == [f.name for f in dataclasses.fields(Result)]
    step = re.search(r"Step\((.*?)\)", section, re.S)
    assert step
    shown_step = [s.strip(" #\n") for s in step.group(1).split(",")]
    assert shown_step == [f.name for f in dataclasses.fields(Step)]


def test_server_doc_names_every_metric():
    from sluice.server.metrics import Metrics

    worker = dict.fromkeys(("calls_total", "experts_computed_total", "rows_computed_total", "lookups_total",
                            "hits_total", "bytes_read_total", "lost_total"), 0)
    text = Metrics("m").render(0, 0, 1, workers=[dict(worker, index=0)])  # every metric, the --ray ones too
    emitted = re.findall(r"^# TYPE (sluice_\w+) ", text, re.M)
    assert len(emitted) >= 40 and "sluice_bytes_read_total" in emitted and "sluice_expert_worker_lost_total" in emitted
    doc = (ROOT / "docs" / "server.md").read_text(encoding="utf-8")
    missing = [m for m in emitted if not re.search(rf"`{m}[`{{]", doc)]  # `name` or `name{labels}`
    assert not missing, f"docs/server.md does not describe the metrics {missing}"


def test_container_doc_lists_every_format_id():
    from sluice.container import FORMAT_IDS

    doc = (ROOT / "docs" / "container.md").read_text(encoding="utf-8")
    row = next(line for line in doc.splitlines() if "format id" in line and "f32=1" in line)
    listed = dict(re.findall(r"(\w+)=(\d+)", row))
    assert {k: int(v) for k, v in listed.items()} == FORMAT_IDS


def test_quantization_doc_lists_every_registered_format_and_id():
    """docs/quantization.md names every format of the registry (``quant.FORMATS``, fp8 included)
    with the record format id the container stores for it."""
    from sluice.container import FORMAT_IDS
    from sluice.quant import FORMATS

    doc = " ".join((ROOT / "docs" / "quantization.md").read_text(encoding="utf-8").split())
    m = re.search(r"record format id \(docs/container\.md\): ([^.]*)\.", doc)
    assert m, "docs/quantization.md lost its list of format ids"
    listed = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m.group(1))}
    assert listed == FORMAT_IDS and set(listed) == set(FORMATS)
    assert all(f"`{name}`" in doc for name in FORMATS)


def _environment_variables() -> dict[str, list[str]]:
    """Names of environment variables read or set anywhere in src/sluice: os.environ.get("X"),
    os.environ["X"], os.environ.setdefault("X", ...), os.getenv("X"), "X" in os.environ."""
    found: dict[str, list[str]] = {}

    def is_environ(node) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "environ"

    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            key = None
            if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
                f = node.func
                if (isinstance(f, ast.Attribute) and (is_environ(f.value) or f.attr == "getenv")):
                    key = node.args[0].value
            elif isinstance(node, ast.Subscript) and is_environ(node.value) and isinstance(node.slice, ast.Constant):
                key = node.slice.value
            elif (isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant)
                  and any(is_environ(c) for c in node.comparators)):
                key = node.left.value
            if isinstance(key, str):
                found.setdefault(key, []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_every_environment_variable_is_documented():
    found = _environment_variables()
    assert {"OMP_WAIT_POLICY", "SLUICE_API_KEY"} <= set(found)  # the scan sees what it should
    docs = (ROOT / "README.md").read_text(encoding="utf-8") + "".join(
        p.read_text(encoding="utf-8") for p in sorted((ROOT / "docs").rglob("*.md")))
    undocumented = {k: v for k, v in found.items() if k not in docs}
    assert not undocumented, f"environment variables read by src/ but named in no doc: {undocumented}"
    # SLUICE_QUANT_ACTIVATIONS was a hidden switch; sluice.quant.set_activations is the documented way
    assert "SLUICE_QUANT_ACTIVATIONS" not in found
