"""Chatting with the demo model: its chat template (against transformers), trimming to the
context, ``sluice chat demo``, and the README's curl and ``openai`` examples against a live
``sluice serve demo``."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import sluice
from sluice.chat import ConversationTooLong, chat_loop, reply_room, trim_conversation
from sluice.resolve import DEMO_DIR

README = Path(__file__).resolve().parents[2] / "README.md"
KW = dict(memory="2GiB", threads=1, progress=False)


@pytest.fixture(scope="module")
def demo():
    with sluice.load("demo", **KW) as eng:
        yield eng


def chat_ids(tok, messages) -> list[int]:
    return tok.encode(tok.render_chat(messages), add_special_tokens=False)


def expected_reply(eng, messages, max_new_tokens=512) -> str:
    """What the demo answers, generated from scratch with its chat stop strings."""
    tok = eng.tokenizer
    return eng.generate(chat_ids(tok, messages), max_new_tokens=max_new_tokens,
                        stop=tok.chat_stop_strings).text


# -- the template ------------------------------------------------------------------------------


def test_template_file_wins_over_config_as_in_transformers(text_model, tmp_path):
    from transformers import AutoTokenizer

    from sluice.tokenizer import Tokenizer

    d = tmp_path / "tok"
    d.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(text_model / name, d / name)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "config:{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    msgs = [{"role": "user", "content": "hi"}]
    assert Tokenizer(d).render_chat(msgs) == "config:hi"
    (d / "chat_template.jinja").write_text("file:{% for m in messages %}{{ m['content'] }}{% endfor %}")
    ours = Tokenizer(d).render_chat(msgs)
    assert ours == AutoTokenizer.from_pretrained(d).apply_chat_template(msgs, tokenize=False) == "file:hi"


def test_demo_template_renders_as_transformers_does():
    from transformers import AutoTokenizer

    from sluice.tokenizer import Tokenizer

    msgs = [{"role": "system", "content": 'Answer in """code""".'},
            {"role": "user", "content": "  read a file?\nthen return its lines  "},
            {"role": "assistant", "content": "return open(path).readlines()"},
            {"role": "user", "content": "Sort them"},
            {"role": "assistant", "content": "    lines.sort()\n    return lines\n"},
            {"role": "user", "content": "hello"}]
    ours, ref = Tokenizer(DEMO_DIR), AutoTokenizer.from_pretrained(DEMO_DIR)
    for gen in (True, False):
        text = ours.render_chat(msgs, add_generation_prompt=gen)
        assert text == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    assert text.startswith('"""Answer in \'\'\'code\'\'\'."""\n\n\n# read a file?\n# then return its lines\n\n\n'
                           'def answer(*args):\n    """Read a file."""\n    return open(path).readlines()\n\n\n')
    assert ours.render_chat(msgs).endswith('# hello\n\n\ndef answer(*args):\n    """Hello."""\n')
    with pytest.raises(Exception, match="roles system, user and assistant"):
        ours.render_chat([{"role": "tool", "content": "x"}])


# -- trimming ----------------------------------------------------------------------------------


def test_trim_drops_oldest_turns_and_keeps_the_system_message(demo):
    tok = demo.tokenizer
    msgs = [{"role": "system", "content": "Be brief."}]
    for i in range(6):
        msgs += [{"role": "user", "content": f"question number {i} about reading files"},
                 {"role": "assistant", "content": f"    return {i}"}]
    msgs.append({"role": "user", "content": "the last question"})
    full = len(chat_ids(tok, msgs))
    kept, ids, dropped = trim_conversation(tok, msgs, full)
    assert (kept, dropped) == (msgs, 0) and ids == chat_ids(tok, msgs)
    kept, ids, dropped = trim_conversation(tok, msgs, full - 1)
    assert dropped == 2 and kept == msgs[:1] + msgs[3:] and ids == chat_ids(tok, kept)  # one whole turn
    limit = len(chat_ids(tok, msgs[:1] + msgs[-3:]))
    kept, ids, dropped = trim_conversation(tok, msgs, limit)
    assert kept == msgs[:1] + msgs[-3:] and dropped == 10 and len(ids) == limit
    with pytest.raises(ConversationTooLong, match="newest message alone needs"):
        trim_conversation(tok, msgs, len(chat_ids(tok, msgs[:1] + msgs[-1:])) - 1)
    assert reply_room(512, 512) == 128 and reply_room(512, 16) == 16 and reply_room(512) == 128


def test_chat_loop_trims_with_a_notice(demo):
    """A context of 160 tokens: the third turn no longer fits, so the first is dropped, and said so."""
    with sluice.load("demo", max_context=160, **KW) as eng:
        questions = ["Read a file and return its lines", "Now sort them by their length please",
                     "Write a function that parses a date string"]
        out, err = io.StringIO(), io.StringIO()
        assert chat_loop(eng, gen_kwargs={"max_new_tokens": 24}, stdin=io.StringIO("\n".join(questions) + "\n"),
                         stdout=out, stderr=err) == 0
        # the same conversation, trimmed by hand
        msgs, replies, notices = [], [], 0
        for q in questions:
            msgs, ids, dropped = trim_conversation(eng.tokenizer, msgs + [{"role": "user", "content": q}], 160 - 24)
            notices += bool(dropped)
            replies.append(eng.generate(ids, max_new_tokens=24, stop=eng.tokenizer.chat_stop_strings).text)
            msgs.append({"role": "assistant", "content": replies[-1]})
    assert notices >= 1
    assert out.getvalue() == "".join(r + "\n" for r in replies)
    assert err.getvalue().count("no longer fits the context of 160 tokens: dropped its oldest 2 messages") == notices


# -- the command line and the server -------------------------------------------------------------


def test_sluice_chat_demo_two_turns_reuse_the_prefix(demo):
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    stdin = "Read a file and return its lines\nParse a date string\n"
    out = subprocess.run([sys.executable, "-m", "sluice.cli", "chat", "demo", "--threads", "1", "--no-progress"],
                         input=stdin.encode(), capture_output=True, timeout=300, env=env)
    stdout, stderr = out.stdout.decode(), out.stderr.decode()
    assert out.returncode == 0, stderr
    turn1 = [{"role": "user", "content": "Read a file and return its lines"}]
    r1 = expected_reply(demo, turn1)
    turn2 = turn1 + [{"role": "assistant", "content": r1}, {"role": "user", "content": "Parse a date string"}]
    r2 = expected_reply(demo, turn2)
    assert r1.strip() and r2.strip() and stdout == f"{r1}\n{r2}\n"
    assert "chatting with sluice-demo, context 512 tokens" in stderr
    stats = [tuple(map(int, m)) for m in re.findall(r"prompt (\d+) tokens \((\d+) reused\)", stderr)]
    p1 = len(chat_ids(demo.tokenizer, turn1))
    assert [p for p, _ in stats] == [p1, len(chat_ids(demo.tokenizer, turn2))]
    assert stats[1][1] >= p1  # the second turn prefills only what is new
    assert "stopped at" not in stderr  # the replies ended at the end of their function


def readme_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_curl_and_openai_examples_against_sluice_serve_demo(demo):
    """The README's examples, run as written but for the port, against ``sluice serve demo``."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    pytest.importorskip("openai")
    curl = next(b for b in readme_blocks("bash") if "curl" in b and '"sluice-demo"' in b)
    snippet = next(b for b in readme_blocks("python") if "OpenAI(" in b and '"sluice-demo"' in b)
    assert any("sluice serve demo" in b for b in readme_blocks("bash"))

    from serve_process import spawn_serve

    proc, base = spawn_serve("demo", "--threads", "1", "--no-progress", "--log-level", "warning", timeout=120)
    port = int(base.rsplit(":", 1)[1])
    try:
        assert [m["id"] for m in httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"]] == ["sluice-demo"]

        body = json.loads(re.search(r"-d '(.*)'", curl, flags=re.S).group(1))
        if shutil.which("curl"):
            got = subprocess.run(["bash", "-c", curl.replace(":8000", f":{port}")], capture_output=True, text=True,
                                 timeout=120)
            assert got.returncode == 0, got.stderr
            reply = json.loads(got.stdout)
        else:  # the same request without curl
            reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120).json()
        assert reply["model"] == "sluice-demo"
        want = expected_reply(demo, body["messages"], body["max_tokens"])
        assert want.strip() and reply["choices"][0]["message"]["content"] == want

        got = subprocess.run([sys.executable, "-c", snippet.replace(":8000", f":{port}")], capture_output=True,
                             text=True, timeout=120)
        assert got.returncode == 0, got.stderr
        messages = json.loads(re.search(r"messages=(\[.*\])\)", snippet).group(1))
        want = expected_reply(demo, messages, 64)
        assert want.strip() and got.stdout == want + "\n"
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert f"serving 'sluice-demo' on http://127.0.0.1:{port}/v1" in err
