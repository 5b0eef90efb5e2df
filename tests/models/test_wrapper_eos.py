"""End-of-sequence ids of multimodal wrappers (qwen3_5_moe, kimi_k25): generation stops where
transformers' does when the ids sit in the text model's ``text_config`` only, at the wrapper's
own ids when it has them, and at generation_config.json's; a container converted from the
checkpoint keeps them.

The eos ids are tokens the model's free greedy continuation produces (so a stop is seen), set
into copies of the registry's tiny checkpoints; transformers' image-text model on the same
directory is the oracle."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import sluice
from conftest import prompt_ids
from sluice.convert import convert

N_NEW = 12
EOS_AT, OTHER_AT = 4, 8  # which free greedy tokens become the text model's / the other eos id


def _kimi_wrapper(src: Path, dst: Path) -> Path:
    """The deepseek_v3 tiny checkpoint as a kimi_k25 wrapper (tensors under ``language_model.``,
    its config as ``text_config`` of type kimi_k2, a one-layer vision config never read)."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True)
    tensors = {"language_model." + k: v for k, v in load_file(src / "model.safetensors").items()}
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    text = {**json.loads((src / "config.json").read_text()), "model_type": "kimi_k2"}
    cfg = {"model_type": "kimi_k25", "architectures": ["Kimi_K25ForConditionalGeneration"],
           "tie_word_embeddings": False, "text_config": text, "projection_hidden_size": 32,
           "vision_config": {"hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 1,
                             "num_attention_heads": 2, "patch_size": 14, "pos_emb_height": 4, "pos_emb_width": 4}}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def wrappers(family_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("wrappers")
    return {"qwen3_5_moe": family_models.hf("qwen3_5_moe", "f32"),
            "kimi_k25": _kimi_wrapper(family_models.hf("deepseek_v3", "f32"), root / "kimi_k25")}


def _oracle(path: Path, ids: torch.Tensor) -> list[int]:
    import transformers

    cls = (transformers.Kimi_K25ForConditionalGeneration if "kimi" in json.loads((path / "config.json").read_text())
           ["model_type"] else transformers.AutoModelForImageTextToText)
    model = cls.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(input_ids=ids[None], max_new_tokens=N_NEW, do_sample=False)[0]
    return out[len(ids):].tolist()


def _generate(path: Path, ids: torch.Tensor, **kw):
    with sluice.load(path, memory="4GiB", progress=False) as eng:
        return eng.generate(ids.tolist(), max_new_tokens=N_NEW, speculate=False, **kw)


def _variant(src: Path, dst: Path, *, top, text, gen) -> Path:
    """``src`` with config.json's ``eos_token_id`` = ``top`` (None: absent), ``text_config``'s =
    ``text``, and generation_config.json = ``gen`` (None: no file)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.pop("eos_token_id", None)
    if top is not None:
        cfg["eos_token_id"] = top
    cfg["text_config"]["eos_token_id"] = text
    (dst / "config.json").write_text(json.dumps(cfg))
    (dst / "generation_config.json").unlink(missing_ok=True)
    if gen is not None:
        (dst / "generation_config.json").write_text(json.dumps(gen))
    return dst


CASES = {
    # the published shape: the text model's ids in text_config only
    "text_config": lambda x, y: dict(top=None, text=x, gen=None),
    # the wrapper's own ids first (transformers fills only unset generation fields from text_config)
    "wrapper_first": lambda x, y: dict(top=y, text=x, gen=None),
    "generation_config": lambda x, y: dict(top=None, text=None, gen={"eos_token_id": [y]}),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("family", ["qwen3_5_moe", "kimi_k25"])
def test_generation_stops_where_transformers_does(wrappers, tmp_path, family, case):
    ids = prompt_ids()
    free = _generate(wrappers[family], ids, ignore_eos=True).token_ids
    assert len(free) == N_NEW
    x, y = free[EOS_AT], free[OTHER_AT]
    assert free.index(x) < free.index(y)
    settings = CASES[case](x, y)
    path = _variant(wrappers[family], tmp_path / "m", **settings)
    want = _oracle(path, ids)
    stop = settings["top"] if settings["top"] is not None else x if settings["text"] is not None else y
    assert want == free[: free.index(stop) + 1]  # transformers stops there
    got = _generate(path, ids)
    assert got.token_ids == want and got.finish_reason == "stop"
    if case == "text_config":
        out = convert(path, tmp_path / "c", progress=False)
        assert _generate(out, ids).token_ids == want
