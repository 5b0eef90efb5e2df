"""GLM-4.5 (glm4_moe): the checkpoint tensor names Sluice relies on (GLM-4.5 and GLM-4.5-Air
shapes, block FP8), the published config.json shape and config-shape variants against
transformers, the multi-token-prediction layers never read, block-FP8 linears kept in FP8
against the dequantized twin, and the config fields it reads.

(Exactness on every axis runs in the fidelity matrix through the registry entry.)"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import sluice
from conftest import prompt_ids
from families import PROMPT, reference, save_family
from sluice.checkpoint import Checkpoint
from sluice.convert import convert
from sluice.errors import UnsupportedModelError
from sluice.models import get_family
from sluice.quant.fp8 import BlockFP8
from sluice.storage.faults import FaultPlan, inject_faults

glm = get_family("glm4_moe")
N_NEW = 32

# The published GLM-4.5 config.json (the keys its architecture reads; transformers'
# configuration_glm4_moe.py documents them, and its modeling file ignores the MTP layer 92).
GLM45_CONFIG = dict(
    architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", vocab_size=151552, hidden_size=5120,
    intermediate_size=12288, moe_intermediate_size=1536, num_hidden_layers=92, num_attention_heads=96,
    num_key_value_heads=8, head_dim=128, hidden_act="silu", max_position_embeddings=131072, rms_norm_eps=1e-5,
    rope_theta=1000000, partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True,
    n_routed_experts=160, n_shared_experts=1, num_experts_per_tok=8, n_group=1, topk_group=1,
    norm_topk_prob=True, routed_scaling_factor=2.5, first_k_dense_replace=3, num_nextn_predict_layers=1,
    tie_word_embeddings=False,
    pad_token_id=151329, eos_token_id=[151329, 151336, 151338],
)
# GLM-4.5-Air: smaller, no q/k norm, one dense layer, MTP layer 46
AIR_CONFIG = dict(GLM45_CONFIG, hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408,
                  num_hidden_layers=46, n_routed_experts=128, use_qk_norm=False, routed_scaling_factor=1.0,
                  first_k_dense_replace=1)
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def _layer(desc, i: int) -> dict:
    p = f"model.layers.{i}."
    return {k[len(p):]: v for k, v in desc.spine.items() if k.startswith(p)}


def test_checkpoint_tensor_names():
    """One dense and one MoE layer as GLM-4.5's model.safetensors.index.json names them
    (transformers' conversion mapping for glm4_moe is qwen2_moe's: per-expert
    ``mlp.experts.<e>.{gate,up,down}_proj.weight`` merged at load, written back on save):
    q/k/v with biases, o_proj without, per-head q/k norms, the gate with its correction bias,
    the shared experts; no tensor of the MTP layer 92."""
    desc = glm.describe(glm.parse_config(GLM45_CONFIG))
    attn = {
        "input_layernorm.weight": (5120,), "post_attention_layernorm.weight": (5120,),
        "self_attn.q_proj.weight": (12288, 5120), "self_attn.k_proj.weight": (1024, 5120),
        "self_attn.v_proj.weight": (1024, 5120), "self_attn.o_proj.weight": (5120, 12288),
        "self_attn.q_norm.weight": (128,), "self_attn.k_norm.weight": (128,),
        "self_attn.q_proj.bias": (12288,), "self_attn.k_proj.bias": (1024,), "self_attn.v_proj.bias": (1024,),
    }
    assert _layer(desc, 2) == {**attn, "mlp.gate_proj.weight": (12288, 5120),
                               "mlp.up_proj.weight": (12288, 5120), "mlp.down_proj.weight": (5120, 12288)}
    assert _layer(desc, 3) == {
        **attn, "mlp.gate.weight": (160, 5120), "mlp.gate.e_score_correction_bias": (160,),
        "mlp.shared_experts.gate_proj.weight": (1536, 5120),
        "mlp.shared_experts.up_proj.weight": (1536, 5120),
        "mlp.shared_experts.down_proj.weight": (5120, 1536)}
    assert {k: v for k, v in desc.spine.items() if not k.startswith("model.layers.")} == {
        "model.embed_tokens.weight": (151552, 5120), "model.norm.weight": (5120,),
        "lm_head.weight": (151552, 5120)}
    assert not any(k.startswith("model.layers.92.") for k in desc.spine)
    e = "model.layers.91.mlp.experts.159."
    refs = {role: (r.name, tuple(r.shape)) for role, r in desc.expert_tensors(91, 159).items()}
    assert refs == {"gate": (e + "gate_proj.weight", (1536, 5120)),
                    "up": (e + "up_proj.weight", (1536, 5120)),
                    "down": (e + "down_proj.weight", (5120, 1536))}
    assert desc.moe_layers == list(range(3, 92)) and desc.top_k == 8 and desc.n_experts == 160
    assert any("partial RoPE: 64 of 128" in n for n in desc.notes)
    assert any("multi-token-prediction" in n and "model.layers.92" in n for n in desc.notes)


def test_air_tensor_names():
    """GLM-4.5-Air: no q/k norms, layer 0 dense, 128 experts, MTP layer 46 not declared."""
    desc = glm.describe(glm.parse_config(AIR_CONFIG))
    assert "self_attn.q_norm.weight" not in _layer(desc, 1) and "self_attn.q_proj.bias" in _layer(desc, 1)
    assert desc.moe_layers == list(range(1, 46)) and desc.n_experts == 128
    assert _layer(desc, 0)["mlp.gate_proj.weight"] == (10944, 4096)
    assert not any(k.startswith("model.layers.46.") for k in desc.spine)


def test_fp8_tensor_names():
    """A block-FP8 GLM-4.5 (128 x 128 blocks): every linear with its ``weight_scale_inv``
    [ceil(N/128), ceil(K/128)]; the gate, its bias, the q/k/v biases and the norms plain."""
    desc = glm.describe(glm.parse_config(dict(GLM45_CONFIG, quantization_config=FP8)))
    layer = _layer(desc, 3)
    scales = {k: v for k, v in layer.items() if k.endswith("_scale_inv")}
    assert scales == {
        "self_attn.q_proj.weight_scale_inv": (96, 40), "self_attn.k_proj.weight_scale_inv": (8, 40),
        "self_attn.v_proj.weight_scale_inv": (8, 40), "self_attn.o_proj.weight_scale_inv": (40, 96),
        "mlp.shared_experts.gate_proj.weight_scale_inv": (12, 40),
        "mlp.shared_experts.up_proj.weight_scale_inv": (12, 40),
        "mlp.shared_experts.down_proj.weight_scale_inv": (40, 12)}
    assert _layer(desc, 0)["mlp.down_proj.weight_scale_inv"] == (40, 96)
    e = "model.layers.3.mlp.experts.0."
    refs = {role: (r.name, tuple(r.shape)) for role, r in desc.expert_tensors(3, 0).items()}
    assert refs["gate_scale_inv"] == (e + "gate_proj.weight_scale_inv", (12, 40))
    assert refs["down_scale_inv"] == (e + "down_proj.weight_scale_inv", (40, 12))
    assert desc.expert.block == (128, 128)


def test_names_match_what_transformers_saves(family_models):
    """Every tensor transformers writes for the tiny model is a declared spine tensor or an expert tensor."""
    from safetensors import safe_open

    path = family_models.hf("glm4_moe", "f32")
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    desc = glm.describe(glm.parse_config(json.loads((path / "config.json").read_text())))
    experts = {r.name for layer in desc.moe_layers for e in range(desc.n_experts)
               for r in desc.expert_tensors(layer, e).values()}
    assert saved == set(desc.spine) | experts


def _exact(path) -> None:
    """f32 logits within 1e-4 of transformers at every position, 32 greedy tokens identical."""
    ref = reference(path)
    ids = prompt_ids()
    with torch.no_grad():
        ref_logits = ref(ids[None]).logits[0]
        ref_out = ref.generate(ids[None], max_new_tokens=N_NEW, do_sample=False)[0]
    with sluice.load(path, memory="4GiB", progress=False) as eng:
        assert (eng.forward(ids) - ref_logits).abs().max().item() <= 1e-4
        out = eng.generate(ids.tolist(), max_new_tokens=N_NEW, ignore_eos=True, speculate=False)
    assert out.token_ids == ref_out[len(ids):].tolist()


def test_published_config_shape_against_transformers(family_models, tmp_path):
    """The published config.json: top-level ``rope_theta`` and ``partial_rotary_factor``, no
    ``rope_parameters``; and with no ``partial_rotary_factor`` at all, transformers' 0.5."""
    src = family_models.hf("glm4_moe", "f32")
    for name, factor in (("published", 0.5), ("no_factor", None)):
        dst = tmp_path / name
        shutil.copytree(src, dst)
        cfg = json.loads((dst / "config.json").read_text())
        cfg.pop("rope_parameters")
        cfg.update(rope_theta=1000000, num_nextn_predict_layers=1)
        if factor is not None:
            cfg["partial_rotary_factor"] = factor
        (dst / "config.json").write_text(json.dumps(cfg))
        assert glm.parse_config(cfg).rotary_dim == 8
        assert reference(dst).config.rope_parameters["partial_rotary_factor"] == 0.5
        _exact(dst)


# config-shape variants of the registry entry: (overrides, seed)
VARIANTS = {
    # GLM-4.5-Air's options: no q/k norm, no groups, no scaling
    "air": (dict(use_qk_norm=False, n_group=1, topk_group=1, routed_scaling_factor=1.0), 0),
    # no shared experts (transformers: a zero-width MLP), no renormalisation, no biases, full RoPE
    "bare": (dict(n_shared_experts=0, norm_topk_prob=False, attention_bias=False,
                  partial_rotary_factor=1.0), 0),
    # two shared experts (one MLP twice as wide), every layer MoE, partial RoPE 0.25
    "wide_shared": (dict(n_shared_experts=2, first_k_dense_replace=0, partial_rotary_factor=0.25), 0),
    # two dense layers, then MoE
    "two_dense": (dict(first_k_dense_replace=2), 0),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_config_variants_against_transformers(variant, tmp_path):
    extra, seed = VARIANTS[variant]
    path = save_family(tmp_path / variant, "glm4_moe", seed=seed, **extra)
    _exact(path)


def _with_mtp_shard(src, dst):
    """``src`` plus an MTP layer (``model.layers.<num_hidden_layers>.*``, the names GLM-4.5 ships
    at layer 92) in its own shard ``model-mtp.safetensors``, every value NaN."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    n, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    main = load_file(str(src / "model.safetensors"))
    p = f"model.layers.{n}."
    mtp = {name.replace("model.layers.2.", p): torch.full_like(t, float("nan"))
           for name, t in main.items() if name.startswith("model.layers.2.")}
    mtp.update({p + "enorm.weight": torch.full((h,), float("nan")),
                p + "hnorm.weight": torch.full((h,), float("nan")),
                p + "eh_proj.weight": torch.full((h, 2 * h), float("nan")),
                p + "shared_head.norm.weight": torch.full((h,), float("nan"))})
    save_file(main, str(dst / "model-main.safetensors"), metadata={"format": "pt"})
    save_file(mtp, str(dst / "model-mtp.safetensors"), metadata={"format": "pt"})
    weight_map = {**{k: "model-main.safetensors" for k in main}, **{k: "model-mtp.safetensors" for k in mtp}}
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


def test_mtp_layers_are_never_read(family_models, tmp_path, monkeypatch):
    """A checkpoint with an MTP layer (all NaN, in its own shard): no byte of that shard is read
    after its header (any read raises here), the logits are bit-identical to the checkpoint
    without it, and the container converted from it holds none of its tensors."""
    src = family_models.hf("glm4_moe", "f32")
    path = _with_mtp_shard(src, tmp_path / "mtp")
    plans = []
    init = Checkpoint.__init__

    def guarded(self, *a, **kw):
        init(self, *a, **kw)  # reads the headers of every shard
        plans.append(inject_faults(self, FaultPlan(fail_at=1, path_filter="model-mtp")))

    monkeypatch.setattr(Checkpoint, "__init__", guarded)
    ids = prompt_ids()
    with sluice.load(src, memory="4GiB", progress=False) as eng:
        want = eng.forward(ids)
        tokens = eng.generate(ids.tolist(), max_new_tokens=8, ignore_eos=True).token_ids
    with sluice.load(path, memory="4GiB", cache_experts=4, progress=False) as eng:
        assert torch.equal(eng.forward(ids), want)
        assert eng.generate(ids.tolist(), max_new_tokens=8, ignore_eos=True).token_ids == tokens
        assert any("multi-token-prediction" in n for n in eng.desc.notes)
    box = convert(path, tmp_path / "mtp.sluice", progress=False)
    assert plans and all(p.reads == 0 for p in plans)
    monkeypatch.setattr(Checkpoint, "__init__", init)
    with sluice.load(box, memory="4GiB", progress=False) as b:
        assert not any(".layers.3." in name for name in b.checkpoint.tensors)
        assert torch.equal(b.forward(ids), want)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(cfg, num_nextn_predict_layers=0)))
    with pytest.raises(sluice.CheckpointError, match="model.layers.3"):  # no MTP layer declared: refused
        sluice.load(path, memory="4GiB", progress=False)


def test_fp8_stays_fp8(family_models, tmp_path):
    """The FP8 checkpoint against transformers on its dequantized twin (fp32 compute on both
    sides: the fp32 bound), with attention, the dense and shared MLPs and the experts in FP8."""
    fp8 = family_models.hf("glm4_moe", "fp8")
    ref_logits, ref_tokens = family_models.expected("glm4_moe", "fp8")  # transformers on the twin, once a session
    ids = PROMPT
    with sluice.load(fp8, memory="4GiB", cache_experts=4, progress=False) as eng:
        logits = eng.forward(ids)
        assert (logits - ref_logits).abs().max().item() <= 1e-4
        result = eng.generate(ids.tolist(), max_new_tokens=N_NEW, ignore_eos=True, speculate=False)
        assert result.token_ids == ref_tokens
        assert eng.experts_source.format == "fp8" and result.stats["evictions"] > 0
        layers = eng.model.layers
        attn = layers[1].attn
        for w in (attn.wq, attn.wk, attn.wv, attn.wo, layers[0].mlp.gate, layers[1].mlp.shared.down):
            assert isinstance(w, BlockFP8) and w.weight.dtype == torch.float8_e4m3fn
        assert attn.bq.dtype == torch.float32 and attn.bo is None
        slot = next(s for s in eng.cache.slots if s.weights is not None)
        assert isinstance(slot.weights["gate"], BlockFP8)
        assert layers[1].mlp.router.weight.dtype == torch.float32  # the router stays plain
    box = convert(fp8, tmp_path / "fp8.sluice", progress=False)
    with sluice.load(box, memory="4GiB", cache_experts=4, progress=False) as b:
        assert b.experts_source.format == "fp8"
        assert torch.equal(b.forward(ids), logits)


def test_transformers_fp8_loading_reads_the_same_layout(family_models, tmp_path):
    """transformers' own FP8 loader (on a CPU-only machine it dequantizes at load) reads the FP8
    layout Sluice reads (per-expert ``{gate,up,down}_proj.weight_scale_inv``) and agrees."""
    pytest.importorskip("accelerate")  # transformers' FP8 loader needs it
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from families import to_fp8

    fp8, _ = to_fp8(family_models.hf("glm4_moe", "f32"), tmp_path / "fp8", tmp_path / "deq", block=[8, 8])
    with safe_open(str(fp8 / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"model.layers.1.mlp.experts.3.down_proj.weight_scale_inv",
            "model.layers.1.mlp.shared_experts.up_proj.weight_scale_inv",
            "model.layers.0.mlp.gate_proj.weight_scale_inv",
            "model.layers.2.self_attn.o_proj.weight_scale_inv"} <= names
    ref = AutoModelForCausalLM.from_pretrained(fp8, dtype=torch.float32).eval()
    ids = prompt_ids()
    with torch.no_grad():
        ref_logits = ref(ids[None]).logits[0].float()
    with sluice.load(fp8, memory="4GiB", progress=False) as eng:
        assert (eng.forward(ids) - ref_logits).abs().max().item() <= 1e-4


def test_config_fields():
    cfg = glm.parse_config(GLM45_CONFIG)
    assert (cfg.rotary_dim, cfg.head_dim, cfg.rope["rope_theta"], cfg.mtp_layers) == (64, 128, 1000000, 1)
    assert (cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor, cfg.n_shared_experts) == (1, 1, 2.5, 1)
    assert cfg.attention_bias and cfg.use_qk_norm and cfg.weights.kind is None
    minimal = {k: v for k, v in GLM45_CONFIG.items() if k not in (
        "partial_rotary_factor", "num_nextn_predict_layers", "first_k_dense_replace", "n_shared_experts",
        "norm_topk_prob", "routed_scaling_factor", "use_qk_norm", "attention_bias", "rms_norm_eps")}
    d = glm.parse_config(minimal)  # transformers' Glm4MoeConfig defaults
    assert (d.rotary_dim, d.mtp_layers, d.moe_layers[0], d.n_shared_experts) == (64, 1, 1, 1)
    assert (d.norm_topk_prob, d.routed_scaling_factor) == (True, 1.0)
    assert (d.use_qk_norm, d.attention_bias) == (False, False)
    assert d.rms_norm_eps == 1e-5
    # rope_parameters' factor wins over the top-level one (as transformers reads them)
    nested = dict(GLM45_CONFIG, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                 "partial_rotary_factor": 0.25})
    assert glm.parse_config(nested).rotary_dim == 32
    alias = dict(GLM45_CONFIG, num_nextn_predict_layers=None, num_mtp_layers=2)
    assert glm.parse_config(alias).mtp_layers == 2
    assert glm.parse_config(dict(GLM45_CONFIG, first_k_dense_replace=0)).moe_layers == list(range(92))
    assert glm.parse_config(dict(GLM45_CONFIG, num_local_experts=160)).n_routed_experts == 160
    with pytest.raises(UnsupportedModelError, match="disagree"):
        glm.parse_config(dict(GLM45_CONFIG, num_local_experts=128))
