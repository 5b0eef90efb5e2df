"""Fast start: `import sluice`, `sluice --help`, `--version` and every subcommand's `--help` load no torch.

Each check runs in a fresh interpreter (the test process has torch loaded already) and looks at
`sys.modules` afterwards. The times themselves are measured by benchmarks/cli_startup.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "numpy", "safetensors", "tokenizers", "jinja2", "fastapi", "uvicorn", "sluice.engine")

_PROBE = """
import json, os, sys
argv = json.loads(sys.argv[1])
if argv is None:
    import sluice
else:
    from sluice.cli import main
    try:
        main(argv)
    except SystemExit:
        pass
heavy = json.loads(sys.argv[2])
loaded = sorted(m for m in sys.modules if any(m == h or m.startswith(h + ".") for h in heavy))
print(json.dumps({"loaded": loaded, "omp": os.environ.get("OMP_WAIT_POLICY")}), file=sys.stderr)
"""


def _probe(argv, env_omp=None):
    import os

    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if env_omp is not None:
        env["OMP_WAIT_POLICY"] = env_omp
    out = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(argv), json.dumps(HEAVY)], capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout, json.loads(out.stderr.strip().splitlines()[-1])


def test_import_sluice_loads_no_torch_but_sets_omp_policy():
    _, r = _probe(None)
    assert r["loaded"] == []
    assert r["omp"] == "PASSIVE"  # set at import, before anything can load torch


def test_import_sluice_keeps_a_users_omp_policy():
    _, r = _probe(None, env_omp="ACTIVE")
    assert r["omp"] == "ACTIVE"


@pytest.mark.parametrize("argv", [["--help"], ["--version"], []], ids=["help", "version", "bare"])
def test_top_level_help_and_version_load_no_torch(argv):
    stdout, r = _probe(argv)
    assert r["loaded"] == []
    assert "sluice" in stdout


def test_every_subcommand_help_loads_no_torch():
    from sluice.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    commands = sorted(sub.choices)
    assert {"run", "serve", "chat", "convert", "demo"} <= set(commands)
    for command in commands:
        stdout, r = _probe([command, "--help"])
        assert r["loaded"] == [], command
        assert f"sluice {command}" in stdout, command


def test_lazy_exports_resolve_to_the_engine():
    import sluice
    import sluice.engine

    assert sluice.load is sluice.engine.load and sluice.Engine is sluice.engine.Engine
    for name in sluice.__all__:
        assert getattr(sluice, name) is not None, name
    assert set(sluice.__all__) <= set(dir(sluice))
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        sluice.nonexistent  # noqa: B018
