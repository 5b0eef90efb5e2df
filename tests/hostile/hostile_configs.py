"""The harness of the hostile config.json tests, one ``test_hostile_configs_<family>.py`` a family.

A family's file holds its cases, ``name -> (edit, words its message must contain)``, and three
short tests: the clean config parses, every case is refused at parse time, and a few cases are
refused at the CLI in one line from a real checkpoint directory::

    CASES = {"softmax_scoring": ({"scoring_func": "softmax"}, "scoring_func='softmax'"), ...}

    @pytest.fixture(scope="module")
    def raw():
        return registry_config("dots1")

    @pytest.mark.parametrize("case", list(CASES))
    def test_hostile_dots1_config(case, raw):
        assert_refused(d1.parse_config, raw, *CASES[case])

    @pytest.mark.parametrize("case", ["softmax_scoring", "groups_not_dividing"])
    def test_refused_at_the_cli_in_one_line(case, family_models, tmp_path, capsys):
        path = hostile_checkpoint(family_models, tmp_path, "dots1", CASES[case][0])
        assert_refused_at_cli(path, CASES[case][1], capsys)

An edit is a dict merged into the top level of the config, or a function from a copy of the
config to the config to parse. No model is built for a case: the CLI cases link the files of
the registry's f32 checkpoint (built once a session, ``family_models``) into a fresh
directory beside an edited config.json.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

from families import REGISTRY
from sluice.errors import ConfigError, UnsupportedModelError

REFUSALS = (ConfigError, UnsupportedModelError)
Edit = dict | Callable[[dict], dict]


def registry_config(family: str, **extra) -> dict:
    """The JSON form of ``family``'s tiny registry config (transformers' warnings about it silenced)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return copy(REGISTRY[family].config(**extra).to_dict())


def copy(raw: dict) -> dict:
    """A deep copy as config.json would give it (JSON types only)."""
    return json.loads(json.dumps(raw))


def edited(raw: dict, edit: Edit) -> dict:
    """``edit`` applied to a copy of ``raw``."""
    return edit(copy(raw)) if callable(edit) else {**copy(raw), **edit}


def assert_refused(parse: Callable[[dict], object], raw: dict, edit: Edit, expected: str,
                   prefix: str = "config.json: ", errors: tuple = REFUSALS) -> str:
    """``parse(edited(raw, edit))`` raises one of ``errors`` whose message starts with ``prefix``
    and names ``expected``; returns the message."""
    with pytest.raises(errors) as e:
        parse(edited(raw, edit))
    message = str(e.value)
    assert expected in message and message.startswith(prefix), message
    return message


def hostile_checkpoint(family_models, tmp_path: Path, family: str, edit: Edit) -> Path:
    """A directory with the files of ``family``'s registry f32 checkpoint (links) and its
    config.json edited by ``edit``."""
    src = family_models.hf(family, "f32")
    dst = tmp_path / f"{family}-hostile"
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f)
    (dst / "config.json").write_text(json.dumps(edited(json.loads((src / "config.json").read_text()), edit)))
    return dst


def assert_refused_at_cli(path: Path, expected: str, capsys) -> str:
    """``sluice inspect path`` fails with one ``sluice: error:`` line naming ``expected``, no traceback."""
    from sluice.cli import main

    capsys.readouterr()  # whatever building the checkpoint printed
    rc = main(["inspect", str(path)])
    out, err = capsys.readouterr()
    assert rc != 0 and err.startswith("sluice: error: ") and err.count("\n") == 1, err
    assert expected in err and "Traceback" not in out + err
    return err
