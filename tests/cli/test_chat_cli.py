"""``sluice chat`` driven as a user would: a subprocess fed on stdin."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import sluice

ARGS = ["--memory", "2GiB", "--threads", "1", "--max-context", "256", "--no-progress", "--max-new-tokens", "8",
        "--ignore-eos"]


def chat(model, stdin: str, *extra):
    """Run the chat; stdout and stderr decoded as UTF-8 without newline translation (replies may hold \\r)."""
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    out = subprocess.run([sys.executable, "-m", "sluice.cli", "chat", str(model), *ARGS, *extra],
                         input=stdin.encode(), capture_output=True, timeout=300, env=env)
    return subprocess.CompletedProcess(out.args, out.returncode, out.stdout.decode("utf-8"),
                                       out.stderr.decode("utf-8"))


def rendered(engine, messages) -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.render_chat(messages), add_special_tokens=False)


def test_chat_turns_reuse_and_reset(chat_model):
    out = chat(chat_model, "def main():\n\nimport os\n/help\n/reset\ndef main():\n/exit\nnever read\n")
    assert out.returncode == 0, out.stderr

    # what the replies must be: each turn generated from scratch (no reuse) on the whole conversation
    eng = sluice.load(chat_model, memory="2GiB", threads=1, max_context=256, progress=False)
    turn1 = [{"role": "user", "content": "def main():"}]
    r1 = eng.generate(rendered(eng, turn1), max_new_tokens=8, ignore_eos=True)
    turn2 = turn1 + [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "import os"}]
    r2 = eng.generate(rendered(eng, turn2), max_new_tokens=8, ignore_eos=True)
    assert out.stdout == f"{r1.text}\n{r2.text}\n{r1.text}\n"  # after /reset the conversation starts over

    stats = [tuple(map(int, m)) for m in re.findall(r"\[sluice\] prompt (\d+) tokens \((\d+) reused\)", out.stderr)]
    assert [p for p, _ in stats] == [len(rendered(eng, turn1)), len(rendered(eng, turn2)), len(rendered(eng, turn1))]
    # the second turn prefills only what is new: at least the whole first prompt comes from the KV cache
    assert stats[1][1] >= len(rendered(eng, turn1)) - 1
    assert "/reset" in out.stderr and "new conversation" in out.stderr


def test_chat_system_message_and_eof(chat_model):
    out = chat(chat_model, "hello", "--system", "Be brief.", "--no-stats")  # no newline, then end of input
    assert out.returncode == 0, out.stderr
    eng = sluice.load(chat_model, memory="2GiB", threads=1, max_context=256, progress=False)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    assert out.stdout == eng.generate(rendered(eng, msgs), max_new_tokens=8, ignore_eos=True).text + "\n"
    assert "[sluice] prompt" not in out.stderr


def test_chat_without_template_fails_clearly(text_model):
    out = chat(text_model, "hi\n")
    assert out.returncode == 1
    assert "no chat template" in out.stderr and "Traceback" not in out.stderr
