"""Sluice against the engines users would pick instead, and against the physical limits.

    # once: the peers, each in its own venv under ~/.cache/sluice-bench (llama.cpp builds ~12 min)
    python benchmarks/peers.py install
    # everything (models are written and converted on first use, then reused)
    PYTHONPATH=src python benchmarks/run.py all
    # one scenario
    PYTHONPATH=src python benchmarks/run.py cold  --size 12GB --cap-ratio 0.25
    PYTHONPATH=src python benchmarks/run.py warm
    PYTHONPATH=src python benchmarks/run.py sweep --size 12GB
    PYTHONPATH=src python benchmarks/run.py exact
    # tables and charts from the JSON results
    python benchmarks/report.py

Scenarios (one JSON file each in --results):
- ``cold``: a model ``1/cap-ratio`` times larger than the memory cap, page cache dropped, every
  engine under the same cgroup memory limit; the disk's bandwidth measured in the same run.
- ``warm``: a model that fits; each engine generates once (warm-up), then the measured run;
  the memory bandwidth measured in the same run.
- ``sweep``: Sluice alone on the cold model, caps from its floor to the whole model.
- ``exact``: a small model run by every engine in fp32 arithmetic, greedy tokens compared with
  transformers' fp32 reference (random bf16 models have near-tied logits: see docs/benchmarks.md).

Needs root for the cgroup memory cap (cgroup v1 memory controller at /sys/fs/cgroup/memory,
or a cgroup v2 group with the memory controller delegated) and for dropping page caches;
without them the runs still happen and the results say the cap was not enforced or the
cache not dropped.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import harness as H  # noqa: E402
import make_model  # noqa: E402
import peers  # noqa: E402

ENGINES = ["sluice", "hf", "llamacpp", "airllm"]
PROMPT = (
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n"
    "    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n\nclass Cache:\n    def __init__(self, size):\n"
)
WARMUP_PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser()\n"

# the model of each scenario: family, target size / expert count, dtype
MODELS = {
    "cold": dict(family="mixtral", size="12GB", dtype="bf16"),
    "warm": dict(family="mixtral", experts=8, dtype="bf16"),
    "exact": dict(family="mixtral", experts=8, dtype="bf16", overrides={"num_hidden_layers": 4}),
    # spine streaming: wide attention, small experts, so the spine (attention, norms, routers,
    # embeddings) is ~80% of the model and ~3x the cap
    "spine": dict(family="mixtral", experts=8, dtype="bf16", overrides={
        "num_hidden_layers": 40, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "intermediate_size": 128, "vocab_size": 4096}),
}
TINY = {  # the smoke test's model (a few MB)
    "vocab_size": 2048, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
}


class Bench:
    """Resolves engines (their python, their model artifact) and runs arms."""

    def __init__(self, args):
        self.args = args
        self.cache = peers.cache_dir(args.cache)
        self.venvs = peers.cache_dir(args.venvs or args.cache)
        self.results = Path(args.results)
        self.results.mkdir(parents=True, exist_ok=True)
        self.logs = self.results / "logs"
        self.logs.mkdir(exist_ok=True)
        self.cgroup, self.cgroup_why = H.cgroup_support()
        if args.no_cgroup:
            self.cgroup, self.cgroup_why = None, "--no-cgroup given"
        self.pythons = {"sluice": sys.executable}
        for item in args.python or []:
            k, _, v = item.partition("=")
            self.pythons[k] = sys.executable if v == "current" else v

    # -- engines --------------------------------------------------------------------------

    def python_for(self, engine: str) -> tuple[str | None, str]:
        if engine in self.pythons:
            return self.pythons[engine], ""
        if peers.installed(self.venvs, engine):
            return str(peers.venv_python(self.venvs, engine)), ""
        return None, (f"not installed: run `python benchmarks/peers.py install --peers {engine}` "
                      f"(venv under {self.venvs}/venvs/{engine})")

    def artifact(self, engine: str, model: Path, dtype: str) -> tuple[str, dict]:
        """The engine's form of ``model`` (converted once, cached) and how long converting took."""
        if engine in ("sluice", "hf"):
            return str(model), {}
        if engine == "llamacpp":
            out = self.cache / "gguf" / f"{model.name}-{dtype}.gguf"
            info = {}
            if not out.exists():
                out.parent.mkdir(parents=True, exist_ok=True)
                t0 = time.time()
                make_model.to_gguf(model, out, self.python_for("llamacpp")[0],
                                   peers.converter_dir(self.venvs) / "convert_hf_to_gguf.py", dtype)
                info["convert_s"] = time.time() - t0
            info["artifact_bytes"] = out.stat().st_size
            return str(out), info
        if engine == "airllm":
            out = self.cache / "airllm" / model.name
            info = {}
            if not (out / "model.safetensors.index.json").exists():
                t0 = time.time()
                make_model.to_airllm(model, out)
                info["convert_s"] = time.time() - t0
            info["artifact_bytes"] = H.dir_bytes(out)
            return str(out), info
        raise ValueError(engine)

    def scratch(self, engine: str, model: Path) -> str | None:
        if engine == "hf":
            d = self.cache / "offload" / model.name
            shutil.rmtree(d, ignore_errors=True)  # accelerate rewrites it on every load
            return str(d)
        if engine == "airllm":
            return str(self.cache / "airllm-split" / model.name)
        return None

    def run(self, engine: str, model: Path, ids: list[int], *, new_tokens: int, cap: int | None,
            engine_memory: int | None, warmup: bool = False, cold: bool = True, options: dict | None = None,
            dtype: str = "bf16", tag: str = "", profile: bool = False) -> dict:
        python, why = self.python_for(engine)
        base = {"engine": engine, "tag": tag, "cap_bytes": cap}
        if python is None:
            print(f"  {engine}: SKIPPED ({why})", flush=True)
            return {**base, "skipped": why, "ok": False}
        try:
            path, conv = self.artifact(engine, model, dtype)
        except Exception as e:  # a failed conversion is a result, not a crash
            print(f"  {engine}: conversion FAILED ({e})", flush=True)
            return {**base, "ok": False, "error": f"conversion failed: {e}"}
        waited = self.wait_quiet()
        dropped, drop_why = H.drop_caches() if cold else (None, "warm run: page cache kept")
        name = f"{tag or 'run'}-{engine}"
        spec = H.ArmSpec(
            engine=engine, python=python, model=path, ids=ids, new_tokens=new_tokens, threads=self.args.threads,
            cap=cap, engine_memory=engine_memory, warmup=warmup, scratch=self.scratch(engine, model),
            options=dict(options or {}), timeout_s=self.args.timeout,
            env={"PYTHONPATH": str(H.REPO / "src")} if engine == "sluice" else {},
            profile=str(self.logs / f"{name}.prof") if profile else None, log=str(self.logs / f"{name}.log"))
        print(f"  {engine}: running ({'cap ' + fmt_gib(cap) if cap else 'no cap'}, {new_tokens} tokens)...",
              flush=True)
        rec = H.run_arm(spec, self.cgroup if cap else None)
        rec.update(tag=tag, artifact=path, conversion=conv, page_cache_dropped=dropped, waited_for_quiet_s=waited,
                   page_cache_note=drop_why, command=shlex.join(H.arm_command(spec)))
        if engine == "hf" and spec.scratch:
            shutil.rmtree(spec.scratch, ignore_errors=True)
        if spec.profile and Path(spec.profile).exists():
            rec["profile"] = profile_summary(spec.profile, self.results / f"profile-{name}.txt")
        if rec["ok"]:
            print(f"  {engine}: decode {num(rec['decode_tok_s'])} tok/s, prefill {num(rec['prefill_tok_s'])} tok/s, "
                  f"ttft {num(rec['ttft_s'])} s, read/token {fmt_gb(rec['read_bytes_per_decode_token'])}, "
                  f"peak RSS {fmt_gib(rec['peak_rss_bytes'])}", flush=True)
        else:
            print(f"  {engine}: FAILED: {rec.get('error', '')[:400]}", flush=True)
        return rec

    def wait_quiet(self) -> float:
        """With --quiet-load: wait (up to --quiet-wait s) until the 1-minute load average is below it."""
        limit = self.args.quiet_load
        t0 = time.time()
        if not limit:
            return 0.0
        while time.time() - t0 < self.args.quiet_wait:
            la = H.loadavg()
            if not la or la[0] < limit:
                break
            time.sleep(10)
        return time.time() - t0

    # -- models ---------------------------------------------------------------------------

    def model(self, key: str) -> Path:
        spec = dict(MODELS[key])
        if self.args.tiny:
            spec = dict(family="mixtral", experts=8, dtype=spec["dtype"], overrides=dict(TINY))
        if key == "cold" and getattr(self.args, "size", None) and not self.args.tiny:
            spec["size"] = self.args.size
        family, dtype = spec["family"], spec["dtype"]
        ov = spec.get("overrides") or {}
        label = spec.get("size") or f"{spec.get('experts')}x" + ("-spine" if key == "spine" else "")
        suffix = "-tiny" if self.args.tiny else ("-l%d" % ov["num_hidden_layers"] if "num_hidden_layers" in ov else "")
        path = self.cache / "models" / f"{family}-{label}{suffix}-{dtype}"
        size = make_model.parse_size(spec["size"]) if spec.get("size") else None
        make_model.write(path, family, size, dtype, std=0.2, overrides=ov, experts=spec.get("experts"),
                         progress=not self.args.tiny)
        return path

    def prompt_ids(self, model: Path, n: int, text: str = PROMPT) -> list[int]:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(model / "tokenizer.json"))
        ids = tok.encode(text).ids
        while len(ids) < n:
            ids = ids + ids
        return ids[:n]

    def save(self, name: str, data: dict) -> Path:
        path = self.results / f"{name}.json"
        data = {"scenario": name, "command": command_line(), "machine": H.machine_info(),
                "finished": time.strftime("%Y-%m-%d %H:%M:%S"), **data}
        path.write_text(json.dumps(anonymize(data), indent=1))
        print(f"wrote {path}", flush=True)
        return path


def profile_summary(prof: str, out: Path, top: int = 30) -> str:
    """The cProfile of an arm's measured generation as text: by own time, then cumulative."""
    import io
    import pstats

    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    st.strip_dirs().sort_stats("tottime").print_stats(top)
    st.sort_stats("cumulative").print_stats(top)
    out.write_text(anonymize(buf.getvalue()))
    return str(out)


def anonymize(obj, subs=None):
    """Machine-specific paths out of results that get committed: home -> ~, repo -> ., venv -> <venv>."""
    if subs is None:
        subs = [(str(H.REPO), "."), (sys.prefix, "<sluice-venv>"), (str(Path.home()), "~")]
    if isinstance(obj, str):
        for a, b in subs:
            obj = obj.replace(a, b)
        return obj
    if isinstance(obj, dict):
        return {k: anonymize(v, subs) for k, v in obj.items()}
    if isinstance(obj, list):
        return [anonymize(v, subs) for v in obj]
    return obj


def command_line() -> str:
    argv = [a for a in sys.argv]
    argv[0] = os.path.relpath(argv[0]) if os.path.isabs(argv[0]) else argv[0]
    return "PYTHONPATH=src python " + shlex.join(argv)


def num(x, nd=2):
    return "-" if x is None else f"{x:.{nd}f}"


def fmt_gb(x):
    return "-" if x is None else f"{x / 1e9:.3f} GB"


def fmt_gib(x):
    return "-" if x is None else f"{x / 2**30:.2f} GiB"


def engines(args) -> list[str]:
    return [e.strip() for e in args.engines.split(",") if e.strip()]


# -- scenarios ----------------------------------------------------------------------------


def match(rec: dict, ref: list[int] | None) -> dict:
    toks = (rec.get("result") or {}).get("token_ids")
    if not toks or not ref:
        return {"match": None, "agree_prefix": None}
    n = 0
    for a, b in zip(toks, ref):
        if a != b:
            break
        n += 1
    return {"match": toks == ref[: len(toks)] and len(toks) == len(ref), "agree_prefix": n}


def scenario_cold(b: Bench) -> dict:
    a = b.args
    model = b.model("cold")
    facts = H.model_facts(str(model))
    cap = a.cap or int(facts["checkpoint_bytes"] * a.cap_ratio)
    if a.tiny and not a.cap:
        cap = 1536 << 20  # a tiny model is far below any process's baseline: a cap that still runs
    ids = b.prompt_ids(model, a.prompt_tokens)
    print(f"cold: {model.name} {facts['checkpoint_bytes'] / 1e9:.2f} GB, cap {fmt_gib(cap)}", flush=True)
    b.wait_quiet()
    limits = H.measure_limits(sys.executable, str(model), a.threads)
    print(f"  disk: O_DIRECT {limits['direct_read']['bytes_per_s'] / 1e9:.2f} GB/s at "
          f"{limits['direct_read']['record_bytes'] / 1e6:.1f} MB reads, buffered sequential "
          f"{limits['buffered_sequential_read']['bytes_per_s'] / 1e9:.2f} GB/s", flush=True)
    runs = []
    for e in engines(a):
        runs.append(b.run(e, model, ids, new_tokens=a.new_tokens, cap=cap, engine_memory=cap, tag="cold"))
    profiled = None
    if a.profile and "sluice" in engines(a):  # a separate run: cProfile's overhead stays out of the table
        profiled = b.run("sluice", model, ids, new_tokens=a.new_tokens, cap=cap, engine_memory=cap,
                         tag="cold-profiled", profile=True)
    # an fp32 reference of a model this size does not fit in RAM for transformers itself; AirLLM
    # runs transformers' own modules layer by layer, so with dtype=float32 it gives transformers'
    # fp32 tokens (it matches transformers fp32 exactly in the exact scenario). Not timed, no cap.
    ref_rec = None
    if not a.skip_reference:
        ref_rec = b.run("airllm", model, ids, new_tokens=a.new_tokens, cap=None, engine_memory=None, cold=False,
                        options={"dtype": "float32"}, tag="cold-reference")
    ref = ((ref_rec or {}).get("result") or {}).get("token_ids")
    bf16 = next((r["result"]["token_ids"] for r in runs if r.get("engine") == "hf" and r.get("ok")), None)
    for r in runs:
        r.update(match(r, ref))
        m = match(r, bf16)
        r["match_bf16"], r["agree_prefix_bf16"] = m["match"], m["agree_prefix"]
        r["reference"] = "transformers' modules in fp32 (run layer by layer by AirLLM, dtype=float32)"
    b.wait_quiet()
    limits_after = H.measure_limits(sys.executable, str(model), a.threads)
    return {"model": str(model), "model_facts": facts, "cap_bytes": cap, "prompt_ids": ids, "limits": limits,
            "limits_after": limits_after, "reference": ref_rec, "profiled": profiled, "runs": runs,
            "cgroup": b.cgroup, "cgroup_note": b.cgroup_why}


def scenario_warm(b: Bench) -> dict:
    a = b.args
    model = b.model("warm")
    facts = H.model_facts(str(model))
    cap = a.cap or int(facts["checkpoint_bytes"] * 2 + (2 << 30))
    ids = b.prompt_ids(model, a.prompt_tokens)
    print(f"warm: {model.name} {facts['checkpoint_bytes'] / 1e9:.2f} GB, cap {fmt_gib(cap)}", flush=True)
    b.wait_quiet()
    limits = H.measure_limits(sys.executable, str(model), a.threads)
    print(f"  memory read bandwidth {limits['memory_read']['bytes_per_s'] / 1e9:.1f} GB/s", flush=True)
    runs = []
    ref_rec = None
    if not a.skip_reference:
        ref_rec = b.run("hf", model, ids, new_tokens=a.new_tokens, cap=None, engine_memory=None, warmup=False,
                        cold=False, options={"dtype": "float32", "margins": True}, tag="warm-reference")
    ref = (ref_rec or {}).get("result", {}) or {}
    for rep in range(a.repeat):  # engines interleaved, so that a busy spell of the machine hits all of them
        for e in engines(a):
            # transformers gets no device_map here: the whole model in RAM is the point of this scenario
            runs.append(b.run(e, model, ids, new_tokens=a.new_tokens, cap=cap,
                              engine_memory=None if e == "hf" else cap, warmup=True, cold=False,
                              tag="warm" if a.repeat == 1 else f"warm-r{rep}"))
    profiled = None
    if a.profile and "sluice" in engines(a):
        profiled = b.run("sluice", model, ids, new_tokens=a.new_tokens, cap=cap, engine_memory=cap, warmup=True,
                         cold=False, tag="warm-profiled", profile=True)
    for r in runs:
        r.update(match(r, ref.get("token_ids")))
        r["reference"] = "transformers fp32 (weights upcast), same checkpoint"
    return {"model": str(model), "model_facts": facts, "cap_bytes": cap, "prompt_ids": ids, "limits": limits,
            "reference": ref_rec, "profiled": profiled, "runs": runs, "cgroup": b.cgroup,
            "cgroup_note": b.cgroup_why}


def scenario_sweep(b: Bench) -> dict:
    a = b.args
    model = b.model("cold")
    facts = H.model_facts(str(model))
    sys.path.insert(0, str(H.REPO / "src"))
    from sluice.engine import ModelInfo, Options

    info = ModelInfo(model)
    ctx = max(256, a.prompt_tokens + a.new_tokens + 16)
    plan = info.plan(1 << 50, Options(max_context=ctx, parallel=1), baseline=None)  # the arm runs one stream
    total = facts["experts_total"]
    floor = plan.floor
    shares = [float(s) for s in a.shares.split(",")]
    caps = {floor >> 20: floor}
    for s in shares:
        c = max(floor, plan.budget_for_slots(int(s * total)))
        caps.setdefault(c >> 20, c)
    caps = sorted(caps.values())
    avail = H.mem_available()
    ids = b.prompt_ids(model, a.prompt_tokens)
    warm_ids = b.prompt_ids(model, a.prompt_tokens, WARMUP_PROMPT)
    print(f"sweep: {model.name}, floor {fmt_gib(floor)}, caps {[fmt_gib(c) for c in caps]}", flush=True)
    b.wait_quiet()
    limits = H.measure_limits(sys.executable, str(model), a.threads)
    runs = []
    for cap in caps:
        rec = b.run("sluice", model, ids, new_tokens=a.new_tokens, cap=cap, engine_memory=cap, warmup=True,
                    cold=True, options={"warmup_ids": warm_ids}, tag=f"sweep-{cap >> 20}MiB")
        rec["floor_bytes"] = floor
        runs.append(rec)
    return {"model": str(model), "model_facts": facts, "floor_bytes": floor, "prompt_ids": ids,
            "warmup_prompt_ids": warm_ids, "limits": limits, "runs": runs, "cgroup": b.cgroup,
            "cgroup_note": b.cgroup_why, "mem_available": avail}


def scenario_exact(b: Bench) -> dict:
    a = b.args
    model = b.model("exact")
    facts = H.model_facts(str(model))
    ids = b.prompt_ids(model, a.prompt_tokens)
    print(f"exact: {model.name} {facts['checkpoint_bytes'] / 1e9:.2f} GB (bf16 weights, fp32 arithmetic)", flush=True)
    ref_rec = b.run("hf", model, ids, new_tokens=a.new_tokens, cap=None, engine_memory=None, cold=False,
                    options={"dtype": "float32", "margins": True}, tag="exact-reference")
    ref = (ref_rec.get("result") or {}).get("token_ids")
    runs = []
    per_engine = {"hf": {"dtype": "bfloat16"}, "airllm": {"dtype": "float32"}, "sluice": {},
                  "llamacpp": {"kv_type": "f32"}}
    for e in engines(a):
        dtype = "f32" if e == "llamacpp" else "bf16"
        r = b.run(e, model, ids, new_tokens=a.new_tokens, cap=None, engine_memory=None, cold=False,
                  options=per_engine.get(e, {}), dtype=dtype, tag="exact")
        r.update(match(r, ref))
        r["arithmetic"] = {"hf": "bf16 (transformers in the checkpoint's dtype)", "sluice": "fp32 on bf16 weights",
                           "llamacpp": "f32 GGUF (exact upcast of the bf16 weights), f32 KV cache",
                           "airllm": "fp32 (dtype=float32)"}.get(e)
        runs.append(r)
    return {"model": str(model), "model_facts": facts, "prompt_ids": ids, "reference": ref_rec, "runs": runs}


def scenario_spine(b: Bench) -> dict:
    """The spine alone ~3x the cap: Sluice streams spine layers through two buffers and reads
    only routed experts; AirLLM streams whole layers. Page cache dropped, cgroup cap."""
    a = b.args
    model = b.model("spine")
    facts = H.model_facts(str(model))
    cap = a.cap or int(facts["spine_bytes"] / 3)
    ids = b.prompt_ids(model, a.prompt_tokens)
    print(f"spine: {model.name} {facts['checkpoint_bytes'] / 1e9:.2f} GB, spine {facts['spine_bytes'] / 1e9:.2f} GB, "
          f"cap {fmt_gib(cap)}", flush=True)
    b.wait_quiet()
    limits = H.measure_limits(sys.executable, str(model), a.threads)
    runs = []
    for e in engines(a):
        if e == "sluice" or e == "airllm":
            runs.append(b.run(e, model, ids, new_tokens=a.new_tokens, cap=cap, engine_memory=cap, tag="spine"))
    return {"model": str(model), "model_facts": facts, "prompt_ids": ids, "cap": cap, "limits": limits,
            "runs": runs}


SCENARIOS = {"spine": scenario_spine, "cold": scenario_cold, "warm": scenario_warm, "sweep": scenario_sweep,
             "exact": scenario_exact}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("scenario", choices=list(SCENARIOS) + ["all"])
    p.add_argument("--engines", default=",".join(ENGINES), help="comma-separated: " + ",".join(ENGINES))
    p.add_argument("--size", default="12GB", help="size of the cold/sweep model (default 12GB)")
    p.add_argument("--cap", type=make_model.parse_size, default=None, help="memory cap (default: from --cap-ratio)")
    p.add_argument("--cap-ratio", type=float, default=0.25, help="cold cap as a share of the model (default 0.25)")
    p.add_argument("--shares", default="0.05,0.1,0.25,0.5,1.0",
                   help="sweep: expert-cache shares of all experts (plus the floor)")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=1, help="warm: run every engine this many times, interleaved")
    p.add_argument("--timeout", type=float, default=2400, help="seconds per engine run")
    p.add_argument("--profile", action="store_true",
                   help="cold, warm: one more Sluice run under cProfile (summary in --results, not in the tables)")
    p.add_argument("--skip-reference", action="store_true", help="cold, warm: no fp32 reference run")
    p.add_argument("--quiet-load", type=float, default=None, metavar="LOAD",
                   help="before each engine run, wait until the 1-minute load average is below LOAD")
    p.add_argument("--quiet-wait", type=float, default=600, help="the longest such wait, seconds (default 600)")
    p.add_argument("--tiny", action="store_true", help="tiny models (the smoke test)")
    p.add_argument("--no-cgroup", action="store_true", help="do not enforce the cap with a cgroup")
    p.add_argument("--python", action="append", metavar="ENGINE=PATH",
                   help="interpreter for an engine ('current' = this one), instead of its venv")
    p.add_argument("--cache", default=None, help="models and conversions (default ~/.cache/sluice-bench)")
    p.add_argument("--venvs", default=None, help="where peers.py installed the peers (default: --cache)")
    p.add_argument("--results", default=str(BENCH / "results"), help="where JSON results go")
    p.add_argument("--name", default=None, help="results file name (default: the scenario)")
    args = p.parse_args(argv)
    if not H.drop_caches()[0]:
        print(f"note: {H.drop_caches()[1]}: cold runs will read from the page cache", file=sys.stderr)
    b = Bench(args)
    if b.cgroup is None:
        print(f"note: memory cap NOT enforced: {b.cgroup_why}", file=sys.stderr)
    todo = ["exact", "warm", "cold", "sweep"] if args.scenario == "all" else [args.scenario]
    for s in todo:
        data = SCENARIOS[s](b)
        b.save(args.name if args.name and len(todo) == 1 else s, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
