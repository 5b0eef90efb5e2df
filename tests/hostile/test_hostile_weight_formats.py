"""Hostile quantized checkpoints (``models/weight_format.py``), for every family of the registry:
a ``quantization_config`` Sluice does not read as stored (another method, FP8 format or block,
INT4 bits or group size, compressed-tensors scheme, a module set it cannot honour) and files
whose scales or packed words are missing or misshapen are refused with one line naming the key
or the tensor, never read as something else."""

from __future__ import annotations

import copy
import json
import re
import shutil

import pytest

import sluice
from families import FAMILY_NAMES, REGISTRY, _stored_config
from sluice.errors import ConfigError, SluiceError, UnsupportedModelError
from sluice.models import get_family

# GPT-OSS and DeepSeek-V4 (for now) refuse every one (test_weight_formats.py)
SUPPORTED = [f for f in FAMILY_NAMES if f not in ("gpt_oss", "deepseek_v4")]
FP8 = _stored_config("fp8", (128, 128), [])
CT_FP8 = _stored_config("ct-fp8", (128, 128), [])
INT4 = _stored_config("int4", (128, 128), [])


def _edit(qc: dict, path: str, value) -> dict:
    """``qc`` with the key at dotted ``path`` set to ``value``."""
    qc = copy.deepcopy(qc)
    *head, last = path.split(".")
    d = qc
    for k in head:
        d = d[k]
    d[last] = value
    return qc


W = "config_groups.group_0.weights"
G = "config_groups.group_0"
# name -> (quantization_config, what the one-line error names)
CONFIG_CASES = {
    "not_an_object": ("fp8", "quantization_config must be an object"),
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 128}, "quant_method='awq'"),
    "gptq": ({"quant_method": "gptq", "bits": 4}, "quant_method='gptq'"),
    "no_method": ({"weight_block_size": [128, 128]}, "quant_method=None"),
    "fp8_e5m2": (_edit(FP8, "fmt", "e5m2"), "fmt='e5m2'"),
    "fp8_static": (_edit(FP8, "activation_scheme", "static"), "activation_scheme='static'"),
    "fp8_no_block": (_edit(FP8, "weight_block_size", None), "weight_block_size=None"),
    "fp8_zero_block": (_edit(FP8, "weight_block_size", [0, 128]), "weight_block_size=[0, 128]"),
    "fp8_three_block": (_edit(FP8, "weight_block_size", [128, 128, 1]), "weight_block_size=[128, 128, 1]"),
    "int4_8_bits": (_edit(INT4, f"{W}.num_bits", 8), "num_bits=8"),
    "int4_group_128": (_edit(INT4, f"{W}.group_size", 128), "group_size=128"),
    "int4_group_64": (_edit(INT4, f"{W}.group_size", 64), "group_size=64"),
    "int4_asymmetric": (_edit(INT4, f"{W}.symmetric", False), "symmetric=False"),
    "int4_activations": (_edit(INT4, f"{G}.input_activations", {"num_bits": 8, "dynamic": True}),
                         "input_activations"),
    "int4_covers_spine": (_edit(INT4, f"{G}.targets", ["Linear"]), "INT4 is read for routed experts only"),
    "int4_covers_no_expert": (_edit(INT4, f"{G}.targets", ["re:.*lm_head"]), "does not cover the routed experts"),
    "ct_int8": (_edit(CT_FP8, "format", "int-quantized"), "format='int-quantized'"),
    "ct_fp8_4_bits": (_edit(CT_FP8, f"{W}.num_bits", 4), "num_bits=4"),
    "ct_fp8_per_tensor": (_edit(CT_FP8, f"{W}.strategy", "tensor"), "strategy='tensor'"),
    "ct_fp8_group": (_edit(CT_FP8, f"{W}.strategy", "group"), "strategy='group'"),
    "ct_fp8_bad_block": (_edit(_edit(CT_FP8, f"{W}.strategy", "block"), f"{W}.block_structure", [128]),
                         "block_structure=[128]"),
    "ct_fp8_static_acts": (_edit(CT_FP8, f"{G}.input_activations.dynamic", False), "input_activations"),
    "ct_two_groups": (_edit(CT_FP8, "config_groups.group_1", {}), "exactly one group"),
    "ct_bad_regex": (_edit(CT_FP8, "ignore", ["re:(unclosed"]), "not a regular expression"),
    "ct_frozen": (_edit(CT_FP8, "quantization_status", "frozen"), "quantization_status='frozen'"),
    "ct_kv_cache": (_edit(CT_FP8, "kv_cache_scheme", {"num_bits": 8}), "kv_cache_scheme"),
}


@pytest.fixture(scope="module")
def raw_configs():
    return {f: REGISTRY[f].config().to_dict() for f in SUPPORTED}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_hostile_quantization_config(case, raw_configs):
    qc, expected = CONFIG_CASES[case]
    for family in SUPPORTED:
        mod = get_family(family)
        raw = {**json.loads(json.dumps(raw_configs[family])), "quantization_config": copy.deepcopy(qc)}
        with pytest.raises((ConfigError, UnsupportedModelError)) as e:
            mod.describe(mod.parse_config(raw))
        msg = str(e.value)
        assert expected in msg and msg.startswith("config.json") and "\n" not in msg, (family, msg)


def test_int4_group_needs_multiples_of_32():
    mod = get_family("qwen3_moe")
    raw = REGISTRY["qwen3_moe"].config(moe_intermediate_size=48, quantization_config=INT4).to_dict()
    with pytest.raises(UnsupportedModelError, match="intermediate size 48 must be multiples of 32"):
        mod.describe(mod.parse_config(raw))


# -- files ----------------------------------------------------------------------------------------


def _tamper(src, dst, pattern: str, change):
    """Copy checkpoint ``src`` to ``dst`` with ``change(tensors, name)`` applied to the first tensor
    whose name matches ``pattern``; returns that name."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    name = next(n for n in sorted(tensors) if re.search(pattern, n))
    change(tensors, name)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return name


def _drop(t, name):
    del t[name]


def _flatten(t, name):
    t[name] = t[name].flatten()


def _widen(t, name):
    t[name] = t[name].float()


# name -> (kind, tensor pattern, change, what the error names beside the tensor)
FILE_CASES = {
    "fp8_expert_scale_missing": ("fp8", r"experts\.\d+\.\w+\.weight_scale_inv$", _drop, "is missing"),
    "fp8_expert_scale_shape": ("fp8", r"experts\.\d+\.\w+\.weight_scale_inv$", _flatten, "has shape"),
    "fp8_spine_scale_missing": ("fp8", r"self_attn\.\w+\.weight_scale_inv$", _drop, "is missing"),
    "fp8_spine_scale_shape": ("fp8", r"self_attn\.\w+\.weight_scale_inv$", _flatten, "has shape"),
    "ct_fp8_scale_shape": ("ct-fp8", r"experts\.\d+\.\w+\.weight_scale$", _flatten, "has shape"),
    "ct_fp8_scale_missing": ("ct-fp8", r"self_attn\.\w+\.weight_scale$", _drop, "is missing"),
    "int4_packed_missing": ("int4", r"experts\.\d+\.\w+\.weight_packed$", _drop, "is missing"),
    "int4_packed_shape": ("int4", r"experts\.\d+\.\w+\.weight_packed$", _flatten, "has shape"),
    "int4_scale_dtype": ("int4", r"experts\.\d+\.\w+\.weight_scale$", _widen, "is F32), the format stores BF16"),
}


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe"])  # plain names; a multimodal wrapper's
@pytest.mark.parametrize("case", list(FILE_CASES))
def test_hostile_quantized_files(case, family, family_models, tmp_path):
    kind, pattern, change, expected = FILE_CASES[case]
    name = _tamper(family_models.hf(family, kind), tmp_path / "m", pattern, change)
    with pytest.raises(SluiceError) as e:
        sluice.load(tmp_path / "m", memory="4GiB", progress=False)
    msg = str(e.value)
    assert expected in msg and "\n" not in msg, msg
    # the tensor, by its name in the file or (a wrapper's spine) in the text model
    assert repr(name) in msg or repr(name.replace("model.language_model.", "model.")) in msg, msg
