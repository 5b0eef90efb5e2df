"""The measuring side of the benchmarks: caps, caches, counters sampled from outside, limits.

Every engine runs as a child process (an "arm", ``benchmarks/arms/*_arm.py``) in its own
venv. The harness, never the engine, measures what is compared across engines:

- the memory cap: a cgroup memory limit the child is moved into before it starts (cgroup v1
  ``memory.limit_in_bytes`` under ``/sys/fs/cgroup/memory``, or cgroup v2 ``memory.max``),
  so page cache and mmap'd files count exactly as anonymous memory does;
- bytes read from disk: ``read_bytes`` of ``/proc/<pid>/io`` (all threads), sampled at the
  arm's phase marks (loaded, first token, end) while the process is alive;
- peak RSS: ``VmHWM`` of ``/proc/<pid>/status`` at the end, plus the cgroup's peak usage;
- timings: token timestamps taken by the arm around its engine's own generation loop.

Page caches are dropped (``/proc/sys/vm/drop_caches``) before each cold run when permitted;
the result records whether it was.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
ARMS = BENCH_DIR / "arms"

# -- the machine -----------------------------------------------------------------------------


def loadavg() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


def machine_info() -> dict:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    flags = ""
    try:
        flags = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags"))
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu, "cores": os.cpu_count(), "mem_total_bytes": mem, "kernel": platform.release(),
        "python": platform.python_version(), "avx2": " avx2" in flags, "avx512f": " avx512f" in flags,
        "avx512_bf16": " avx512_bf16" in flags,
        "loadavg": loadavg(),
    }


def mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# -- page cache and cgroups ------------------------------------------------------------------


def drop_caches() -> tuple[bool, str]:
    """sync + drop clean page cache, dentries and inodes. (ok, why not)."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True, ""
    except OSError as e:
        return False, f"cannot write /proc/sys/vm/drop_caches ({e.strerror}); needs root"


V1_ROOT = Path("/sys/fs/cgroup/memory")


def _v2_self() -> Path | None:
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                p = Path("/sys/fs/cgroup") / line[3:].lstrip("/")
                if (Path("/sys/fs/cgroup") / "cgroup.controllers").exists():
                    return p
    except OSError:
        pass
    return None


def cgroup_support() -> tuple[str | None, str]:
    """("v1" | "v2" | None, reason when None)."""
    if (V1_ROOT / "memory.limit_in_bytes").exists():
        if os.access(V1_ROOT, os.W_OK):
            return "v1", ""
        return None, f"{V1_ROOT} is not writable (needs root)"
    v2 = _v2_self()
    if v2 is not None:
        ctl = v2 / "cgroup.subtree_control"
        try:
            if "memory" in ctl.read_text().split() and os.access(v2, os.W_OK):
                return "v2", ""
        except OSError:
            pass
        return None, f"cgroup v2 at {v2}: the memory controller is not delegated to a writable group"
    return None, "no cgroup memory controller found (neither v1 at /sys/fs/cgroup/memory nor v2)"


class MemoryCap:
    """A child cgroup with a memory limit; ``enter_cmd`` moves a shell into it before exec."""

    def __init__(self, limit: int, kind: str):
        self.limit, self.kind = limit, kind
        name = f"sluice-bench-{uuid.uuid4().hex[:8]}"
        self.path = (V1_ROOT / name) if kind == "v1" else (_v2_self() / name)

    def __enter__(self):
        self.path.mkdir()
        if self.kind == "v1":
            (self.path / "memory.limit_in_bytes").write_text(str(self.limit))
            try:  # no swap on these machines; where there is, the cap should cover it too
                (self.path / "memory.memsw.limit_in_bytes").write_text(str(self.limit))
            except OSError:
                pass
        else:
            (self.path / "memory.max").write_text(str(self.limit))
            try:
                (self.path / "memory.swap.max").write_text("0")
            except OSError:
                pass
        return self

    def wrap(self, cmd: list[str]) -> list[str]:
        return ["sh", "-c", f'echo $$ > "{self.path}/cgroup.procs" && exec "$@"', "sh"] + cmd

    def stats(self) -> dict:
        def read(name):
            try:
                return int((self.path / name).read_text().split()[0])
            except (OSError, ValueError, IndexError):
                return None

        if self.kind == "v1":
            return {"limit_bytes": read("memory.limit_in_bytes"), "max_usage_bytes": read("memory.max_usage_in_bytes"),
                    "failcnt": read("memory.failcnt"), "oom_kills": self._oom_kills()}
        events = {}
        try:
            events = dict(line.split() for line in (self.path / "memory.events").read_text().splitlines())
        except OSError:
            pass
        return {"limit_bytes": read("memory.max"), "max_usage_bytes": read("memory.peak"),
                "failcnt": int(events.get("max", 0)), "oom_kills": int(events.get("oom_kill", 0))}

    def _oom_kills(self) -> int | None:
        try:
            for line in (self.path / "memory.oom_control").read_text().splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
        except OSError:
            pass
        return None

    def __exit__(self, *exc):
        for _ in range(100):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


# -- sampling a process from outside ---------------------------------------------------------


def proc_sample(pid: int) -> dict:
    out = {"t": time.perf_counter()}
    try:
        for line in Path(f"/proc/{pid}/io").read_text().splitlines():
            k, v = line.split(":")
            if k in ("read_bytes", "rchar", "write_bytes"):
                out[k] = int(v)
    except OSError:
        pass
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


@dataclass
class ArmSpec:
    engine: str
    python: str
    model: str
    ids: list[int]
    new_tokens: int
    threads: int = 2
    cap: int | None = None  # the cgroup limit (bytes), None: no cap
    engine_memory: int | None = None  # what the engine is told (its budget / max_memory basis)
    warmup: bool = False
    scratch: str | None = None
    options: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    timeout_s: float = 1800
    profile: str | None = None
    log: str | None = None


def arm_command(spec: ArmSpec) -> list[str]:
    cmd = [spec.python, str(ARMS / f"{spec.engine}_arm.py"), "--model", spec.model,
           "--ids", ",".join(map(str, spec.ids)), "--new-tokens", str(spec.new_tokens), "--threads", str(spec.threads)]
    if spec.engine_memory:
        cmd += ["--memory", str(spec.engine_memory)]
    if spec.warmup:
        cmd.append("--warmup")
    if spec.scratch:
        cmd += ["--scratch", spec.scratch]
    if spec.profile:
        cmd += ["--profile", spec.profile]
    for k, v in spec.options.items():
        cmd += ["--option", f"{k}={json.dumps(v)}"]
    return cmd


def run_arm(spec: ArmSpec, cgroup_kind: str | None = None) -> dict:
    """Run one arm to completion; returns its result plus what was sampled from outside."""
    env = dict(os.environ)
    env.update({k: str(spec.threads) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")})
    env["PYTHONUNBUFFERED"] = "1"
    # every engine gets what `import sluice` sets for itself: OpenMP waiters that sleep rather
    # than spin (on a shared machine spinning teams stall; docs/optimizations.md)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["HF_HUB_OFFLINE"] = "1"
    env.update(spec.env)
    cmd = arm_command(spec)
    cap = None
    rec: dict = {"engine": spec.engine, "cap_bytes": spec.cap, "engine_memory": spec.engine_memory,
                 "new_tokens": spec.new_tokens, "prompt_tokens": len(spec.ids), "threads": spec.threads,
                 "warmup": spec.warmup, "options": spec.options, "loadavg_before": loadavg()}
    if spec.cap is not None:
        if cgroup_kind is None:
            rec["cap_enforced"] = False
        else:
            cap = MemoryCap(spec.cap, cgroup_kind).__enter__()
            cmd = cap.wrap(cmd)
            rec["cap_enforced"] = True
    log = open(spec.log, "w") if spec.log else subprocess.DEVNULL
    marks: dict[str, dict] = {}
    result = None
    t0 = time.perf_counter()
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env, text=True,
                                start_new_session=True)
        timer = threading.Timer(spec.timeout_s, lambda: _kill(proc))
        timer.start()
        try:
            marks["start"] = proc_sample(proc.pid)
            for line in proc.stdout:
                if line.startswith("@@MARK "):
                    marks[line.split()[1]] = proc_sample(proc.pid)
                    try:
                        proc.stdin.write("ok\n")
                        proc.stdin.flush()
                    except OSError:
                        pass
                elif line.startswith("@@RESULT "):
                    result = json.loads(line[len("@@RESULT "):])
            rc = proc.wait()
        finally:
            timed_out = (not timer.is_alive() and proc.returncode not in (0,)
                         and time.perf_counter() - t0 >= spec.timeout_s)
            timer.cancel()
        rec["rc"] = rc
        rec["timed_out"] = timed_out
    finally:
        if cap is not None:
            rec["cgroup"] = cap.stats()
            cap.__exit__()
        if log is not subprocess.DEVNULL:
            log.close()
    rec["wall_s"] = time.perf_counter() - t0
    rec["loadavg_after"] = loadavg()
    rec["ok"] = result is not None and rec["rc"] == 0
    rec["result"] = result
    rec["marks"] = marks
    if not rec["ok"]:
        rec["error"] = _diagnose(rec, spec.log)
    rec.update(_derive(rec))
    return rec


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass


def _diagnose(rec: dict, log: str | None) -> str:
    tail = ""
    if log and Path(log).exists():
        tail = Path(log).read_text(errors="replace")[-1500:]
    cg = rec.get("cgroup") or {}
    if rec.get("timed_out"):
        return "timed out"
    if rec.get("rc") in (-9, 137) and (cg.get("oom_kills") or cg.get("failcnt")):
        return f"killed by the memory cap (OOM); cgroup failcnt {cg.get('failcnt')}. log tail: {tail[-300:]}"
    return f"exit status {rec.get('rc')}. log tail: {tail}"


def _derive(rec: dict) -> dict:
    """Bytes read per phase (from /proc/<pid>/io) and the headline numbers."""
    m, r = rec["marks"], rec.get("result") or {}
    out = {}

    def rb(a, b):
        if a in m and b in m and "read_bytes" in m[a] and "read_bytes" in m[b]:
            return m[b]["read_bytes"] - m[a]["read_bytes"]
        return None

    out["read_bytes_load"] = rb("start", "loaded")
    out["read_bytes_prefill"] = rb("loaded", "first_token")
    out["read_bytes_decode"] = rb("first_token", "end")
    out["read_bytes_total"] = rb("start", "end")
    n = r.get("generated_tokens") or 0
    dec = out["read_bytes_decode"]
    out["read_bytes_per_decode_token"] = dec / (n - 1) if dec is not None and n > 1 else None
    end = m.get("end", {})
    out["peak_rss_bytes"] = end.get("VmHWM")
    out["decode_tok_s"] = r.get("decode_tok_s")
    out["prefill_tok_s"] = r.get("prefill_tok_s")
    out["ttft_s"] = r.get("ttft_s")
    out["load_s"] = (m["loaded"]["t"] - m["start"]["t"]) if "loaded" in m and "start" in m else None
    # decode-phase read rate (bytes/s over the steady and first decode steps alike)
    if "first_token" in m and "end" in m and dec is not None:
        dt = m["end"]["t"] - m["first_token"]["t"]
        out["decode_read_bytes_per_s"] = dec / dt if dt > 0 else None
    return out


# -- the physical limits ---------------------------------------------------------------------

LIMITS_SCRIPT = r"""
import json, os, sys, time, mmap
sys.path.insert(0, sys.argv[1])
import sluice  # before torch: OpenMP wait policy
import torch
from types import SimpleNamespace
from sluice.bench import raw_read_bandwidth
from sluice.engine import ModelInfo
model, threads, seconds = sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
out = {}
# random expert-record reads through Sluice's own read path (O_DIRECT where it works), 4 threads,
# without loading a model: what raw_read_bandwidth needs from an engine
info = ModelInfo(model)
eng = SimpleNamespace(experts_source=info.experts, desc=info.desc, checkpoint=info.checkpoint,
                      options=SimpleNamespace(reader_threads=4, huge_pages=True))
out["direct_read"] = raw_read_bandwidth(eng, seconds)
# buffered sequential reads of the model's files, 8 MiB at a time (what mmap/readahead engines do best)
files = sorted(p for p in os.listdir(model) if p.endswith(".safetensors"))
buf = bytearray(8 << 20); n = 0; t0 = time.perf_counter()
for name in files:
    with open(os.path.join(model, name), "rb", buffering=0) as f:
        while time.perf_counter() - t0 < seconds:
            k = f.readinto(buf)
            if not k:
                break
            n += k
    if time.perf_counter() - t0 >= seconds:
        break
dt = time.perf_counter() - t0
out["buffered_sequential_read"] = {"bytes_per_s": n / dt, "bytes": n, "seconds": dt, "chunk_bytes": len(buf)}
# memory read bandwidth: sum over a 1 GiB tensor (more than any cache), best of 5
torch.set_num_threads(threads)
a = torch.ones(256 << 20, dtype=torch.float32)
best = 0.0
for _ in range(5):
    t = time.perf_counter(); a.sum(); dt = time.perf_counter() - t
    best = max(best, a.numel() * 4 / dt)
out["memory_read"] = {"bytes_per_s": best, "bytes": a.numel() * 4, "threads": threads, "op": "fp32 sum, best of 5"}
print("@@LIMITS " + json.dumps(out))
"""


def measure_limits(python: str, model: str, threads: int = 2, seconds: float = 4.0) -> dict:
    ok, why = drop_caches()
    proc = subprocess.run([python, "-c", LIMITS_SCRIPT, str(REPO / "src"), model, str(threads), str(seconds)],
                          capture_output=True, text=True, timeout=600)
    for line in proc.stdout.splitlines():
        if line.startswith("@@LIMITS "):
            out = json.loads(line[len("@@LIMITS "):])
            out["page_cache_dropped"] = ok
            out["loadavg"] = loadavg()
            return out
    raise RuntimeError(f"limits measurement failed: {proc.stderr[-2000:]}")


def model_facts(model: str) -> dict:
    """What a token needs, from Sluice's own description of the checkpoint (engine-independent)."""
    sys.path.insert(0, str(REPO / "src"))
    from sluice.engine import ModelInfo

    info = ModelInfo(model)
    d = info.desc
    spine_total = sum(info.checkpoint.info(n).nbytes for n in d.spine)
    embed = sum(info.checkpoint.info(n).nbytes for n in d.spine if "embed_tokens" in n)
    row = embed // max(d.vocab, 1)
    expert = info.experts.record_bytes
    files = [p for p in Path(model).iterdir() if p.suffix == ".safetensors"]
    out = {
        "model_type": d.model_type, "layers": d.n_layers, "moe_layers": len(d.moe_layers),
        "experts_per_layer": d.n_experts, "top_k": d.top_k, "expert_bytes": expert,
        "experts_total": d.total_experts, "working_set_experts": d.working_set,
        "expert_bytes_per_token": d.working_set * expert,
        "spine_bytes": spine_total,
        # touched per decoded token when everything is in RAM: the spine minus the embedding
        # table (one row of it) plus the top-k experts of every MoE layer
        "bytes_touched_per_token": spine_total - embed + row + d.working_set * expert,
        "checkpoint_bytes": sum(p.stat().st_size for p in files),
        "dtype": json.loads((Path(model) / "config.json").read_text()).get("dtype"),
    }
    info.checkpoint.close()
    return out


def dir_bytes(path: str | Path) -> int:
    p = Path(path)
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def which(name: str) -> str | None:
    return shutil.which(name)
