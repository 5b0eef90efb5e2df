"""What the command line says: help, sizes, errors, progress, stats lines, echo.

Run in-process through ``sluice.cli.main`` (stdout and stderr captured), on the shipped demo
model or the tiny test model; the budgets are explicit so the test process's own RSS does not
matter.
"""

from __future__ import annotations

import re

import pytest

from sluice.cli import main
from sluice.model_report import format_params

RUN = ["--memory", "2GiB", "--threads", "1", "--no-progress"]


@pytest.mark.parametrize("command", ["run", "inspect", "serve", "chat"])
def test_help_names_every_kind_of_model(command, capsys):
    assert main([command, "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for kind in ("Hugging Face model directory", "Sluice container", "'demo'", "repo id", "Hugging Face cache",
                 "--revision"):
        assert kind in text, (command, kind)


def test_inspect_counts_parameters_in_m_and_b(capsys):
    assert main(["inspect", "demo"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("sluice-demo (") and "parameters        10.4 M total, 4.21 M active per token" in out
    assert [format_params(n) for n in (30_532_122_624, 3_170_000, 10_414_080, 52_000, 999)] == \
        ["30.5 B", "3.17 M", "10.4 M", "52 K", "999"]


def test_missing_model_says_it_does_not_exist(tmp_path, capsys):
    assert main(["run", str(tmp_path / "nope"), "-p", "x", *RUN]) == 1
    err = capsys.readouterr().err
    assert err.strip() == f"sluice: error: {tmp_path / 'nope'}: no such file or directory"
    assert main(["inspect", "no-such-org/no-such-model"]) == 1
    assert "fetch it with: hf download no-such-org/no-such-model" in capsys.readouterr().err


def test_convert_progress_reaches_100_percent(text_model, tmp_path, capsys):
    assert main(["convert", str(text_model), str(tmp_path / "m.sluice")]) == 0
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("converting to m.sluice")]
    assert lines and re.fullmatch(r"converting to m\.sluice: 100% \((.+)/\1\)", lines[-1]), lines


def test_run_echo_stats_line_and_final_newline(capsys):
    assert main(["run", "demo", "-p", "import os\n", "--max-new-tokens", "5", "--echo", *RUN]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("import os\n") and out.endswith("\n") and len(out) > len("import os\n") + 1
    stats = [x for x in err.splitlines() if x.startswith("[sluice] prefill")]
    assert len(stats) == 1 and stats[0].endswith("| stopped at --max-new-tokens 5")
    text = out[len("import os\n"):-1]

    # without --echo only the generated text; ended by a stop string: nothing says it was cut
    stop = text.strip()[:2]
    assert main(["run", "demo", "-p", "import os\n", "--max-new-tokens", "5", "--stop", stop, *RUN]) == 0
    out, err = capsys.readouterr()
    assert out == text[:text.index(stop)] + "\n" and "stopped at" not in err

    # the context, not --max-new-tokens, cut it
    assert main(["run", "demo", "-p", "import os\n", "--max-new-tokens", "50", "--max-context", "8", *RUN]) == 0
    assert capsys.readouterr().err.rstrip().endswith("| stopped at the end of the context (--max-context)")


def test_demo_prints_a_readable_summary(capsys):
    assert main(["demo", "--max-new-tokens", "4", "--cache-experts", "48", *RUN]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("def fibonacci(n):\n")
    assert "plan:" not in err and "{" not in err
    assert re.search(r"\[sluice demo\] memory budget 2\.00 GiB \(the model's floor is [\d.]+ MiB\): an expert cache "
                     r"of 48 of 192 experts \(25%\)\. `sluice inspect demo` shows what other budgets buy\.", err), err


def test_run_chat_echoes_the_template_and_stops_at_its_stop_strings(capsys):
    assert main(["run", "demo", "--chat", "-p", "Parse a date string", "--echo", *RUN]) == 0
    out, err = capsys.readouterr()
    assert out.startswith('# Parse a date string\n\n\ndef answer(*args):\n    """Parse a date string."""\n    ')
    assert "\n\n\n" not in out[40:] and "stopped at" not in err  # the reply ended with its function
