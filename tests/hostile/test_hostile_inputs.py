"""Hostile inputs: edited configs, broken tokenizer files and chat templates, bad CLI flags and API
arguments. Every case is built here from a real tiny checkpoint (nothing binary is committed) and
must end in a clear error that names the key or flag and its value, with no traceback; where the
run may go on, its tokens are those of a clean run.

CLI cases run in-process through ``sluice.cli.main(argv)``; two subprocesses check the real exit
status and the absence of a traceback end to end.
"""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys
import warnings

import pytest

import sluice
from sluice.cli import main
from sluice.errors import ChatTemplateError, CheckpointError, ConfigError, InvalidArgumentError, UnknownOptionError
from sluice.models import get_family
from families import REGISTRY

RUN = ["--memory", "2GiB", "--threads", "1", "--max-context", "64", "--no-progress", "--max-new-tokens", "4",
       "--ignore-eos", "--no-speculate"]
PROMPT = "def f(x):"


# -- helpers ------------------------------------------------------------------------------------------


def edited_copy(src, dst, config_edits: dict | None = None, files: dict | None = None):
    """``dst``: the checkpoint ``src`` with its files symlinked, except an edited config.json and
    the given ``files`` (name -> text). An edit key ``a.b`` sets ``config[a][b]``."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "config.json" and f.name not in (files or {}):
            (dst / f.name).symlink_to(f)
    cfg = json.loads((src / "config.json").read_text())
    for key, value in (config_edits or {}).items():
        node = cfg
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    (dst / "config.json").write_text(json.dumps(cfg))  # NaN and Infinity written as JSON allows
    for name, text in (files or {}).items():
        (dst / name).write_text(text)
    return dst


def cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return rc, out, err


def assert_names(text: str, *parts: str) -> None:
    for p in parts:
        assert p in text, f"{p!r} not in {text!r}"


@pytest.fixture(scope="module")
def clean_tokens(text_model):
    """The tokens of a clean run of RUN on the text model, and the engine that made them."""
    eng = sluice.load(text_model, memory="2GiB", threads=1, max_context=64, progress=False)
    ids = eng.generate(PROMPT, max_new_tokens=4, ignore_eos=True, speculate=False).token_ids
    yield eng, ids
    eng.close()


# -- config.json, through the CLI: exit 1, the key and the value named ---------------------------------

CONFIG_CASES = {
    "top_k_zero": ({"num_experts_per_tok": 0}, ["num_experts_per_tok=0", "1 to the 8 experts"]),
    "top_k_above_experts": ({"num_experts_per_tok": 9}, ["num_experts_per_tok=9", "8 experts"]),
    "top_k_negative": ({"num_experts_per_tok": -1}, ["num_experts_per_tok=-1"]),
    "heads_zero": ({"num_attention_heads": 0}, ["num_attention_heads=0"]),
    "kv_heads_not_dividing": ({"num_key_value_heads": 3}, ["num_key_value_heads=3", "num_attention_heads=4"]),
    "head_dim_zero": ({"head_dim": 0}, ["head_dim=0"]),
    "sparse_step_zero": ({"decoder_sparse_step": 0}, ["decoder_sparse_step=0"]),
    "rope_theta_negative": ({"rope_parameters.rope_theta": -1}, ["rope_theta=-1"]),
    "rope_theta_string": ({"rope_parameters.rope_theta": "1e4"}, ["rope_theta='1e4'"]),
    "rope_theta_infinite": ({"rope_parameters.rope_theta": math.inf}, ["rope_theta=inf"]),
    "rope_parameters_string": ({"rope_parameters": "default"}, ["rope_parameters='default'"]),
    "eps_nan": ({"rms_norm_eps": math.nan}, ["rms_norm_eps=nan"]),
    "eps_negative": ({"rms_norm_eps": -1e-6}, ["rms_norm_eps=-1e-06"]),
    "eps_boolean": ({"rms_norm_eps": True}, ["rms_norm_eps=True"]),
    "layers_float": ({"num_hidden_layers": 1e9}, ["num_hidden_layers=1000000000.0"]),
    "layers_absurd": ({"num_hidden_layers": 10**9}, ["num_hidden_layers=1000000000"]),
    "layers_more_than_tensors": ({"num_hidden_layers": 5}, ["num_hidden_layers=5", "only 3 layers"]),
    "layers_fewer_than_tensors": ({"num_hidden_layers": 2}, ["num_hidden_layers=2", "layer 2"]),
    "vocab_string": ({"vocab_size": "512"}, ["vocab_size='512'"]),
    "hidden_list": ({"hidden_size": [64]}, ["hidden_size=[64]"]),
    "max_positions_zero": ({"max_position_embeddings": 0}, ["max_position_embeddings=0"]),
    "tie_embeddings_string": ({"tie_word_embeddings": "false"}, ["tie_word_embeddings='false'"]),
    "mlp_only_layers_string": ({"mlp_only_layers": "1"}, ["mlp_only_layers='1'"]),
    "unknown_activation": ({"hidden_act": "swish_fancy"}, ["'swish_fancy'"]),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_hostile_config_cli(case, text_model, tmp_path, capsys):
    edits, expected = CONFIG_CASES[case]
    model = edited_copy(text_model, tmp_path / "m", edits)
    rc, out, err = cli(capsys, "run", model, "-p", PROMPT, *RUN)
    assert rc == 1 and out == ""
    assert err.startswith("sluice: error: ") and err.count("\n") == 1
    assert_names(err, "config.json", *expected)


def test_config_not_an_object(text_model, tmp_path, capsys):
    model = edited_copy(text_model, tmp_path / "m", files={"config.json": "[1, 2]"})
    rc, _, err = cli(capsys, "run", model, "-p", PROMPT, *RUN)
    assert rc == 1 and "config.json must be a JSON object" in err


def test_config_error_is_checkpoint_error_via_api(text_model, tmp_path):
    model = edited_copy(text_model, tmp_path / "m", {"num_experts_per_tok": 0})
    with pytest.raises(ConfigError, match="num_experts_per_tok=0") as e:
        sluice.load(model, memory="2GiB", progress=False)
    assert isinstance(e.value, CheckpointError) and isinstance(e.value, sluice.UnsupportedModelError)


def test_debug_shows_the_traceback(text_model, tmp_path):
    model = edited_copy(text_model, tmp_path / "m", {"num_attention_heads": 0})
    with pytest.raises(ConfigError, match="num_attention_heads=0"):
        main(["run", str(model), "-p", PROMPT, *RUN, "--debug"])


# -- config.json of every family, at parse time ----------------------------------------------------------

TOP_K_KEYS = ("moe_k", "moe_topk", "num_experts_per_token", "num_experts_per_tok")  # the name each family reads


def _family_config(family: str) -> dict:
    """The registry's tiny config.json of ``family`` (a wrapper's text config: the wrappers' own keys are
    in their family's hostile file)."""
    cfg = REGISTRY[family].config()
    return (cfg if REGISTRY[family].wrapper is None else cfg.text_config).to_dict()


def _top_k_key(raw: dict) -> str:
    return next(k for k in TOP_K_KEYS if k in raw)


FAMILY_EDITS = {
    "top_k_zero": lambda raw, k: ({k: 0}, f"{k}=0"),
    "top_k_above_experts": lambda raw, k: ({k: 10_000}, f"{k}=10000"),
    "heads_zero": lambda raw, k: ({"num_attention_heads": 0}, "num_attention_heads=0"),
    "eps_nan": lambda raw, k: ({"rms_norm_eps": math.nan}, "rms_norm_eps=nan"),
    "eps_string": lambda raw, k: ({"rms_norm_eps": "1e-6"}, "rms_norm_eps='1e-6'"),
    "layers_float": lambda raw, k: ({"num_hidden_layers": 1e9}, "num_hidden_layers=1000000000.0"),
    "rope_theta_negative": lambda raw, k: (
        {"rope_parameters": {**raw["rope_parameters"], "rope_theta": -1}}, "rope_theta=-1"),
}


@pytest.fixture(scope="module")
def family_configs():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {f: _family_config(f) for f in REGISTRY}


NOPE = ("kimi_linear", "glm5_next")  # no RoPE: no rope_theta to refuse


@pytest.mark.parametrize("family,edit", [(f, e) for f in REGISTRY for e in FAMILY_EDITS
                                         if not (f in NOPE and e == "rope_theta_negative")])
def test_hostile_config_every_family(family, edit, family_configs):
    raw = json.loads(json.dumps(family_configs[family]))
    fam = get_family(raw["model_type"])
    fam.parse_config(raw)  # the clean config parses
    change, expected = FAMILY_EDITS[edit](raw, _top_k_key(raw))
    with pytest.raises(ConfigError) as e:
        fam.parse_config({**raw, **change})
    assert expected in str(e.value) and str(e.value).startswith("config.json: ")


# family-specific keys: (family, edit, what the message names)
FAMILY_SPECIFIC = {
    "mixtral_no_experts": ("mixtral", {"num_local_experts": 0}, "num_local_experts=0"),
    "mixtral_negative_window": ("mixtral", {"sliding_window": -5}, "sliding_window=-5"),
    "mixtral_head_dim_float": ("mixtral", {"head_dim": 1e9}, "head_dim=1000000000.0"),
    "mixtral_vocab_absurd": ("mixtral", {"vocab_size": 10**12}, "vocab_size=1000000000000"),
    "olmoe_clip_negative": ("olmoe", {"clip_qkv": -1}, "clip_qkv=-1"),
    "olmoe_clip_string": ("olmoe", {"clip_qkv": "big"}, "clip_qkv='big'"),
    "qwen3_moe_negative_layer_index": ("qwen3_moe", {"mlp_only_layers": [0, -1]}, "mlp_only_layers=[0, -1]"),
    "qwen3_moe_kv_heads_zero": ("qwen3_moe", {"num_key_value_heads": 0}, "num_key_value_heads=0"),
    "qwen3_moe_top_k_float": ("qwen3_moe", {"num_experts_per_tok": 2.0}, "num_experts_per_tok=2.0"),
    "qwen3_next_key_heads_zero": ("qwen3_next", {"linear_num_key_heads": 0}, "linear_num_key_heads=0"),
    "qwen3_next_partial_rotary_above_one": (
        "qwen3_next", {"rope_parameters": {"rope_theta": 1e4, "rope_type": "default", "partial_rotary_factor": 2}},
        "partial_rotary_factor=2"),
    "kimi_linear_head_dim_zero": ("kimi_linear", {"linear_attn_config": {"head_dim": 0}}, "head_dim=0"),
    "kimi_linear_negative_experts": ("kimi_linear", {"num_experts": -8}, "num_experts=-8"),
    "kimi_linear_kv_lora_zero": ("kimi_linear", {"kv_lora_rank": 0}, "kv_lora_rank=0"),
    "deepseek_v3_experts_string": ("deepseek_v3", {"n_routed_experts": "8"}, "n_routed_experts='8'"),
    "deepseek_v3_scaling_nan": ("deepseek_v3", {"routed_scaling_factor": math.nan}, "routed_scaling_factor=nan"),
    "gpt_oss_swiglu_limit_zero": ("gpt_oss", {"swiglu_limit": 0}, "swiglu_limit=0"),
    "gpt_oss_yarn_factor_negative": ("gpt_oss", {"rope_parameters": {
        "rope_type": "yarn", "factor": -32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 4096, "rope_theta": 150000.0}}, "factor=-32.0"),
}


@pytest.mark.parametrize("case", list(FAMILY_SPECIFIC))
def test_hostile_config_family_specific(case, family_configs):
    family, change, expected = FAMILY_SPECIFIC[case]
    raw = json.loads(json.dumps(family_configs[family]))
    with pytest.raises(ConfigError) as e:
        get_family(family).parse_config({**raw, **change})
    assert expected in str(e.value) and str(e.value).startswith("config.json: ")


# -- CLI flags: refused at parse time, exit 2, the flag and the value named --------------------------

FLAG_CASES = {
    "temperature_nan": (["run", "M", "--temperature", "nan"], ["--temperature", "'nan'"]),
    "temperature_negative": (["run", "M", "--temperature", "-1"], ["--temperature", "'-1'"]),
    "temperature_tiny": (["run", "M", "--temperature", "1e-300"], ["--temperature", "'1e-300'"]),
    "top_p_above_one": (["run", "M", "--top-p", "2"], ["--top-p", "'2'"]),
    "top_p_zero": (["run", "M", "--top-p", "0"], ["--top-p", "'0'"]),
    "top_k_negative": (["run", "M", "--top-k", "-1"], ["--top-k", "'-1'"]),
    "seed_below_range": (["run", "M", "--seed", str(-2**63 - 1)], ["--seed", str(-2**63 - 1)]),
    "seed_overflow": (["run", "M", "--seed", str(2**64)], ["--seed", str(2**64)]),
    "max_new_tokens_zero": (["run", "M", "--max-new-tokens", "0"], ["--max-new-tokens", "'0'"]),
    "max_context_negative": (["run", "M", "--max-context", "-1"], ["--max-context", "'-1'"]),
    "threads_zero": (["run", "M", "--threads", "0"], ["--threads", "'0'"]),
    "reader_threads_word": (["run", "M", "--reader-threads", "four"], ["--reader-threads", "'four'"]),
    "cache_experts_zero": (["run", "M", "--cache-experts", "0"], ["--cache-experts", "'0'"]),
    "memory_without_unit": (["run", "M", "--memory", "1.5"], ["--memory", "'1.5'", "no unit"]),
    "memory_word": (["run", "M", "--memory", "lots"], ["--memory", "'lots'"]),
    "memory_zero": (["run", "M", "--memory", "0GiB"], ["--memory", "'0GiB'"]),
    "moe_top_k_zero": (["run", "M", "--moe-top-k", "0"], ["--moe-top-k", "'0'"]),
    "prefer_cached_nan": (["run", "M", "--prefer-cached", "nan"], ["--prefer-cached", "'nan'"]),
    "chat_max_new_tokens_float": (["chat", "M", "--max-new-tokens", "1.5"], ["--max-new-tokens", "'1.5'"]),
    "serve_port_out_of_range": (["serve", "M", "--port", "70000"], ["--port", "'70000'"]),
    "serve_max_queue_negative": (["serve", "M", "--max-queue", "-1"], ["--max-queue", "'-1'"]),
    "serve_max_body_without_unit": (["serve", "M", "--max-body", "100"], ["--max-body", "'100'"]),
    "bench_tokens_zero": (["bench", "io", "M", "--tokens", "0"], ["--tokens", "'0'"]),
    "inspect_max_context_zero": (["inspect", "M", "--max-context", "0"], ["--max-context", "'0'"]),
    "demo_synthetic_without_unit": (["demo", "--synthetic", "2"], ["--synthetic", "'2'"]),
    "disk_cache_word": (["run", "M", "--disk-cache", "big"], ["--disk-cache", "'big'"]),
    "disk_cache_zero": (["serve", "M", "--disk-cache", "0GB"], ["--disk-cache", "'0GB'"]),
    "inspect_disk_cache_without_unit": (["inspect", "M", "--disk-cache", "40"], ["--disk-cache", "'40'", "no unit"]),
}


@pytest.mark.parametrize("case", list(FLAG_CASES))
def test_hostile_flag(case, tmp_path, capsys):
    argv, expected = FLAG_CASES[case]
    rc, out, err = cli(capsys, *[str(tmp_path / "missing-model") if a == "M" else a for a in argv])
    assert rc == 2 and out == ""
    assert_names(err, "error: argument", *expected)


def test_prompt_file_errors_name_the_file(text_model, tmp_path, capsys):
    bad = tmp_path / "prompt.txt"
    bad.write_bytes(b"def f():\xff\xfe\n")
    rc, _, err = cli(capsys, "run", text_model, "--prompt-file", bad, *RUN)
    assert rc == 2 and f"--prompt-file {bad}: not UTF-8 text" in err
    rc, _, err = cli(capsys, "run", text_model, "--prompt-file", tmp_path / "absent.txt", *RUN)
    assert rc == 2 and "absent.txt: No such file or directory" in err


def test_convert_unknown_expert_format(text_model, tmp_path, capsys):
    rc, _, err = cli(capsys, "convert", text_model, tmp_path / "out", "--experts", "q3", "--no-progress")
    assert rc == 2 and "--experts" in err and "'q3'" in err and "choose from" in err
    assert not (tmp_path / "out").exists()


def test_flags_checked_against_the_model(text_model, capsys):
    rc, _, err = cli(capsys, "run", text_model, "-p", PROMPT, *RUN, "--max-context", "100000")
    assert rc == 2 and "--max-context" in err and "100000" in err and "limit of 512" in err
    rc, _, err = cli(capsys, "run", text_model, "-p", PROMPT, *RUN, "--moe-top-k", "5")
    assert rc == 2 and "--moe-top-k" in err and "got 5" in err


def test_flags_that_pass_give_the_clean_tokens(text_model, clean_tokens, capsys):
    """A size with a unit in either convention and explicit defaults change nothing."""
    _, ids = clean_tokens
    rc, out, _ = cli(capsys, "run", text_model, "-p", PROMPT, *RUN, "--memory", "2048MiB", "--top-p", "1",
                     "--temperature", "0", "--json")
    assert rc == 0 and json.loads(out)["token_ids"] == ids


# -- API arguments: InvalidArgumentError (a SluiceError and a ValueError), the engine unharmed --------

GEN_CASES = {
    "max_new_tokens_zero": (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1, got 0"),
    "max_new_tokens_float": (dict(max_new_tokens=2.5), "max_new_tokens must be an integer >= 1, got 2.5"),
    "temperature_nan": (dict(temperature=math.nan), "temperature must be a finite number >= 0, got nan"),
    "temperature_tiny": (dict(temperature=1e-300), "temperature must be 0 (greedy) or at least 0.001, got 1e-300"),
    "top_p_above_one": (dict(top_p=2), "top_p must be a finite number in (0, 1], got 2"),
    "top_k_negative": (dict(top_k=-1), "top_k must be an integer >= 0, got -1"),
    "seed_overflow": (dict(seed=2**64), f"seed must be an integer from {-2**63} to {2**64 - 1}, got {2**64}"),
    "seed_string": (dict(seed="7"), "seed must be an integer from"),
    "logprobs_too_many": (dict(logprobs=21), "logprobs must be an integer from 0 to 20, got 21"),
    "stop_not_text": (dict(stop=5), "stop must be a string or a list of strings, got 5"),
    "stop_token_ids_text": (dict(stop_token_ids=["x"]), "stop_token_ids: token id 'x' is not an integer"),
    "ignore_eos_string": (dict(ignore_eos="false"), "ignore_eos must be True or False, got 'false'"),
    "prompt_id_negative": (dict(prompt=[5, -1]), "token id -1 is outside the vocabulary (0..511)"),
    "prompt_id_huge": (dict(prompt=[10**12]), "token id 1000000000000 is outside the vocabulary"),
    "prompt_id_float": (dict(prompt=[5, 1.5]), "prompt: token id 1.5 is not an integer"),
    "prompt_id_bool": (dict(prompt=[True]), "prompt: token id True is not an integer"),
    "prompt_empty": (dict(prompt=[]), "the prompt is empty"),
    "prompt_wrong_type": (dict(prompt=12), "prompt must be a string or a list of token ids, got int"),
}


@pytest.mark.parametrize("case", list(GEN_CASES))
def test_hostile_generate_argument(case, clean_tokens):
    eng, ids = clean_tokens
    kwargs, message = GEN_CASES[case]
    kwargs = {"prompt": PROMPT, "max_new_tokens": 4, "ignore_eos": True, "speculate": False, **kwargs}
    with pytest.raises(InvalidArgumentError) as e:
        eng.generate(kwargs.pop("prompt"), **kwargs)
    assert isinstance(e.value, sluice.SluiceError) and isinstance(e.value, ValueError)
    assert message in str(e.value)
    # the engine is unharmed: the next generation gives the clean tokens
    assert eng.generate(PROMPT, max_new_tokens=4, ignore_eos=True, speculate=False).token_ids == ids


def test_forward_arguments(clean_tokens):
    eng, _ = clean_tokens
    with pytest.raises(InvalidArgumentError, match="input_ids is empty"):
        eng.forward([])
    with pytest.raises(InvalidArgumentError, match="input_ids: token id 'a' is not an integer"):
        eng.forward(["a"])
    with pytest.raises(InvalidArgumentError, match="lossy|moe_top_k"):
        eng.set_lossy(moe_top_k=0)
    with pytest.raises(InvalidArgumentError, match=r"prefer_cached \(--prefer-cached\) must be a finite number"):
        eng.set_lossy(prefer_cached=math.nan)


LOAD_CASES = {
    "memory_word": (dict(memory="lots"), InvalidArgumentError, "memory: cannot parse size 'lots'"),
    "memory_string_without_unit": (dict(memory="1.5"), InvalidArgumentError, "memory: size '1.5' has no unit"),
    "memory_fractional_bytes": (dict(memory=1.5), InvalidArgumentError, "memory: cannot parse size 1.5"),
    "memory_negative": (dict(memory=-5), InvalidArgumentError, "memory: size must not be negative, got -5"),
    "max_context_negative": (dict(max_context=-1), InvalidArgumentError, "max_context must be an integer >= 1"),
    "threads_zero": (dict(threads=0), InvalidArgumentError, "threads must be an integer from 1 to"),
    "reader_threads_string": (dict(reader_threads="4"), InvalidArgumentError, "reader_threads must be an integer"),
    "cache_policy_unknown": (dict(cache_policy="mru"), InvalidArgumentError, "cache_policy: unknown cache policy"),
    "cache_policy_cross_negative": (dict(cache_policy="lfru:cross=-1"), InvalidArgumentError, "cross must be >= 0"),
    "cache_policy_cross_nan": (dict(cache_policy="lfru:cross=nan"), InvalidArgumentError, "cross must be >= 0"),
    "prefetch_string": (dict(prefetch="no"), InvalidArgumentError, "prefetch must be True or False, got 'no'"),
    "certain_reads_number": (dict(certain_reads=1), InvalidArgumentError, "certain_reads must be True or False, got 1"),
    "prefer_cached_negative": (dict(prefer_cached=-1), InvalidArgumentError, "prefer_cached must be a finite"),
    "disk_cache_word": (dict(disk_cache="lots"), InvalidArgumentError, "disk_cache: cannot parse size 'lots'"),
    "disk_cache_zero": (dict(disk_cache=0), InvalidArgumentError, "disk_cache must be a size above 0 bytes"),
    "disk_cache_dir_number": (dict(disk_cache="1GiB", disk_cache_dir=3), InvalidArgumentError,
                              "disk_cache_dir must be a file path, got 3"),
    "disk_cache_dir_alone": (dict(disk_cache_dir="/tmp/t"), InvalidArgumentError,
                             "disk_cache_dir (--disk-cache-dir) needs disk_cache (--disk-cache SIZE)"),
    "unknown_option": (dict(cache_size=3), UnknownOptionError, "unknown option(s) ['cache_size']"),
    "path_not_a_path": (dict(path=42), InvalidArgumentError, "path must be a model directory"),
}


@pytest.mark.parametrize("case", list(LOAD_CASES))
def test_hostile_load_argument(case, text_model):
    kwargs, error, message = LOAD_CASES[case]
    kwargs = {"path": text_model, "memory": "2GiB", "progress": False, **kwargs}
    with pytest.raises(error) as e:
        sluice.load(**kwargs)
    assert isinstance(e.value, sluice.SluiceError) and isinstance(e.value, ValueError)
    assert message in str(e.value)
    if error is UnknownOptionError:
        assert isinstance(e.value, TypeError)  # what load() raised before


def test_budget_above_the_machine_warns_and_runs(text_model, clean_tokens):
    _, ids = clean_tokens
    with pytest.warns(UserWarning, match=r"memory budget 1024\.00 TiB \(--memory\) is more than this machine's"):
        eng = sluice.load(text_model, memory=1 << 50, threads=1, max_context=64, progress=False)
    try:
        assert eng.generate(PROMPT, max_new_tokens=4, ignore_eos=True, speculate=False).token_ids == ids
    finally:
        eng.close()


# -- tokenizer files and chat templates ------------------------------------------------------------------


def _tok_config(chat_model) -> dict:
    return json.loads((chat_model / "tokenizer_config.json").read_text())


TOKENIZER_CASES = {
    "tokenizer_config_list": (lambda cfg: {"tokenizer_config.json": "[1, 2, 3]"},
                              ["tokenizer_config.json: must be a JSON object, got a JSON list"]),
    "tokenizer_config_not_json": (lambda cfg: {"tokenizer_config.json": "{chat_template: "},
                                  ["tokenizer_config.json: not valid JSON"]),
    "tokenizer_json_garbage": (lambda cfg: {"tokenizer.json": "\x00garbage{{{"},
                               ["tokenizer.json: cannot load tokenizer"]),
    "tokenizer_json_list": (lambda cfg: {"tokenizer.json": "[]"}, ["tokenizer.json: cannot load tokenizer"]),
    "template_not_text": (lambda cfg: {"tokenizer_config.json": json.dumps({**cfg, "chat_template": 42})},
                          ["chat_template must be a string", "got a JSON number"]),
    "template_syntax_error": (lambda cfg: {"tokenizer_config.json": json.dumps(
        {**cfg, "chat_template": "{% for m in messages %}{{ m.content }}"})},
        ["chat template has a syntax error at line 1", "endfor"]),
    "template_undefined": (lambda cfg: {"tokenizer_config.json": json.dumps(
        {**cfg, "chat_template": "{{ messages[0].nope.deeper }}"})},
        ["chat template failed: UndefinedError", "nope"]),
    "template_raises": (lambda cfg: {"tokenizer_config.json": json.dumps(
        {**cfg, "chat_template": "{{ raise_exception('only system messages allowed') }}"})},
        ["chat template failed", "only system messages allowed"]),
    "template_python_error": (lambda cfg: {"tokenizer_config.json": json.dumps(
        {**cfg, "chat_template": "{{ 1 // 0 }}"})}, ["chat template failed: ZeroDivisionError"]),
}


@pytest.mark.parametrize("case", list(TOKENIZER_CASES))
def test_hostile_tokenizer_files_run_chat(case, chat_model, tmp_path, capsys):
    files, expected = TOKENIZER_CASES[case]
    model = edited_copy(chat_model, tmp_path / "m", files=files(_tok_config(chat_model)))
    rc, out, err = cli(capsys, "run", model, "-p", PROMPT, "--chat", *RUN)
    assert rc == 1 and out == ""
    assert_names(err, "sluice: error: ", *expected)


def test_hostile_template_in_chat_command(chat_model, tmp_path, capsys, monkeypatch):
    cfg = {**_tok_config(chat_model), "chat_template": "{% if %}"}
    model = edited_copy(chat_model, tmp_path / "m", files={"tokenizer_config.json": json.dumps(cfg)})
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    rc, _, err = cli(capsys, "chat", model, *RUN)
    assert rc == 1 and "chat template has a syntax error" in err


def test_template_error_type(chat_model, tmp_path):
    cfg = {**_tok_config(chat_model), "chat_template": "{{ messages.x.y }}"}
    model = edited_copy(chat_model, tmp_path / "m", files={"tokenizer_config.json": json.dumps(cfg)})
    eng = sluice.load(model, memory="2GiB", threads=1, max_context=64, progress=False)
    try:
        with pytest.raises(ChatTemplateError) as e:
            eng.tokenizer.render_chat([{"role": "user", "content": "hi"}])
        assert isinstance(e.value, CheckpointError)
    finally:
        eng.close()


# -- end to end: the real exit status, no traceback ---------------------------------------------------


def _sluice(*args):
    return subprocess.run([sys.executable, "-m", "sluice.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def test_exit_status_of_a_bad_flag_subprocess(text_model):
    out = _sluice("run", text_model, "-p", PROMPT, "--temperature", "nan")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "argument --temperature" in out.stderr and "'nan'" in out.stderr


def test_exit_status_of_a_bad_config_subprocess(text_model, tmp_path):
    model = edited_copy(text_model, tmp_path / "m", {"num_attention_heads": 0})
    out = _sluice("run", model, "-p", PROMPT, *RUN)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "num_attention_heads=0" in out.stderr and out.stdout == ""

