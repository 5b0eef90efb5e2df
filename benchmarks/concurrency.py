"""Concurrent streaming clients against ``sluice serve --parallel``: throughput, latency, bytes.

    python benchmarks/concurrency.py demo --clients 1,2,4,8 --max-tokens 48 \\
        --json benchmarks/results/concurrency-demo.json

Starts ``sluice serve MODEL --parallel P`` (P: the largest client count unless ``--parallel``)
with ``--trace-routing``, then for each client count N runs N streaming chat requests at once
(asyncio tasks in this process, the official ``openai`` client, a different prompt each, greedy)
and reports:

- aggregate tokens/s (all tokens / wall time) and per-request decode tokens/s (tokens after the
  first / time after the first), time to first token p50/p95;
- bytes the engine read per generated token (``sluice_engine_bytes_read_total`` of /metrics);
- the mean batch size (``sluice_batched_sequences_total`` / ``sluice_engine_steps_total``);
- whether every request's text equals its solo run (N=1 runs each prompt alone first);
- the bound on the disk-bound gain, N x k / E[union]: from the routing the N=1 runs recorded
  (one decode token per trace record), the union of the N prompts' experts at the same decode
  step, per MoE layer, averaged; k is the model's experts per token.

Extra arguments after ``--`` go to ``sluice serve`` (``--memory``, ``--cache-experts``, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from serve_process import spawn_serve  # noqa: E402

TOPICS = ["the history of tea", "how a bicycle gear works", "why the sky is blue", "a recipe for bread",
          "the rules of chess", "how vaccines work", "the water cycle", "a short story about a fox",
          "how to tie a bowline knot", "the planets of the solar system", "how compilers work", "a haiku about rain",
          "the causes of tides", "how bees make honey", "the life of a star", "how a piano makes sound"]


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


async def one(client, model: str, prompt: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    first = None
    text, n = [], 0
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
        stream=True, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content is not None:
            if first is None:
                first = time.perf_counter()
            text.append(chunk.choices[0].delta.content)
            n += 1
    end = time.perf_counter()
    return {"ttft_s": (first or end) - t0, "chunks": n, "text": "".join(text), "total_s": end - t0,
            "decode_tok_s": (n - 1) / (end - first) if first is not None and n > 1 and end > first else 0.0}


async def round_of(url: str, model: str, prompts: list[str], max_tokens: int) -> tuple[list[dict], float]:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--parallel", type=int, default=None)
    ap.add_argument("--json", default=None)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    a = ap.parse_args(argv[:cut])
    extra = argv[cut + 1 :]  # arguments for sluice serve
    counts = [int(c) for c in a.clients.split(",")]
    parallel = a.parallel or max(counts)
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "routing.jsonl"
        proc, url = spawn_serve(a.model, "--parallel", str(parallel), "--trace-routing", str(trace), "--no-progress",
                                *extra, stdout=None, timeout=600)
        try:
            model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
            prompts = [f"Tell me about {TOPICS[i % len(TOPICS)]}." for i in range(max(counts))]
            # each prompt alone, first: the reference texts, and each one's routing (trace records)
            solo, routes = [], []
            for p in prompts:
                before = trace.read_text().count("\n") if trace.exists() else 0
                res, _ = asyncio.run(round_of(url, model, [p], a.max_tokens))
                solo.append(res[0])
                lines = trace.read_text().splitlines()[before:]
                routes.append([json.loads(x)["layers"] for x in lines])
            info = httpx.get(url + "/health", timeout=30).json()
            rows = []
            for n in counts:
                m0 = metrics(url)
                res, wall = asyncio.run(round_of(url, model, prompts[:n], a.max_tokens))
                m1 = metrics(url)
                tokens = sum(r["chunks"] for r in res)
                generated = m1["sluice_generated_tokens_total"] - m0["sluice_generated_tokens_total"]
                steps = m1["sluice_engine_steps_total"] - m0["sluice_engine_steps_total"]
                stepped = m1["sluice_batched_sequences_total"] - m0["sluice_batched_sequences_total"]
                k = len(routes[0][0][0]) if routes and routes[0] else 0
                rows.append({
                    "clients": n, "wall_s": wall, "aggregate_tok_s": tokens / wall,
                    "per_request_decode_tok_s": statistics.fmean(r["decode_tok_s"] for r in res),
                    "ttft_p50_s": pct([r["ttft_s"] for r in res], 0.5),
                    "ttft_p95_s": pct([r["ttft_s"] for r in res], 0.95),
                    "bytes_per_token": ((m1["sluice_engine_bytes_read_total"] - m0["sluice_engine_bytes_read_total"])
                                        / generated if generated else None),
                    "mean_batch": stepped / steps if steps else None,
                    "identical_to_solo": all(r["text"] == solo[i]["text"] for i, r in enumerate(res)),
                    "union_bound": union_bound(routes, n, k),
                })
                print(json.dumps(rows[-1]), flush=True)
        finally:
            proc.terminate()
            proc.wait(60)
    base = rows[0]["aggregate_tok_s"] if rows and rows[0]["clients"] == 1 else None
    print(f"\n{'clients':>7} {'agg tok/s':>10} {'gain':>6} {'bound':>6} {'req tok/s':>10} {'TTFT p50':>9} "
          f"{'TTFT p95':>9} {'batch':>6} {'bytes/tok':>10} same")
    for r in rows:
        gain = r["aggregate_tok_s"] / base if base else float("nan")
        bound = r["union_bound"] or float("nan")
        bpt = r["bytes_per_token"] or 0
        print(f"{r['clients']:>7} {r['aggregate_tok_s']:>10.2f} {gain:>6.2f} {bound:>6.2f} "
              f"{r['per_request_decode_tok_s']:>10.2f} {r['ttft_p50_s']:>9.3f} {r['ttft_p95_s']:>9.3f} "
              f"{(r['mean_batch'] or 0):>6.2f} {bpt / 1e6:>8.2f}MB {r['identical_to_solo']}")
    if a.json:
        Path(a.json).write_text(json.dumps({"model": a.model, "parallel": parallel, "max_tokens": a.max_tokens,
                                            "serve_args": extra, "health": info, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
