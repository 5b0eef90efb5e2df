"""Contracts every family keeps, as types and as tests on every family.

- Routing goes through a ``layers.routing.Router``: one call signature with the optional
  cache bias, ids sorted by descending selection score. The lossy switches
  (``prefer_cached``, ``moe_top_k``) run on every family, and at their identity values
  leave results bit-identical.
- Streamed spine weights: nothing is derived from them at build time. The test-only load
  option ``poison_stream_buffers`` fills every stream buffer with 0xFF bytes (NaN in every
  float dtype) before its first real fill, so a build-time derivation gives NaN logits; the
  streamed spine must then be bit-identical to the resident one.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import sluice
from conftest import prompt_ids
from families import REGISTRY
from sluice.layers.routing import GroupedRouter, Router, SoftmaxRouter, TopKSoftmaxRouter
from sluice.models.base import CausalLM, DecoderLayer, MoEBlock

# The registry's tiny checkpoints (tests/families.py): every family, as the fidelity matrix runs them
FAMILIES = list(REGISTRY)
N_NEW = 8


def _load(path, **opts):
    opts.setdefault("progress", False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the lossy switches warn, as they should
        return sluice.load(path, memory="2GiB", **opts)


def _run(path, **opts):
    """(logits at every prompt position, greedy tokens) of one engine."""
    eng = _load(path, **opts)
    try:
        ids = prompt_ids()
        return eng.forward(ids), eng.generate(ids.tolist(), max_new_tokens=N_NEW, ignore_eos=True).token_ids
    finally:
        eng.close()


@pytest.fixture(scope="module")
def family_model(family_models):
    """``family_model(family, dtype="float32")`` -> the registry's tiny checkpoint, built once per session."""
    return lambda family, dtype="float32": family_models.hf(family, {"float32": "f32", "bfloat16": "bf16"}[dtype])


# -- Router ------------------------------------------------------------------------------------

E, H, K = 16, 24, 6


def _routers():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(E, H, generator=g)
    corr = 0.3 * torch.randn(E, generator=g)
    lb = torch.randn(E, generator=g)
    return {
        "softmax": SoftmaxRouter(w, K, normalize=True),
        "softmax-unnormalised": SoftmaxRouter(w, K, normalize=False),
        # ERNIE-4.5: correction bias [1, E] as stored, the renormalisation clamped at 0.9
        "softmax-corrected": SoftmaxRouter(w, K, normalize=True, correction=corr[None], norm_min=0.9),
        "grouped": GroupedRouter(w, K, correction=corr, n_group=4, topk_group=2, normalize=True, scale=2.5),
        "grouped-ungrouped": GroupedRouter(w, K, correction=corr, normalize=False, scale=1.5),
        "topk_softmax": TopKSoftmaxRouter(w, K, lb),
    }


def _selection(router: Router, x: torch.Tensor, bias=None) -> torch.Tensor:
    """The score each router selects by [T, E], computed here independently of routing.py."""
    logits = x @ router.weight.T
    if isinstance(router, TopKSoftmaxRouter):
        s = logits + router.linear_bias
    elif isinstance(router, GroupedRouter):
        s = torch.sigmoid(logits) + router.correction
    else:
        s = torch.softmax(logits, -1)
        if router.correction is not None:
            s = s + router.correction[0]
    return s if bias is None else s + bias


def _eligible(router: Router, sel: torch.Tensor) -> torch.Tensor:
    """``sel`` with the experts of non-selected groups at -inf (group-limited routing)."""
    if not isinstance(router, GroupedRouter) or router.topk_group >= router.n_group:
        return sel
    t = sel.shape[0]
    grouped = sel.view(t, router.n_group, -1)
    gs = grouped.topk(2, dim=-1).values.sum(-1)
    keep = torch.zeros_like(gs, dtype=torch.bool).scatter_(1, gs.topk(router.topk_group, -1).indices, True)
    return sel.masked_fill(~keep[:, :, None].expand_as(grouped).reshape(t, -1), float("-inf"))


def _assert_descending(ids, sel):
    s = sel.gather(1, ids)
    strictly = s[:, :-1] > s[:, 1:]
    tie_in_id_order = (s[:, :-1] == s[:, 1:]) & (ids[:, :-1] < ids[:, 1:])
    assert bool((strictly | tie_in_id_order).all()), "ids are not in descending selection-score order"


@pytest.mark.parametrize("kind", list(_routers()))
def test_router_ids_descend_by_selection_score(kind):
    router = _routers()[kind]
    x = torch.randn(64, H, generator=torch.Generator().manual_seed(1))
    ids, weights = router(x)
    assert ids.shape == weights.shape == (64, K)
    sel = _eligible(router, _selection(router, x))
    _assert_descending(ids, sel)
    # the chosen experts are the K best eligible ones
    want = sel.sort(dim=-1, descending=True, stable=True).indices[:, :K]
    assert torch.equal(ids, want)


@pytest.mark.parametrize("kind", list(_routers()))
def test_router_ties_break_by_expert_id(kind):
    r = _routers()[kind]
    zero = torch.zeros_like(r.weight)
    kw = dict(n_group=4, topk_group=2) if isinstance(r, GroupedRouter) else {}
    tied = {SoftmaxRouter: lambda: SoftmaxRouter(zero, K, normalize=True),
            GroupedRouter: lambda: GroupedRouter(zero, K, **kw),
            TopKSoftmaxRouter: lambda: TopKSoftmaxRouter(zero, K)}[type(r)]()
    ids, weights = tied(torch.randn(5, H))  # every score equal
    assert bool((ids[:, 1:] > ids[:, :-1]).all()), ids


@pytest.mark.parametrize("kind", list(_routers()))
def test_cache_bias_selects_but_does_not_weigh(kind):
    router = _routers()[kind]
    x = torch.randn(32, H, generator=torch.Generator().manual_seed(2))
    favoured = [1, 2, 9, 11, 12, 14]  # 3 groups of 4 hold them: with the bias, groups 0 and 3 win
    bias = torch.zeros(E)
    bias[favoured] = torch.tensor([6.0, 5.0, 4.0, 3.0, 7.0, 8.0]) * 10
    plain_ids, plain_w = router(x)
    ids, weights = router(x, bias=bias)
    assert not torch.equal(ids, plain_ids)
    sel = _eligible(router, _selection(router, x, bias))
    _assert_descending(ids, sel)
    # the weights come from the model's own scores of the chosen experts, never from the bias
    logits = x @ router.weight.T
    if isinstance(router, TopKSoftmaxRouter):
        want = torch.softmax((logits + router.linear_bias).gather(1, ids), -1)
    elif isinstance(router, GroupedRouter):
        want = torch.sigmoid(logits).gather(1, ids)
        if router.normalize:
            want = want / want.sum(-1, keepdim=True)
        want = want * router.scale
    else:
        want = torch.softmax(logits, -1).gather(1, ids)
        if router.normalize:
            want = want / want.sum(-1, keepdim=True).clamp(min=router.norm_min or 0.0)
    torch.testing.assert_close(weights, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", ["grouped", "softmax", "topk_softmax", "softmax-corrected"])
@pytest.mark.parametrize("keep", [1, 2, 3])
def test_moe_top_k_keeps_the_best_experts(kind, keep):
    router = _routers()[kind]
    x = torch.randn(64, H, generator=torch.Generator().manual_seed(3))
    block = MoEBlock(0, router, experts=None)
    block.top_k = keep
    ids, weights = block.route(x)
    sel = _eligible(router, _selection(router, x))
    assert torch.equal(ids, sel.sort(dim=-1, descending=True, stable=True).indices[:, :keep])
    full_ids, full_w = router(x)
    torch.testing.assert_close(weights.sum(-1), full_w.sum(-1))  # rescaled to the original total


def test_moe_block_and_lookahead_accept_only_a_router():
    w = torch.randn(E, H)
    with pytest.raises(TypeError, match="Router"):
        MoEBlock(0, lambda x, bias=None: None, experts=None)
    block = MoEBlock(0, SoftmaxRouter(w, 2, True), experts=None)
    block.router = lambda x, bias=None: None  # swapped after construction: the lookahead refuses it too
    layer = DecoderLayer(lambda h: h, None, lambda h: h, block)
    lm = CausalLM(torch.zeros(4, H), [layer], lambda h: h, torch.zeros(4, H), None)
    with pytest.raises(TypeError, match="Router"):
        lm.predict(0, torch.randn(1, H))


# -- the lossy switches on every family --------------------------------------------------------


@pytest.fixture(scope="module")
def default_runs(family_model):
    return {f: _run(family_model(f)) for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_lossy_switches_run_and_are_exact_at_identity(family_model, default_runs, family):
    path = family_model(family)
    logits, tokens = default_runs[family]
    for opts in (dict(prefer_cached=1.0), dict(moe_top_k=1), dict(moe_top_k=1, prefer_cached=0.5)):
        lossy_logits, lossy_tokens = _run(path, **opts)
        assert torch.isfinite(lossy_logits).all(), opts
        assert len(lossy_tokens) == N_NEW
    top1_logits, _ = _run(path, moe_top_k=1)
    assert not torch.equal(top1_logits, logits)  # one expert instead of the model's top-k changes the output
    eng = _load(path)
    routers = [layer.mlp.router for layer in eng.model.layers if isinstance(layer.mlp, MoEBlock)]
    k = eng.desc.top_k
    eng.close()
    assert routers and all(type(r).__module__ == "sluice.layers.routing" for r in routers)
    same_logits, same_tokens = _run(path, moe_top_k=k, prefer_cached=0.0)
    assert torch.equal(same_logits, logits) and same_tokens == tokens


def test_model_top_k_is_not_lossy(family_model):
    """``moe_top_k`` equal to the model's own top-k is exact: no lossy flag, no warning."""
    import warnings

    eng = _load(family_model("qwen3_moe"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eng.set_lossy(moe_top_k=eng.desc.top_k)
    assert eng.lossy == {}
    with pytest.warns(UserWarning, match="lossy"):
        eng.set_lossy(moe_top_k=1)
    assert eng.lossy == {"moe_top_k": 1}
    eng.close()


# -- streamed spine: nothing derived at build time -----------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_spine_is_bit_identical(family_model, family, dtype):
    path = family_model(family, dtype)
    ids = prompt_ids()
    resident = _load(path)
    streamed = _load(path, max_resident_layers=0, debug=sluice.DebugOptions(poison_stream_buffers=True))
    try:
        assert not resident.plan.streamed_layers
        assert streamed.plan.streamed_layers == list(range(resident.desc.n_layers))  # every layer streamed
        want = resident.forward(ids)
        got = streamed.forward(ids)
        assert torch.isfinite(want).all()
        assert torch.equal(got, want), f"max |diff| {(got - want).abs().max().item():.3e}"
        gen = dict(max_new_tokens=6, ignore_eos=True)
        assert streamed.generate(ids.tolist(), **gen).token_ids == resident.generate(ids.tolist(), **gen).token_ids
    finally:
        resident.close()
        streamed.close()


def test_poisoned_buffers_catch_a_build_time_derivation(family_model, monkeypatch):
    """The poison makes a build-time derivation from a streamed weight fail loudly: here the
    fp32 conv kernel Qwen3-Next used to derive once, at build, from a bf16 streamed weight."""
    from sluice.layers.gated_delta import GatedDeltaNet

    init = GatedDeltaNet.__init__

    def derive_at_build(self, **kw):
        init(self, **kw)
        frozen = self.conv.float().reshape(self.conv.shape[0], -1).clone()
        self.conv_weight = lambda: frozen

    monkeypatch.setattr(GatedDeltaNet, "__init__", derive_at_build)
    poison = sluice.DebugOptions(poison_stream_buffers=True)
    eng = _load(family_model("qwen3_next", "bfloat16"), max_resident_layers=0, debug=poison)
    try:
        assert torch.isnan(eng.forward(prompt_ids())).all()
    finally:
        eng.close()


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_streamed_block_fp8_is_bit_identical(family_model, tmp_path, scale_dtype):
    """DeepSeek-V3 block-FP8 weights: e4m3 values and their block scales, both streamed (the
    scales once were upcast at build time when stored in bf16)."""
    import json

    from safetensors.torch import load_file, save_file

    from sluice.quant.fp8 import quantize

    src = family_model("deepseek_v3")
    tensors = {}
    for name, t in load_file(src / "model.safetensors").items():
        if ".layers." in name and name.endswith(("_proj.weight", "_proj_with_mqa.weight")):
            w, s = quantize(t, (16, 16))
            tensors[name], tensors[name + "_scale_inv"] = w, s.to(scale_dtype)
        else:
            tensors[name] = t
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [16, 16]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ids = prompt_ids()
    poison = sluice.DebugOptions(poison_stream_buffers=True)
    resident, streamed = _load(tmp_path), _load(tmp_path, max_resident_layers=0, debug=poison)
    try:
        want = resident.forward(ids)
        assert torch.isfinite(want).all()
        assert torch.equal(streamed.forward(ids), want)
    finally:
        resident.close()
        streamed.close()
