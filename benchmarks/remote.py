"""Decode speed of a model read from S3 and HTTP through a slow link, against that link's roofline.

    PYTHONPATH=src python benchmarks/remote.py --json benchmarks/results/remote.json
    # the warm disk-tier rows too (needs the --disk-cache option in this build)
    PYTHONPATH=src python benchmarks/remote.py --disk-cache 2GB --json benchmarks/results/remote.json

Starts on loopback the servers of ``tests/remote_servers.py`` (the ``moto`` S3 server, nginx
with HTTP Range) and, per scenario, the tests' fault proxy in front of one of them with a link
limit and added latency (the proxy adds the latency before each response's first byte and
shares the rate among all connections), in a child process of its own (``--proxy-thread``: in
a thread of this process, as in the tests). Scenarios (``--scenarios``):

- ``s3-100``: S3 (moto) at 100 MB/s with 20 ms added latency;
- ``http-100``: HTTP (nginx) at 100 MB/s with 20 ms;
- ``http-1000``: HTTP (nginx) at 1 GB/s with 20 ms.

The model: a synthetic Hugging Face checkpoint (``sluice.synthetic`` via ``make_model.py``;
default a Qwen3-MoE shape with 8 layers of 16 experts of 3.1 MB, top-4, ~550 MB) written
once under ``--models``. Each run is **cold**: a new engine (empty expert cache, a fixed small
``--cache-experts`` so that most expert lookups miss), the prompt prefilled, then ``--tokens``
greedy tokens; decode tok/s and bytes fetched per token are taken between the first and the
last generated token (the first decode step is excluded, as in ``GenerationStats``).

The roofline of a scenario is ``min(link rate, the server's own ceiling, the proxied path's
ceiling) / bytes a token needs``, all measured in the same run: the server's ceiling is plain
``http.client`` range reads of one expert record each, 16 in flight, straight at the server;
the path's ceiling the same reads through the proxy (latency and rate applied); the bytes a
token needs are the local-disk run's bytes read per decode token with the same cache (the
remote run's own bytes fetched per token are reported beside it). Beside it, the serial bound
``1 / (bytes per token / link + MoE layers x latency + compute)``: without speculation a
layer's reads can start only once its router has run, so every MoE layer pays one round trip,
and compute (the all-in-memory row's seconds per token) does not overlap the link. Local-disk rows (the same
cold runs from the local directory) and an all-in-memory row (every expert cached: the
compute-only speed on this machine) are measured for comparison; medians of ``--repeats``.

Warm disk tier: with ``--disk-cache SIZE``, and when this build's ``load()`` has the
``disk_cache`` option, each remote scenario is also run with the tier filled by one earlier
run (memory cache cold, disk tier warm), each run paired with a local-disk run just before it
(the load of a shared machine drifts between minutes): the ratio is the median of the pairs'
ratios. Without the option the rows are skipped with a message saying so.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
import http.client
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
for p in (ROOT / "src", ROOT / "tests", BENCH):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import sluice  # noqa: E402  (first: it sets OpenMP's wait policy before torch loads)
from remote_servers import (ACCESS_KEY, CLIENT_ENV, HOST, REGION, SECRET_KEY, FaultProxy, NginxServer,  # noqa: E402
                            ProxyProcess, RemoteServers, S3Server)

MB = 1e6
SCENARIOS = {  # name: (server, link bytes/s, added latency s)
    "s3-100": ("s3", 100e6, 0.020),
    "http-100": ("http", 100e6, 0.020),
    "http-1000": ("http", 1000e6, 0.020),
}
NAME = "bench-model"


def make_model(models: Path, layers: int, experts: int, shard_mb: int) -> Path:
    """The synthetic checkpoint (bf16, ``std`` 0.2 as every benchmark model), in ``shard_mb`` shards."""
    import torch
    from make_model import config_for

    from sluice.synthetic import write_model

    out = models / f"remote-qwen3moe-{layers}x{experts}-{shard_mb}mb"
    cfg = config_for("qwen3_moe", None, torch.bfloat16, {"num_hidden_layers": layers}, experts)
    stamp = {"config": cfg, "dtype": "bf16", "std": 0.2, "seed": 0, "shard_mb": shard_mb}
    stamp_path = out / "bench_model.json"
    if not (stamp_path.exists() and json.loads(stamp_path.read_text()) == stamp):
        write_model(out, cfg, dtype=torch.bfloat16, std=0.2, shard_bytes=shard_mb << 20, progress=False)
        stamp_path.write_text(json.dumps(stamp, indent=2))
    return out


def decode_run(location: str, prompt: list[int], tokens: int, **options) -> dict:
    """One cold run: a fresh engine, the prompt, ``tokens`` greedy tokens (no speculation)."""
    t0 = time.perf_counter()
    eng = sluice.load(location, memory="8GiB", progress=False, **options)
    load_s = time.perf_counter() - t0
    try:
        return measure(eng, prompt, tokens) | {"load_s": load_s, "direct_io": eng.checkpoint.direct_io}
    finally:
        eng.close()


def measure(eng, prompt: list[int], tokens: int) -> dict:
    stats = eng.checkpoint.stats
    marks = []
    for _step in eng.stream(prompt, max_new_tokens=tokens, ignore_eos=True, speculate=False):
        marks.append((time.perf_counter(), stats.bytes_read, stats.reads))
    (t1, b1, r1), (t2, b2, r2) = marks[1], marks[-1]  # from the end of the first decode step
    n = len(marks) - 2
    c = eng.experts.counters
    out = {"decode_tok_s": n / (t2 - t1), "bytes_per_token": (b2 - b1) / n, "reads_per_token": (r2 - r1) / n,
           "hit_rate": c.hits / max(1, c.lookups), "prefetch_reads": c.prefetch_reads,
           "read_wait_s": c.read_wait_s, "compute_s": c.compute_s, "tokens": n}
    last = eng.last_stats  # the whole generation's; the disk tier's counters where the build has them
    out.update({k: last[k] for k in ("disk_tier_hits", "disk_tier_misses", "disk_tier_bytes_read") if k in last})
    return out


def server_ceiling(port: int, path: str, file_size: int, record: int, nbytes: float, inflight: int = 16,
                   seed: int = 0, s3: bool = False) -> float:
    """Bytes/s of ``record``-sized range reads at random offsets, ``inflight`` at a time: plain
    ``http.client`` keep-alive connections, one per thread, ``readinto`` a preallocated buffer.
    ``s3``: requests signed with SigV4 (botocore's signer; moto refuses unsigned GETs of objects
    put in one part)."""
    rng = random.Random(seed)
    count = max(inflight, int(nbytes // record))
    offsets = iter([rng.randrange(0, file_size - record) for _ in range(count)])
    lock = threading.Lock()

    def headers(off: int) -> dict:
        h = {"Range": f"bytes={off}-{off + record - 1}"}
        if not s3:
            return h
        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest
        from botocore.credentials import Credentials

        req = AWSRequest(method="GET", url=f"http://{HOST}:{port}{path}", headers=h)
        S3SigV4Auth(Credentials(ACCESS_KEY, SECRET_KEY), "s3", REGION).add_auth(req)
        return dict(req.headers.items())

    def worker():
        buf = memoryview(bytearray(record))
        conn = http.client.HTTPConnection(HOST, port)
        while True:
            with lock:
                off = next(offsets, None)
            if off is None:
                break
            conn.request("GET", path, headers=headers(off))
            resp = conn.getresponse()
            if resp.status != 206:
                raise RuntimeError(f"ceiling reader: HTTP {resp.status} for {path} {resp.read()[:300]!r}")
            got = 0
            while got < record:
                n = resp.readinto(buf[got:])
                if not n:
                    raise RuntimeError("ceiling reader: short body")
                got += n
            resp.read()
        conn.close()

    t0 = time.perf_counter()
    with ThreadPoolExecutor(inflight) as ex:
        for f in [ex.submit(worker) for _ in range(inflight)]:
            f.result()
    return count * record / (time.perf_counter() - t0)


def median_of(runs: list[dict]) -> dict:
    out = {k: statistics.median(r[k] for r in runs) for k in runs[0] if isinstance(runs[0][k], (int, float))
           and not isinstance(runs[0][k], bool)}
    out["runs"] = runs
    return out


def has_disk_cache() -> bool:
    from sluice.engine import Options

    return "disk_cache" in {f.name for f in dataclasses.fields(Options)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=os.path.expanduser("~/.cache/sluice-bench/models"))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--shard-mb", type=int, default=8,
                    help="safetensors shard size (moto copies a whole object per ranged GET: small shards)")
    ap.add_argument("--cache-experts", type=int, default=32, help="expert cache slots (cold runs)")
    ap.add_argument("--reader-threads", type=int, default=4)
    ap.add_argument("--cache-policy", default=None, help="expert cache policy (default: the engine's)")
    ap.add_argument("--prompt", type=int, default=8, help="prompt tokens")
    ap.add_argument("--tokens", type=int, default=12, help="generated tokens per run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--disk-cache", default=None, help="also run each scenario with a warm disk tier of SIZE")
    ap.add_argument("--proxy-thread", action="store_true",
                    help="run the proxy in a thread of this process, as the tests do (default: a child process, "
                         "so that the link's relay does not share the engine's GIL)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    os.environ.update(CLIENT_ENV)  # explicit test credentials, no instance metadata service
    model = make_model(Path(args.models), args.layers, args.experts, args.shard_mb)
    index = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"]
    shard = index[f"model.layers.{args.layers // 2}.mlp.experts.0.up_proj.weight"]  # an expert shard: the ceilings
    file_size = (model / shard).stat().st_size
    prompt = list(range(100, 100 + args.prompt))
    opts = {"cache_experts": args.cache_experts, "reader_threads": args.reader_threads}
    if args.cache_policy:
        opts["cache_policy"] = args.cache_policy
    result: dict = {"model": model.name, "model_bytes": sum(p.stat().st_size for p in model.iterdir()),
                    "options": opts, "prompt_tokens": args.prompt, "tokens": args.tokens, "repeats": args.repeats,
                    "cpus": os.cpu_count(), "loadavg_start": os.getloadavg(), "proxy_process": not args.proxy_thread}
    eng = sluice.load(str(model), memory="8GiB", progress=False)
    record = eng.experts_source.record_bytes
    moe_layers = len(eng.desc.moe_layers)
    result["record_bytes"] = record
    eng.close()

    print(f"model {model} ({result['model_bytes'] / MB:.0f} MB, expert record {record / MB:.2f} MB), "
          f"options {opts}", flush=True)
    local = median_of([decode_run(str(model), prompt, args.tokens, **opts) for _ in range(args.repeats)])
    result["local"] = local
    print(f"local disk (cold, direct_io={local['runs'][0]['direct_io']}): {local['decode_tok_s']:.2f} tok/s, "
          f"{local['bytes_per_token'] / MB:.1f} MB/token, hit rate {local['hit_rate']:.2f}", flush=True)
    mem = sluice.load(str(model), memory="8GiB", progress=False, reader_threads=args.reader_threads)
    try:
        measure(mem, prompt, args.tokens)  # every expert read once
        result["memory"] = median_of([measure(mem, prompt, args.tokens) for _ in range(args.repeats)])
    finally:
        mem.close()
    print(f"all experts in memory (compute only): {result['memory']['decode_tok_s']:.2f} tok/s", flush=True)
    need = local["bytes_per_token"]

    disk_cache = args.disk_cache
    if disk_cache and not has_disk_cache():
        print(f"--disk-cache {disk_cache}: this build's load() has no disk_cache option (the disk tier is not "
              "merged yet); warm-tier rows skipped", flush=True)
        result["disk_tier"] = "skipped: no disk_cache option in this build"
        disk_cache = None

    root = Path(tempfile.mkdtemp(prefix="sluice-remote-bench-"))
    (root / "doc").mkdir()
    s3 = S3Server(log_path=root / "moto.log")
    http = NginxServer(root / "doc", root / "nginx")
    try:
        t0 = time.perf_counter()
        urls = RemoteServers(s3=s3, http=http, docroot=root / "doc").publish(NAME, model)
        print(f"published to moto and nginx in {time.perf_counter() - t0:.0f} s", flush=True)
        paths = {"http": f"/{NAME}/{shard}", "s3": f"/models/{NAME}/{shard}"}
        ports = {"http": http.port, "s3": s3.port}
        direct = {k: server_ceiling(ports[k], paths[k], file_size, record, 600e6, s3=k == "s3") for k in ports}
        print("server ceilings (16 in flight, no proxy): " +
              ", ".join(f"{k} {v / MB:.0f} MB/s" for k, v in direct.items()), flush=True)
        result["server_ceiling"] = direct
        rows = result["scenarios"] = {}
        for name in args.scenarios.split(","):
            server, rate, latency = SCENARIOS[name]
            proxy = (FaultProxy if args.proxy_thread else ProxyProcess)(ports[server], latency=latency, rate=rate)
            try:
                path_ceiling = server_ceiling(proxy.port, paths[server], file_size, record, 1.5 * rate,
                                              s3=server == "s3")
                if server == "s3":
                    os.environ["AWS_ENDPOINT_URL"] = proxy.url
                    url = urls["s3"]
                else:
                    os.environ.pop("AWS_ENDPOINT_URL", None)
                    url = f"{proxy.url}/{NAME}"
                runs = [decode_run(url, prompt, args.tokens, **opts) for _ in range(args.repeats)]
                row = median_of(runs)
                limit = min(rate, direct[server], path_ceiling)
                # without speculation a layer's reads start at its router: each MoE layer pays one round
                # trip, and the token's compute does not overlap the link
                serial = 1 / (need / limit + moe_layers * latency + 1 / result["memory"]["decode_tok_s"])
                row.update(link=rate, latency_s=latency, path_ceiling=path_ceiling, roofline_bytes_s=limit,
                           needed_bytes_per_token=need, roofline_tok_s=limit / need,
                           of_roofline=row["decode_tok_s"] / (limit / need),
                           fetched_vs_local=row["bytes_per_token"] / need,
                           serial_bound_tok_s=serial, of_serial_bound=row["decode_tok_s"] / serial)
                print(f"{name}: {row['decode_tok_s']:.2f} tok/s, {row['bytes_per_token'] / MB:.1f} MB/token fetched "
                      f"({row['fetched_vs_local']:.2f}x local), path ceiling {path_ceiling / MB:.0f} MB/s, roofline "
                      f"{row['roofline_tok_s']:.2f} tok/s -> {row['of_roofline']:.2f} of roofline, "
                      f"{row['of_serial_bound']:.2f} of the serial bound {serial:.2f} tok/s "
                      f"(read wait {row['read_wait_s']:.2f} s, compute {row['compute_s']:.2f} s per run)", flush=True)
                if disk_cache:
                    tier = dict(opts, disk_cache=disk_cache, disk_cache_dir=str(root / f"tier-{name}"))
                    decode_run(url, prompt, args.tokens, **tier)  # fills the tier
                    pairs = []  # interleaved with local-disk runs: the machine's load drifts between minutes
                    for _ in range(args.repeats):
                        pairs.append((decode_run(str(model), prompt, args.tokens, **opts),
                                      decode_run(url, prompt, args.tokens, **tier)))
                    warm = median_of([w for _, w in pairs])
                    near = median_of([loc for loc, _ in pairs])
                    warm.update(local_beside=near["decode_tok_s"], fetched_per_token=warm["bytes_per_token"],
                                vs_local=statistics.median(w["decode_tok_s"] / loc["decode_tok_s"] for loc, w in pairs),
                                pair_ratios=[w["decode_tok_s"] / loc["decode_tok_s"] for loc, w in pairs],
                                local_runs=[loc["decode_tok_s"] for loc, _ in pairs])
                    row["warm_tier"] = warm
                    print(f"{name} warm disk tier: {warm['decode_tok_s']:.2f} tok/s, local disk beside it "
                          f"{near['decode_tok_s']:.2f} tok/s: {warm['vs_local']:.2f} of local (median of pair ratios "
                          f"{', '.join(f'{r:.2f}' for r in warm['pair_ratios'])})", flush=True)
                rows[name] = row
            finally:
                proxy.close()
    finally:
        http.close()
        s3.close()
        shutil.rmtree(root, ignore_errors=True)
    result["loadavg_end"] = os.getloadavg()
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
