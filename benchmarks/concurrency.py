"""Concurrent streaming clients against ``sluice serve --parallel`` and ``llama-server --parallel``.

    python benchmarks/concurrency.py demo --clients 1,2,4,8 --max-tokens 48 \\
        --json benchmarks/results/concurrency-demo.json
    # side by side with llama.cpp's server (a llama.cpp tree built with cmake, see
    # benchmarks/llamacpp.py; the model is converted to GGUF at its own precision once)
    python benchmarks/concurrency.py MODEL --llama-cpp DIR --reps 3 [--cap 4GiB] -- --memory 3GiB

Starts ``sluice serve MODEL --parallel P`` (P: the largest client count unless ``--parallel``)
with ``--trace-routing`` and, with ``--llama-cpp`` (or ``$SLUICE_LLAMA_CPP``), ``llama-server
--parallel P`` (continuous batching, its default) on the same model converted to GGUF at the
same precision (f32 stays f32, bf16 stays bf16), with an f32 KV cache as Sluice keeps and the
same thread count and the same ``OMP_WAIT_POLICY`` (PASSIVE unless set: both use OpenMP threads,
and spinning ones collapse on a shared machine). Both servers stay up; for each client count N
and repeat the engines run in
turn (the order alternating), N streaming completions at once (asyncio tasks in this process,
the official ``openai`` client, a different prompt each, greedy, ``ignore_eos``). Every engine
gets the same prompt token ids (the chat template rendered by the model's tokenizer where it
has one), sent to ``/v1/completions`` as a list of ids. Reported per engine and N (medians
over the repeats):

- aggregate tokens/s (all tokens / wall time) and per-request decode tokens/s (tokens after the
  first / time after the first), time to first token p50/p95;
- bytes read from disk per generated token (``read_bytes`` of ``/proc/<pid>/io`` of the server:
  O_DIRECT, buffered and mmap faults alike) and, for Sluice, the expert bytes its engine read
  (``sluice_engine_bytes_read_total``) and the mean batch (sequences per engine step);
- whether every request's text equals its solo run (each prompt is first run alone);
- the bound on the disk-bound gain, N x k / E[union]: from the routing Sluice's solo runs
  recorded (one decode token per trace record), the union of the N prompts' experts at the
  same decode step, per MoE layer, averaged; k is the model's experts per token.

``--cap SIZE`` runs each server in its own cgroup with that memory limit (cgroup v1 or v2, as
``benchmarks/harness.py`` finds; needs root) after dropping the page cache: llama.cpp
memory-maps the GGUF, so without a cap the page cache would hold the whole model and the run
would not be disk-bound for it (Sluice reads with O_DIRECT; give it ``--memory`` after ``--``).
Extra arguments after ``--`` go to ``sluice serve`` (``--memory``, ``--cache-experts``, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import sluice  # (before transformers imports torch: it sets OpenMP's wait policy)

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent / "tests"))
from serve_process import free_port, wait_for  # noqa: E402

TOPICS = ["the history of tea", "how a bicycle gear works", "why the sky is blue", "a recipe for bread",
          "the rules of chess", "how vaccines work", "the water cycle", "a short story about a fox",
          "how to tie a bowline knot", "the planets of the solar system", "how compilers work", "a haiku about rain",
          "the causes of tides", "how bees make honey", "the life of a star", "how a piano makes sound"]


def model_path(model: str) -> Path:
    if model == "demo":
        return Path(sluice.__file__).resolve().parent / "demo_model"
    return Path(model).expanduser().resolve()


def prompt_ids(model: Path, n: int) -> list[list[int]]:
    """The benchmark prompts as token ids: the chat template rendered where the model has one."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    out = []
    for i in range(n):
        text = f"Tell me about {TOPICS[i % len(TOPICS)]}."
        if getattr(tok, "chat_template", None):
            ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                          tokenize=True)
            ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        else:
            ids = tok.encode(text, add_special_tokens=False)
        out.append([int(x) for x in ids])
    return out


def proc_read_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


class Server:
    """One server process (optionally in its own memory cgroup), up until ``stop``."""

    def __init__(self, name: str, cmd: list[str], port: int, cap: int | None, env: dict | None = None,
                 timeout: float = 1800):
        import harness as H

        self.name, self.cmd, self.url = name, cmd, f"http://127.0.0.1:{port}"
        self.cgroup = None
        if cap:
            kind, why = H.cgroup_support()
            if kind is None:
                raise SystemExit(f"--cap: {why}")
            H.drop_caches()
            self.cgroup = H.MemoryCap(cap, kind).__enter__()
            cmd = self.cgroup.wrap(cmd)
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"{name}-", suffix=".log", delete=False)
        t0 = time.perf_counter()
        if env is None:
            # both servers wait for work the same way: OpenMP threads sleep instead of spinning
            # (what `import sluice` sets, and what benchmarks/harness.py gives every engine);
            # llama.cpp's threads are OpenMP threads too, and spinning ones collapse on a shared machine
            env = dict(os.environ)
            env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        self.omp_wait_policy = env.get("OMP_WAIT_POLICY")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)

        def up():
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"{name} exited with {self.proc.returncode}: {self.log.read()[-3000:]}")
            try:
                return httpx.get(self.url + "/health", timeout=5).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(up, timeout=timeout, what=f"{name} to answer", interval=0.2)
        self.start_s = time.perf_counter() - t0

    @property
    def pid(self) -> int:
        return self.proc.pid

    def read_bytes(self) -> int | None:
        return proc_read_bytes(self.proc.pid)

    def stop(self) -> dict:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
        self.log.close()
        os.unlink(self.log.name)  # kept only when the server failed to start (named in that error)
        out = {}
        if self.cgroup is not None:
            out = self.cgroup.stats()
            self.cgroup.__exit__(None, None, None)
        return out


async def one(client, model: str, prompt: list[int], max_tokens: int) -> dict:
    t0 = time.perf_counter()
    first = None
    text, usage = [], None
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text is not None:
            if first is None:
                first = time.perf_counter()
            text.append(chunk.choices[0].text)
        if getattr(chunk, "usage", None):
            usage = chunk.usage.completion_tokens
    end = time.perf_counter()
    n = usage if usage is not None else max_tokens  # ignore_eos: every request runs to max_tokens
    return {"ttft_s": (first or end) - t0, "tokens": n, "text": "".join(text), "total_s": end - t0,
            "decode_tok_s": (n - 1) / (end - first) if first is not None and n > 1 and end > first else 0.0}


async def round_of(url: str, model: str, prompts: list[list[int]], max_tokens: int) -> tuple[list[dict], float]:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=7200)
    t0 = time.perf_counter()
    res = await asyncio.gather(*(one(client, model, p, max_tokens) for p in prompts))
    wall = time.perf_counter() - t0
    await client.close()
    return res, wall


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def union_bound(routes: list[list[list[list[int]]]], n: int, k: int) -> float | None:
    """N x k / E[union]: ``routes[p][t][layer]`` the experts of prompt p's t-th decode token."""
    if len(routes) < n or n < 1:
        return None
    steps = min(len(r) for r in routes[:n])
    sizes = []
    for t in range(steps):
        for layer in range(len(routes[0][t])):
            sizes.append(len(set().union(*(set(routes[p][t][layer]) for p in range(n)))))
    return n * k / statistics.fmean(sizes) if sizes else None


def measure(srv: Server, model_id: str, prompts: list[list[int]], max_tokens: int, solo: list[dict] | None,
            is_sluice: bool) -> dict:
    m0 = metrics(srv.url) if is_sluice else {}
    rb0 = srv.read_bytes()
    load0 = os.getloadavg()[0]
    res, wall = asyncio.run(round_of(srv.url, model_id, prompts, max_tokens))
    rb1 = srv.read_bytes()
    tokens = sum(r["tokens"] for r in res)
    row = {"wall_s": wall, "tokens": tokens, "aggregate_tok_s": tokens / wall,
           "per_request_decode_tok_s": statistics.fmean(r["decode_tok_s"] for r in res),
           "ttft_p50_s": pct([r["ttft_s"] for r in res], 0.5), "ttft_p95_s": pct([r["ttft_s"] for r in res], 0.95),
           "disk_bytes_per_token": (rb1 - rb0) / tokens if rb0 is not None and rb1 is not None and tokens else None,
           "identical_to_solo": (all(r["text"] == solo[i]["text"] for i, r in enumerate(res))
                                 if solo is not None else None),
           "load1": [load0, os.getloadavg()[0]]}
    if is_sluice:
        m1 = metrics(srv.url)
        generated = m1["sluice_generated_tokens_total"] - m0["sluice_generated_tokens_total"]
        steps = m1["sluice_engine_steps_total"] - m0["sluice_engine_steps_total"]
        stepped = m1["sluice_batched_sequences_total"] - m0["sluice_batched_sequences_total"]
        row["expert_bytes_per_token"] = ((m1["sluice_engine_bytes_read_total"] - m0["sluice_engine_bytes_read_total"])
                                         / generated if generated else None)
        row["mean_batch"] = stepped / steps if steps else None
    return row


def summarize(runs: list[dict]) -> dict:
    med = lambda key: (statistics.median(r[key] for r in runs)  # noqa: E731
                       if runs and all(r.get(key) is not None for r in runs) else None)
    out = {k: med(k) for k in ("aggregate_tok_s", "per_request_decode_tok_s", "ttft_p50_s", "ttft_p95_s",
                               "disk_bytes_per_token", "expert_bytes_per_token", "mean_batch")}
    same = [r["identical_to_solo"] for r in runs]
    out["identical_to_solo"] = None if any(s is None for s in same) else all(same)
    out["each_aggregate_tok_s"] = [r["aggregate_tok_s"] for r in runs]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a model directory, or 'demo'")
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--parallel", type=int, default=None)
    ap.add_argument("--reps", type=int, default=1, help="repeats of every (engine, N) round, alternating engines")
    ap.add_argument("--threads", type=int, default=None, help="compute threads of both servers (default: cores)")
    ap.add_argument("--cap", default=None, help="memory cgroup limit for each server, e.g. 4GiB (needs root)")
    ap.add_argument("--llama-cpp", default=None, metavar="DIR",
                    help="llama.cpp tree built with cmake (default $SLUICE_LLAMA_CPP; none: Sluice alone)")
    ap.add_argument("--gguf", default=None, help="the model as GGUF (default: converted once and cached)")
    ap.add_argument("--llama-kv", default="f32", choices=["f32", "f16"], help="llama.cpp's KV cache type")
    ap.add_argument("--llama-args", default="", help="more llama-server arguments, one string (e.g. '--poll 0')")
    ap.add_argument("--no-llama-solo", action="store_true", help="skip llama.cpp's solo runs (its 'same' column)")
    ap.add_argument("--json", default=None)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    a = ap.parse_args(argv[:cut])
    extra = argv[cut + 1 :]  # arguments for sluice serve
    counts = [int(c) for c in a.clients.split(",")]
    parallel = a.parallel or max(counts)
    threads = a.threads or os.cpu_count() or 2
    path = model_path(a.model)
    prompts = prompt_ids(path, max(counts))
    cap = None
    if a.cap:
        from sluice.units import parse_size

        cap = int(parse_size(a.cap))
    use_llama = bool(a.llama_cpp or os.environ.get("SLUICE_LLAMA_CPP"))
    gguf = None
    if use_llama:
        import llamacpp

        gguf = Path(a.gguf) if a.gguf else llamacpp.gguf(path, a.llama_cpp)
    ctx = max(len(p) for p in prompts) + a.max_tokens + 16
    tmp = tempfile.TemporaryDirectory()
    trace = Path(tmp.name) / "routing.jsonl"
    servers: dict[str, Server] = {}
    info: dict = {"sluice": {}, "llamacpp": {}}
    loads = [os.getloadavg()[0]]
    results: dict[str, dict[int, list[dict]]] = {}
    try:
        servers["sluice"] = Server("sluice", [sys.executable, "-m", "sluice.cli", "serve", str(path), "--port",
                                              str(port := free_port()), "--parallel", str(parallel),
                                              "--trace-routing", str(trace), "--no-progress", "--threads",
                                              str(threads), *extra], port, cap)
        info["sluice"] = {"start_s": servers["sluice"].start_s, "args": extra,
                          "omp_wait_policy": servers["sluice"].omp_wait_policy,
                          "health": httpx.get(servers["sluice"].url + "/health", timeout=30).json()}
        if use_llama:
            server_bin = llamacpp.binary("llama-server", a.llama_cpp)
            cmd = [str(server_bin), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port := free_port()),
                   "--parallel", str(parallel), "--ctx-size", str(ctx * parallel), "--threads", str(threads),
                   "--threads-batch", str(threads), "--cache-type-k", a.llama_kv, "--cache-type-v", a.llama_kv,
                   "--batch-size", "512", "--ubatch-size", "512", *a.llama_args.split()]
            servers["llamacpp"] = Server("llama-server", cmd, port, cap)
            info["llamacpp"] = {"start_s": servers["llamacpp"].start_s, "version": llamacpp.version(a.llama_cpp),
                                "omp_wait_policy": servers["llamacpp"].omp_wait_policy,
                                "gguf": gguf.name, "gguf_bytes": gguf.stat().st_size,
                                "args": [c for c in cmd[1:] if c not in (str(gguf),)]}
        model_id = {"sluice": httpx.get(servers["sluice"].url + "/v1/models", timeout=30).json()["data"][0]["id"],
                    "llamacpp": "model"}
        # each prompt alone, first: the reference texts and (Sluice) each one's routing
        solo: dict[str, list[dict] | None] = {}
        routes = []
        for name, srv in servers.items():
            if name == "llamacpp" and a.no_llama_solo:
                solo[name] = None
                continue
            solo[name] = []
            for p in prompts:
                before = trace.read_text().count("\n") if trace.exists() else 0
                res, _ = asyncio.run(round_of(srv.url, model_id[name], [p], a.max_tokens))
                solo[name].append(res[0])
                if name == "sluice":
                    lines = trace.read_text().splitlines()[before:]
                    routes.append([json.loads(x)["layers"] for x in lines])
            print(f"{name}: solo runs done", flush=True)
        if solo.get("llamacpp"):  # a sanity check that both compute the same model (not required to hold)
            info["llamacpp"]["solo_texts_equal_to_sluice"] = sum(
                x["text"] == y["text"] for x, y in zip(solo["sluice"], solo["llamacpp"]))
        k = len(routes[0][0][0]) if routes and routes[0] else 0
        names = list(servers)
        for rep in range(a.reps):
            for i, n in enumerate(counts):
                order = names if (rep + i) % 2 == 0 else names[::-1]
                for name in order:
                    row = measure(servers[name], model_id[name], prompts[:n], a.max_tokens, solo[name],
                                  name == "sluice")
                    results.setdefault(name, {}).setdefault(n, []).append(row)
                    loads.append(os.getloadavg()[0])
                    print(json.dumps({"engine": name, "clients": n, "rep": rep,
                                      **{kk: v for kk, v in row.items()}}), flush=True)
    finally:
        for name, srv in servers.items():
            info[name]["cgroup"] = srv.stop()
        tmp.cleanup()
    rows = []
    for name, per_n in results.items():
        base = summarize(per_n[counts[0]])["aggregate_tok_s"] if counts[0] == 1 else None
        for n, runs in per_n.items():
            s = summarize(runs)
            s.update(engine=name, clients=n, union_bound=union_bound(routes, n, k))
            s["gain"] = s["aggregate_tok_s"] / base if base else None
            s["gain_over_bound"] = s["gain"] / s["union_bound"] if s["gain"] and s["union_bound"] else None
            rows.append(s)
    print(f"\n{'engine':>9} {'clients':>7} {'agg tok/s':>10} {'gain':>6} {'bound':>6} {'g/bnd':>6} {'req tok/s':>10} "
          f"{'TTFT p50':>9} {'TTFT p95':>9} {'batch':>6} {'expert/tok':>10} {'disk/tok':>10} same")
    mb = lambda v: f"{v / 1e6:8.2f}MB" if v is not None else f"{'-':>10}"  # noqa: E731
    for r in rows:
        f = lambda v, w=6, d=2: f"{v:>{w}.{d}f}" if v is not None else f"{'-':>{w}}"  # noqa: E731
        print(f"{r['engine']:>9} {r['clients']:>7} {f(r['aggregate_tok_s'], 10)} {f(r['gain'])} {f(r['union_bound'])} "
              f"{f(r['gain_over_bound'])} {f(r['per_request_decode_tok_s'], 10)} {f(r['ttft_p50_s'], 9, 3)} "
              f"{f(r['ttft_p95_s'], 9, 3)} {f(r.get('mean_batch'))} {mb(r.get('expert_bytes_per_token'))} "
              f"{mb(r.get('disk_bytes_per_token'))} {r['identical_to_solo']}")
    if "llamacpp" in results:
        for n in counts:
            s = next(r for r in rows if r["engine"] == "sluice" and r["clients"] == n)
            q = next(r for r in rows if r["engine"] == "llamacpp" and r["clients"] == n)
            print(f"clients {n}: Sluice / llama.cpp aggregate {s['aggregate_tok_s'] / q['aggregate_tok_s']:.2f}x")
    if "solo_texts_equal_to_sluice" in info["llamacpp"]:
        print(f"llama.cpp's solo texts equal to Sluice's: {info['llamacpp']['solo_texts_equal_to_sluice']} of "
              f"{len(prompts)}")
    print(f"1-minute load average {min(loads):.1f}-{max(loads):.1f}")
    if a.json:
        Path(a.json).write_text(json.dumps({
            "model": a.model if a.model == "demo" else path.name, "parallel": parallel, "max_tokens": a.max_tokens,
            "reps": a.reps, "threads": threads,
            "cap_bytes": cap, "prompt_tokens": [len(p) for p in prompts], "top_k": k, "engines": info,
            "load1": loads, "rows": rows,
            "runs": {name: {str(n): runs for n, runs in per_n.items()} for name, per_n in results.items()},
        }, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
