"""The user's commands on every family of the registry (``tests/families.py``), as a user runs them
on a checkpoint directory with a real tokenizer and chat template: ``sluice convert`` then ``sluice
check`` on the container, ``sluice inspect --json``, ``sluice chat`` (the template rendered through
its sandbox) and ``sluice serve``'s OpenAI API through the official client. Each answer is the
engine's own greedy generation on the rendered conversation, token for token; the container's
logits are the directory's. (Exactness against transformers is the fidelity matrix's.)"""

from __future__ import annotations

import io
import json
import shutil
import sys
import warnings

import pytest
import torch

import sluice
from conftest import CHAT_TEMPLATE
from families import REGISTRY, save_family
from live_server import MODEL, LiveServer
from sluice.cli import main

VOCAB = 512  # the tokenizer's (byte-level BPE: 256 bytes, 3 specials and merges); the models get the same
N_NEW = 6
ENGINE_KW = dict(memory="2GiB", threads=1, max_context=256, progress=False)
USER = [{"role": "user", "content": "def main():"}]


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory):
    from sluice.synthetic import write_tokenizer

    d = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(d, VOCAB)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    (d / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    return sorted(d.iterdir())


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory, tokenizer_files):
    """``chat_checkpoint(family)``: the registry's tiny f32 checkpoint at the tokenizer's vocabulary, with
    the tokenizer and its chat template beside it."""
    root = tmp_path_factory.mktemp("every-family")
    made = {}

    def make(family: str):
        if family not in made:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                path = save_family(root / family, family, torch.float32, vocab_size=VOCAB, eos_token_id=2)
            for f in tokenizer_files:
                shutil.copy(f, path / f.name)
            made[family] = path
        return made[family]

    yield make
    shutil.rmtree(root, ignore_errors=True)


def _rendered(engine, messages) -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.render_chat(messages), add_special_tokens=False)


@pytest.mark.parametrize("family", list(REGISTRY))
def test_convert_check_inspect_chat_and_serve(chat_checkpoint, family, capsys, monkeypatch, tmp_path):
    path = chat_checkpoint(family)
    common = ["--memory", "2GiB", "--threads", "1", "--max-context", "256", "--no-progress"]

    box = tmp_path / "box"
    assert main(["convert", str(path), str(box), "--no-progress"]) == 0, capsys.readouterr().err
    assert main(["check", str(box)]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main(["inspect", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["params_total"] > report["params_active_per_token"] > 0 and report["spine_bytes"] > 0

    eng = sluice.load(path, **ENGINE_KW)
    try:
        want = eng.generate(_rendered(eng, USER), max_new_tokens=N_NEW, ignore_eos=True)
        assert len(want.token_ids) == N_NEW
        with sluice.load(box, **ENGINE_KW) as stored:
            ids = torch.tensor(want.token_ids)
            assert torch.equal(stored.forward(ids), eng.forward(ids))

        monkeypatch.setattr(sys, "stdin", io.StringIO("def main():\n/exit\n"))
        assert main(["chat", str(path), *common, "--max-new-tokens", str(N_NEW), "--ignore-eos", "--no-stats"]) == 0
        assert capsys.readouterr().out == want.text + "\n"

        server = LiveServer(eng)
        try:
            reply = server.client().chat.completions.create(model=MODEL, messages=USER, max_tokens=N_NEW,
                                                            temperature=0)
        finally:
            server.stop()
        served = eng.generate(_rendered(eng, USER), max_new_tokens=N_NEW)  # the server stops at EOS
        assert reply.choices[0].message.content == served.text
        assert reply.usage.completion_tokens == len(served.token_ids)
    finally:
        eng.close()
