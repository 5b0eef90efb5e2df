"""Shared fixtures: tiny random Hugging Face checkpoints (transformers is the oracle).

Random tiny models have near-tied logits and router scores; the fixtures scale weights
(initializer_range 0.2) and fixed seeds so that every compared position is decisive, and
``assert_decisive`` proves it at every position, so no test passes or fails by a tie.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# as `import sluice` does for users: sleeping OpenMP waiters (torch is imported here first)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402

from families import BASE, LOGIT_MARGIN, REGISTRY, ROUTER_MARGIN, FamilyModels, prompt_ids  # noqa: E402,F401

# the softmax-router families' extra config, from the registry (tests/families.py): each
# exercises what its family has (dense layers, sliding window, clip_qkv)
FAMILY_CONFIGS = {f: REGISTRY[f].overrides for f in ("qwen3_moe", "mixtral", "olmoe")}
FAMILIES = list(FAMILY_CONFIGS)


def tiny_config(model_type: str, **overrides):
    from transformers import AutoConfig

    base = dict(BASE)
    base.update(FAMILY_CONFIGS.get(model_type, {}))
    base.update(overrides)
    return AutoConfig.for_model(model_type, **base)


def save_tiny(path: Path, model_type: str, seed: int = 0, dtype=torch.float32, **overrides) -> Path:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    torch.manual_seed(seed)
    cfg = tiny_config(model_type, **overrides)
    # a wrapper transformers has no causal LM for (GLM-5.3-Flash): its image-text model
    cls = AutoModelForCausalLM if type(cfg) in AutoModelForCausalLM._model_mapping else AutoModelForImageTextToText
    model = cls.from_config(cfg).eval()
    model.to(dtype).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """``model_dir(family, dtype="float32", **overrides)`` -> a saved tiny checkpoint (cached per session)."""
    root = tmp_path_factory.mktemp("models")
    made: dict = {}

    def make(model_type: str, dtype: str = "float32", seed: int = 0, **overrides) -> Path:
        key = (model_type, dtype, seed, tuple(sorted(overrides.items())))
        if key not in made:
            name = f"{model_type}-{dtype}-{seed}-{len(made)}"
            made[key] = save_tiny(root / name, model_type, seed, getattr(torch, dtype), **overrides)
        return made[key]

    yield make
    shutil.rmtree(root, ignore_errors=True)


def reference(path: Path):
    """transformers model on the checkpoint's weights upcast to fp32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def at_level(level: int, fn):
    """``fn()`` with the C kernels capped at ISA ``level`` (0 portable, 1 AVX2, ...), then restored."""
    from sluice import kernels

    prev = kernels.set_isa_cap(level)
    try:
        return fn()
    finally:
        kernels.set_isa_cap(prev)


def assert_decisive(ref, ids: torch.Tensor, first: int, top_k: int) -> None:
    """Every position from ``first`` has a clear top-1 logit and clear router choices."""
    with torch.no_grad():
        out = ref(ids[None], output_router_logits=True)
    top = out.logits[0, first:].topk(2, dim=-1).values
    margin = (top[:, 0] - top[:, 1]).min().item()
    assert margin > LOGIT_MARGIN, f"top-1/top-2 logit margin {margin:.2e} is a near-tie: pick another seed"
    for layer, rl in enumerate(out.router_logits or ()):
        p = torch.softmax(rl.float().reshape(-1, rl.shape[-1]), -1).topk(top_k + 1, dim=-1).values
        rm = (p[:, top_k - 1] - p[:, top_k]).min().item()
        assert rm > ROUTER_MARGIN, f"router margin {rm:.2e} in layer {layer} is a near-tie: pick another seed"


@pytest.fixture(scope="session")
def family_models(tmp_path_factory):
    """The registry's tiny checkpoints and containers (``tests/families.py``), built once per session."""
    root = tmp_path_factory.mktemp("families")
    yield FamilyModels(root)
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def text_model(tmp_path_factory):
    """A tiny Qwen3-MoE checkpoint with a real byte-level BPE tokenizer (vocab 512)."""
    from sluice.synthetic import write_tokenizer

    path = save_tiny(tmp_path_factory.mktemp("text") / "qwen3-text", "qwen3_moe", vocab_size=512, eos_token_id=2)
    write_tokenizer(path, 512)
    return path


def _child_baseline() -> int:
    """RSS of a fresh Python process that has imported sluice's engine (and so torch). It varies by
    installation: libraries that pip has just written are fully in the page cache, and the
    kernel maps more of their pages per fault (measured 227 MiB in an old environment, 296 MiB
    right after a fresh install), so budgets in the memory tests are set above it."""
    out = subprocess.run([sys.executable, "-c", "import sluice.engine; from sluice.sysmem import current_rss; "
                          "print(current_rss())"], capture_output=True, text=True, timeout=300)
    return int(out.stdout.strip()) if out.returncode == 0 else 300 << 20


BASELINE = _child_baseline()
MiB = 1 << 20

# A synthetic model at least 3x larger than a budget, shared by the memory and I/O tests.
# The budget leaves ~50 MiB of expert cache above this model's floor (baseline + ~227 MiB).
BUDGET = max(500 * MiB, -(-(BASELINE + 280 * MiB) // (10 * MiB)) * 10 * MiB)
MODEL_BYTES = 3 * BUDGET + (100 << 20)  # at least 3x the budget

MEMTEST_BASE = {
    "model_type": "qwen3_moe", "vocab_size": 4096, "hidden_size": 512, "intermediate_size": 1024,
    "moe_intermediate_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2,
    "head_dim": 64, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True, "hidden_act": "silu",
    "rms_norm_eps": 1e-6, "max_position_embeddings": 2048,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}


@pytest.fixture(scope="session")
def big_model(tmp_path_factory):
    from sluice.synthetic import model_bytes, scaled_config, write_model

    cfg = scaled_config(MODEL_BYTES, MEMTEST_BASE, torch.bfloat16)
    need = model_bytes(cfg)
    root = tmp_path_factory.mktemp("memtest")
    free = shutil.disk_usage(root).free
    if free < need * 1.2:
        pytest.skip(f"needs {need / 1e9:.1f} GB free disk for the memory test model, only {free / 1e9:.1f} GB free")
    path = write_model(root / "model", cfg, progress=False, tokenizer=False)
    yield path, need
    shutil.rmtree(root, ignore_errors=True)



CHAT_TEMPLATE = (
    "{% for m in messages %}{{ bos_token }}{{ m['role'] }}\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}{{ bos_token }}assistant\n{% endif %}"
)


@pytest.fixture(scope="session")
def chat_model(text_model, tmp_path_factory):
    """``text_model`` plus a ChatML-like chat template using its special tokens <s> and </s>."""
    import json

    path = tmp_path_factory.mktemp("chat") / "qwen3-chat"
    shutil.copytree(text_model, path)
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return path


# A model whose spine alone is larger than its test budget (spine streaming).
# (floor: baseline + ~345 MiB; the spine alone is ~840 MiB)
SPINE_BUDGET = max(600 * MiB, -(-(BASELINE + 380 * MiB) // (10 * MiB)) * 10 * MiB)
SPINE_HEAVY = {
    "model_type": "qwen3_moe", "vocab_size": 4096, "hidden_size": 1536, "intermediate_size": 3072,
    "moe_intermediate_size": 256, "num_hidden_layers": 32, "num_attention_heads": 12, "num_key_value_heads": 4,
    "head_dim": 128, "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 2, "norm_topk_prob": True,
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 1024,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}


@pytest.fixture(scope="session")
def spine_model(tmp_path_factory):
    from sluice.synthetic import model_bytes, write_model

    need = model_bytes(SPINE_HEAVY)
    root = tmp_path_factory.mktemp("spine")
    free = shutil.disk_usage(root).free
    if free < need * 1.2:
        pytest.skip(f"needs {need / 1e9:.1f} GB free disk for the spine-streaming model, only {free / 1e9:.1f} GB free")
    path = write_model(root / "model", SPINE_HEAVY, progress=False, tokenizer=False)
    yield path
    shutil.rmtree(root, ignore_errors=True)

# -- helpers for the hybrid (linear + full attention) families ---------------------------------


def expected_outputs(ref, ids: torch.Tensor, n_new: int, decisive=None):
    """transformers' logits at every position of ``ids`` and its greedy continuation, proven
    decisive (``decisive(ref, out, first)``; default: ``assert_decisive`` with top-2 routing)."""
    with torch.no_grad():
        ref_logits = ref(ids[None]).logits[0]
        ref_out = ref.generate(ids[None], max_new_tokens=n_new, do_sample=False)[0]
    (decisive or (lambda r, o, f: assert_decisive(r, o, f, 2)))(ref, ref_out, len(ids) - 1)
    return ref_logits, ref_out[len(ids):].tolist()


def check_exact(expected, eng, ids: torch.Tensor, n_new: int, tol: float = 1e-4):
    """Engine logits within ``tol`` of ``expected`` at every position, greedy tokens identical,
    with n-gram speculation (the default for greedy) and without it."""
    ref_logits, ref_tokens = expected
    logits = eng.forward(ids)
    diff = (logits - ref_logits).abs().max().item()
    assert diff <= tol, f"max |logit diff| {diff:.3e} > {tol:.1e}"
    plain = eng.generate(ids.tolist(), max_new_tokens=n_new, ignore_eos=True, speculate=False)
    assert plain.token_ids == ref_tokens
    result = eng.generate(ids.tolist(), max_new_tokens=n_new, ignore_eos=True)
    assert result.token_ids == ref_tokens
    return logits, result


def fp32_noise(path: Path, ids: torch.Tensor) -> float:
    """How far transformers' fp32 logits are from its fp64 ones on ``ids``: the size of fp32
    rounding for this model and prompt (random tiny models amplify it)."""
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        f32 = reference(path)(ids[None]).logits[0].double()
        m64 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, experts_implementation="eager")
        f64 = m64.eval()(ids[None]).logits[0]
    return (f32 - f64).abs().max().item()


def check_chunked_vs_stepwise(load, path: Path, ids: torch.Tensor, gen: dict) -> None:
    """One prefill chunk, chunks of 7, token by token (``load(path, prefill_chunk=...)``): logits
    agree within fp32 rounding, greedy tokens identical."""
    runs = {}
    for chunk in (512, 7, 1):
        eng = load(path, prefill_chunk=chunk)
        runs[chunk] = (eng.forward(ids), eng.generate(ids.tolist(), max_new_tokens=16, **gen).token_ids)
    noise = fp32_noise(path, ids)
    assert noise < 1e-3
    base_logits, base_tokens = runs[512]
    for chunk in (7, 1):
        logits, tokens = runs[chunk]
        diff = (logits - base_logits).abs().max().item()
        # each fp32 evaluation lies about `noise` from the fp64 one: two of them within 2 x noise
        assert diff <= 2 * noise, (f"prefill_chunk={chunk}: max |logit diff| {diff:.3e} vs one chunk, "
                                   f"fp32 noise {noise:.1e}")
        assert tokens == base_tokens


def check_prefix_reuse(eng, fresh, p1: list[int], gen: dict) -> None:
    """Prefix reuse on a recurrent model gives the tokens of a fresh run in four situations.

    At least the expected number of tokens come back from a snapshot (speculative decoding
    may have left a later one), never more than the prompt shares with what the state holds.
    """
    g1 = eng.generate(p1, reuse_prefix=True, **gen).token_ids

    def check(prompt, expect_reused):
        held = eng.state.tokens[: eng.state.length]
        common = next((i for i, (a, b) in enumerate(zip(held, prompt)) if a != b), min(len(held), len(prompt)))
        r = eng.generate(prompt, reuse_prefix=True, **gen)
        assert r.token_ids == fresh.generate(prompt, **gen).token_ids
        assert expect_reused <= r.stats["reused_prefix_tokens"] <= min(common, len(prompt) - 1)
        return r.token_ids

    g2 = check(p1 + g1 + [5, 6, 7], len(p1) + len(g1) - 1)  # continued conversation: the whole state
    p3 = p1 + g1 + [5, 6, 7] + g2[:4] + [g2[4] ^ 1, 9]
    check(p3, len(p1) + len(g1) + 3 - 1)  # diverges inside the last generation: the snapshot before its prompt's end
    check(p3, len(p3) - 1)  # a regeneration starts from the snapshot before the prompt's last token
    check([p1[0] ^ 1] + p1[1:], 0)  # diverges before any snapshot: nothing to reuse


# -- skips only with a listed reason ----------------------------------------------------------
# A test module that defines SKIP_REASONS (reason strings) and KNOWN_BUGS (xfail reasons) may
# skip a test only with one of those reasons: any other skip or xfail becomes a failure here,
# and is recorded in UNLISTED_SKIPS for the module's own check.
UNLISTED_SKIPS: list[str] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    listed = getattr(item.module, "SKIP_REASONS", None)
    if listed is None or not rep.skipped:
        return
    if hasattr(rep, "wasxfail"):
        reason, allowed = rep.wasxfail, set(getattr(item.module, "KNOWN_BUGS", {}).values())
        ok = any(reason == a or reason.endswith(a) for a in allowed)
    else:
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        ok = any(reason.endswith(a) for a in listed.values())
    if not ok:
        UNLISTED_SKIPS.append(f"{item.nodeid}: {reason}")
        rep.outcome = "failed"
        rep.longrepr = f"skipped without a reason listed in the module's SKIP_REASONS / KNOWN_BUGS: {reason}"


# -- Remote storage: real servers on loopback (tests/remote_servers.py); nothing leaves 127.0.0.1.


@pytest.fixture(scope="session")
def remote_servers(tmp_path_factory):
    """nginx (HTTP + HTTPS) and moto S3 serving what tests ``publish``; explicit test credentials
    in the environment and the instance metadata service off, for the whole session."""
    from remote_servers import CLIENT_ENV, NginxServer, RemoteServers, S3Server, nginx_binary

    if nginx_binary() is None:
        pytest.skip("nginx is not installed (Debian: apt-get install nginx; .ci/run installs it)")
    saved = {k: os.environ.get(k) for k in CLIENT_ENV}
    os.environ.update(CLIENT_ENV)
    root = tmp_path_factory.mktemp("remote")
    (root / "doc").mkdir()
    s3 = S3Server(log_path=root / "moto.log")
    try:
        http = NginxServer(root / "doc", root / "nginx")
    except BaseException:
        s3.close()
        raise
    servers = RemoteServers(s3=s3, http=http, docroot=root / "doc")
    yield servers
    http.close()
    s3.close()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def s3_auth_server(remote_servers, tmp_path_factory):
    """A second moto S3 server with authentication on (SigV4 checked against an IAM user's key)."""
    from remote_servers import S3Server

    server = S3Server(auth=True, log_path=tmp_path_factory.mktemp("moto-auth") / "moto.log")
    yield server
    server.close()


@pytest.fixture
def fault_proxy(remote_servers):
    """``fault_proxy(upstream_port, latency=, rate=)`` -> a FaultProxy closed after the test."""
    from remote_servers import FaultProxy

    made = []

    def make(upstream_port: int, **kw) -> FaultProxy:
        made.append(FaultProxy(upstream_port, **kw))
        return made[-1]

    yield make
    for p in made:
        p.close()
