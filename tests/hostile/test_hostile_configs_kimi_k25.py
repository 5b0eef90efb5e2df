"""Hostile Kimi K2.5 config.json fields (the kimi_k25 wrapper and the compressed-tensors INT4
``quantization_config`` it and Kimi K2-Thinking ship): each refused at parse time with one
message naming the field, never misread."""

from __future__ import annotations

import copy
import json
import warnings

import pytest

from families import REGISTRY
from sluice.errors import ConfigError, UnsupportedModelError
from sluice.models import get_family
from sluice.models.weight_format import INT4

kimi = get_family("kimi_k25")  # the deepseek_v3 family (an alias)
ds = get_family("deepseek_v3")

QCONFIG = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "kv_cache_scheme": None, "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                                        "re:.*mlp\\.(gate|up|down)_proj.*"],
    "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                  "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                              "group_size": 32, "dynamic": False, "actorder": None}}},
}
W = ("config_groups", "group_0", "weights")
G = ("config_groups", "group_0")

# (path inside quantization_config, value) -> what the message names
QUANT_CASES = {
    "num_bits_8": (W + ("num_bits",), 8, "num_bits=8"),
    "num_bits_true": (W + ("num_bits",), True, "num_bits=True"),
    "type_float": (W + ("type",), "float", "type='float'"),
    "asymmetric": (W + ("symmetric",), False, "symmetric=False"),
    "channel": (W + ("strategy",), "channel", "strategy='channel'"),
    "group_128": (W + ("group_size",), 128, "group_size=128"),
    "group_string": (W + ("group_size",), "32", "group_size='32'"),
    "group_float": (W + ("group_size",), 32.0, "group_size=32.0"),
    "dynamic": (W + ("dynamic",), True, "dynamic=True"),
    "actorder": (W + ("actorder",), "group", "actorder='group'"),
    "block_structure": (W + ("block_structure",), [128, 128], "block_structure=[128, 128]"),
    "scale_f32": (W + ("scale_dtype",), "float32", "scale_dtype='float32'"),
    "weights_missing": (W, None, "weights=None"),
    "input_acts": (G + ("input_activations",), {"num_bits": 8}, "input_activations"),
    "output_acts": (G + ("output_activations",), {"num_bits": 8}, "output_activations"),
    "group_format": (G + ("format",), "int-quantized", "format='int-quantized'"),
    "targets_string": (G + ("targets",), "Linear", "targets='Linear'"),
    "format": (("format",), "float-quantized", "num_bits=4 is not supported (expected 8 for format "
                                               "'float-quantized'"),
    "spine_covered": (("ignore",), ["lm_head"], "model.layers.0.self_attn.q_a_proj': compressed-tensors INT4 is "
                                                "read for routed experts only"),
    "format_missing": (("format",), None, "format=None"),
    "frozen": (("quantization_status",), "frozen", "quantization_status='frozen'"),
    "kv_cache": (("kv_cache_scheme",), {"num_bits": 8}, "kv_cache_scheme"),
    "sparsity": (("sparsity_config",), {"format": "sparse-24"}, "sparsity_config"),
    "two_groups": (("config_groups",), {"a": {}, "b": {}}, "exactly one group"),
    "ignore_string": (("ignore",), "lm_head", "ignore='lm_head'"),
    "other_method": (("quant_method",), "awq", "quant_method='awq'"),
}


def _set(q: dict, path: tuple, value) -> dict:
    q = copy.deepcopy(q)
    d = q
    for k in path[:-1]:
        d = d[k]
    d[path[-1]] = value
    return q


@pytest.fixture(scope="module")
def text():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return REGISTRY["deepseek_v3"].config().to_dict()


def _wrap(text: dict, **top) -> dict:
    return {"model_type": "kimi_k25", "text_config": json.loads(json.dumps(text)), **top}


def test_clean_configs_parse(text):
    cfg = kimi.parse_config(_wrap(text, quantization_config=QCONFIG))
    assert cfg.weights.kind == INT4 and cfg.prefix == "language_model."
    assert cfg.tie_word_embeddings  # the wrapper's default
    assert not kimi.parse_config(_wrap(text, tie_word_embeddings=False)).tie_word_embeddings
    assert ds.parse_config({**text, "quantization_config": QCONFIG}).weights.kind == INT4
    assert kimi.describe(cfg).expert_format == "int4"


@pytest.mark.parametrize("case", list(QUANT_CASES))
def test_hostile_quantization_config(case, text):
    path, value, expected = QUANT_CASES[case]
    q = _set(QCONFIG, path, value)
    for parse, raw, where in ((ds.parse_config, {**text, "quantization_config": q}, "config.json: "),
                              (kimi.parse_config, _wrap(text, quantization_config=q), "config.json text_config: ")):
        with pytest.raises((ConfigError, UnsupportedModelError)) as e:
            ds.describe(parse(json.loads(json.dumps(raw))))
        assert expected in str(e.value) and str(e.value).startswith(where), str(e.value)
        assert "\n" not in str(e.value)


WRAPPER_CASES = {
    "no_text_config": (lambda t: {"model_type": "kimi_k25"}, "text_config=None"),
    "text_config_string": (lambda t: {"model_type": "kimi_k25", "text_config": "deepseek_v3"}, "text_config="),
    "text_other_type": (lambda t: _wrap({**t, "model_type": "qwen3_moe"}), "model_type='qwen3_moe'"),
    "tie_string": (lambda t: _wrap(t, tie_word_embeddings="no"), "tie_word_embeddings='no'"),
    "two_quant_configs": (lambda t: _wrap({**t, "quantization_config": QCONFIG},
                                          quantization_config=_set(QCONFIG, W + ("group_size",), 64)),
                          "quantization_config differs"),
    "text_hostile": (lambda t: _wrap({**t, "n_group": 3}), "config.json text_config: n_routed_experts="),
    "hidden_not_32": (lambda t: _wrap({**t, "hidden_size": 48}, quantization_config=QCONFIG),
                      "hidden_size=48"),
}


@pytest.mark.parametrize("case", list(WRAPPER_CASES))
def test_hostile_wrapper(case, text):
    make, expected = WRAPPER_CASES[case]
    with pytest.raises((ConfigError, UnsupportedModelError)) as e:
        kimi.describe(kimi.parse_config(make(json.loads(json.dumps(text)))))
    assert expected in str(e.value) and str(e.value).startswith("config.json"), str(e.value)
