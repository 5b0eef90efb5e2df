"""Decode kernels against the memory roofline (issue 31): GB/s per kernel and thread count, and
each kernel's share of a warm decode token.

Part 1 (kernels). For the shapes of one decode token of a model (default: the 2 GB bf16
Mixtral shape of ``benchmarks/warm_vs_llamacpp.py``, or ``--model``'s config.json), each C
kernel the decode path calls is timed on its own, as the engine calls it (the wrappers in
``sluice.kernels``): the fused SwiGLU expert (``sk_swiglu``, bf16 and f32), the expert GEMVs
(``sk_dense``, gate/up [I, H] and down [H, I], bf16 and f32), the attention projections, the
head (vocab x hidden, the largest matrix), attention (``sk_attend``, one query over L cached
positions of an fp32 KV cache) and the cache-resident RMSNorm and rotary. Every weight-reading
kernel cycles through distinct operands carved from a --pool MiB buffer (default 1 GiB, beyond
this host's last-level cache), so its weights come from DRAM as in a warm decode. GB/s =
bytes the kernel reads per call (weights, or keys + values) / seconds per call; the plain read
is a sum of the whole pool buffer on the kernels' own thread pool (``kernels.bench_sum``),
measured in every round, interleaved with the kernels, so background load hits both alike.
Medians over --reps rounds; the 1-minute load average is recorded before and after.

Part 2 (profile, with ``--model``). The model is loaded with every expert in memory, generated
once (every expert read), and then the backend's kernel functions are wrapped with timers
(``kernels.backend.cpu`` is what every call site calls through): per decoded token, the
seconds in each kernel class between the first streamed token and the last of 1 + N (the
prefill and the first token left out), the calls and the bytes they read, next to the token's wall time; what is left
is Python, routing and torch glue. Each class's roofline time is its bytes / the plain-read
bandwidth, so ``gap_ms`` says where a token's time above the roofline goes.

    PYTHONPATH=src python benchmarks/decode_kernels.py [--threads 1 2] [--reps 9] \\
        [--model MODEL_DIR] [--contexts 32 512] [--json benchmarks/results/decode-kernels.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sluice  # noqa: E402,F401  (before torch: it sets OpenMP's wait policy)
import torch  # noqa: E402

from harness import loadavg  # noqa: E402
from sluice import kernels  # noqa: E402
from sluice.kernels.backend import cpu  # noqa: E402
from sluice.synthetic import MIXTRAL_CONFIG  # noqa: E402

# the 2 GB bf16 Mixtral shape of warm_vs_llamacpp.py (MIXTRAL_CONFIG with 5 experts per layer)
DEFAULT_SHAPE = {
    k: MIXTRAL_CONFIG[k]
    for k in (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
    )
}
ESIZE = {torch.bfloat16: 2, torch.float32: 4}


class Pool:
    """Distinct operands carved from one big buffer per dtype (random values: no NaN, no denormals)."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        gen = torch.Generator().manual_seed(0)
        self.f32 = torch.empty(nbytes // 4, dtype=torch.float32)
        for i in range(0, self.f32.numel(), 1 << 24):
            self.f32[i : i + (1 << 24)].normal_(0, 0.05, generator=gen)
        self.bf16 = self.f32[: nbytes // 2].to(torch.bfloat16)  # the same bytes' worth, half the values

    def tensors(self, dtype: torch.dtype, shape: tuple[int, ...], groups: int = 1) -> list[tuple[torch.Tensor, ...]]:
        """As many tuples of ``groups`` contiguous [shape] tensors as fit in the buffer (at least 2)."""
        buf = self.f32 if dtype == torch.float32 else self.bf16
        n = 1
        for s in shape:
            n *= s
        count = max(2, buf.numel() // (n * groups))
        out = []
        for c in range(count):
            base = (c * n * groups) % max(1, buf.numel() - n * groups + 1)
            out.append(tuple(buf[base + g * n : base + (g + 1) * n].view(shape) for g in range(groups)))
        return out


def decode_cases(shape: dict, pool: Pool, contexts: list[int]) -> dict[str, tuple[list, Callable, int]]:
    """label -> (operands, call(operand), bytes read per call) for one decode token's kernels."""
    h, i = shape["hidden_size"], shape["intermediate_size"]
    hq, hkv, d, vocab = (
        shape["num_attention_heads"],
        shape["num_key_value_heads"],
        shape["head_dim"],
        shape["vocab_size"],
    )
    xh, xi = torch.randn(1, h), torch.randn(1, i)
    cases: dict[str, tuple[list, Callable, int]] = {}
    for dt, name in ((torch.bfloat16, "bf16"), (torch.float32, "f32")):
        e = ESIZE[dt]
        experts = pool.tensors(dt, (i, h), groups=3)  # gate [I, H], up [I, H], down viewed [H, I]
        cases[f"expert swiglu {name} (sk_swiglu)"] = (
            experts,
            lambda w: kernels.swiglu(xh, w[0], w[1], w[2].view(h, i), 0.5),
            3 * i * h * e,
        )
        cases[f"expert up GEMV {name} {i}x{h}"] = (
            pool.tensors(dt, (i, h)),
            lambda w: kernels.dense(xh, w[0]),
            i * h * e,
        )
        cases[f"expert down GEMV {name} {h}x{i}"] = (
            pool.tensors(dt, (h, i)),
            lambda w: kernels.dense(xi, w[0]),
            i * h * e,
        )
    cases[f"attn q/o proj bf16 {hq * d}x{h}"] = (
        pool.tensors(torch.bfloat16, (hq * d, h)),
        lambda w: kernels.dense(xh, w[0]),
        hq * d * h * 2,
    )
    cases[f"attn k/v proj bf16 {hkv * d}x{h}"] = (
        pool.tensors(torch.bfloat16, (hkv * d, h)),
        lambda w: kernels.dense(xh, w[0]),
        hkv * d * h * 2,
    )
    cases[f"head bf16 {vocab}x{h}"] = (
        pool.tensors(torch.bfloat16, (vocab, h)),
        lambda w: kernels.dense(xh, w[0]),
        vocab * h * 2,
    )
    q = torch.randn(1, hq, d)
    for length in contexts:
        cases[f"attention L={length} (sk_attend)"] = (
            pool.tensors(torch.float32, (hkv, length, d), groups=2),
            lambda kv, n=length: kernels.attend(q, kv[0], kv[1], n - 1, d**-0.5),
            2 * hkv * length * d * 4,
        )
    # cache-resident: one row of activations and the norm's weight (as in decode); bytes = its operands
    wn, res = torch.rand(h) + 0.5, torch.randn(1, h)
    cases[f"rmsnorm + residual {h} (sk_rmsnorm)"] = ([None], lambda _: kernels.rmsnorm(xh, wn, 1e-5, res), 5 * h * 4)
    qr, cos, sin = torch.randn(1, hq, d), torch.randn(1, d), torch.randn(1, d)
    cases[f"rope q {hq}x{d} (sk_rope)"] = ([None], lambda _: kernels.rope(qr, cos, sin), (2 * hq * d + 2 * d) * 4)
    return cases


def _plain_read(pool: Pool) -> float:
    t = time.perf_counter()
    kernels.bench_sum(pool.f32)
    return pool.f32.numel() * 4 / (time.perf_counter() - t) / 1e9


def _pass(operands: list, call: Callable, min_calls: int = 16) -> float:
    """Seconds per call over one pass through the operands (repeated to at least min_calls)."""
    rounds = max(1, -(-min_calls // len(operands)))
    t = time.perf_counter()
    for _ in range(rounds):
        for w in operands:
            call(w)
    return (time.perf_counter() - t) / (rounds * len(operands))


def measure_kernels(shape: dict, threads: list[int], reps: int, pool_mib: int, contexts: list[int]) -> dict:
    pool = Pool(pool_mib << 20)
    cases = decode_cases(shape, pool, contexts)
    rows, bandwidth = [], {}
    for th in threads:
        kernels.set_threads(th)
        torch.set_num_threads(th)
        load0 = loadavg()[:1]
        for ops, call, _ in cases.values():  # warm-up (page faults, thread pool)
            _pass(ops[:2], call, 2)
        secs: dict[str, list[float]] = {label: [] for label in cases}
        bw = []
        for r in range(reps):
            bw.append(_plain_read(pool))
            order = list(cases.items()) if r % 2 == 0 else list(cases.items())[::-1]
            for label, (ops, call, _) in order:
                secs[label].append(_pass(ops, call, 2000 if ops == [None] else 16))
        bw_med = statistics.median(bw)
        bandwidth[th] = {"plain_read_GBps": bw_med, "each": bw, "load1": load0 + loadavg()[:1]}
        print(
            f"threads={th}: plain read {bw_med:5.1f} GB/s (each {', '.join(f'{v:.1f}' for v in bw)}); "
            f"load {bandwidth[th]['load1']}",
            flush=True,
        )
        for label, (ops, _, nbytes) in cases.items():
            s = statistics.median(secs[label])
            resident = ops == [None]
            row = {
                "threads": th,
                "kernel": label,
                "bytes_per_call": nbytes,
                "operands": len(ops),
                "us": s * 1e6,
                "us_each": [v * 1e6 for v in secs[label]],
                "GBps": nbytes / s / 1e9,
                "plain_read_GBps": bw_med,
                "x_plain_read": None if resident else nbytes / s / 1e9 / bw_med,
                "cache_resident": resident,
            }
            rows.append(row)
            frac = "  (cache-resident)" if resident else f"  {row['x_plain_read']:5.2f} of plain read"
            print(f"  {label:40s} {s * 1e6:9.1f} us  {row['GBps']:6.2f} GB/s{frac}", flush=True)
    kernels.set_threads(max(threads))
    return {"rows": rows, "bandwidth": bandwidth, "pool_MiB": pool_mib, "_pool": pool}


# -- part 2: a warm decode token, per kernel class --------------------------------------------------

_WRAPPED = (
    "swiglu",
    "swiglu_many",
    "swiglu_rows",
    "dense",
    "dense_t",
    "dense_chain",
    "qmatmul",
    "attend",
    "rmsnorm",
    "rope",
    "fp8_dense",
    "delta_rule",
)


class KernelTimers:
    """Wraps the backend's kernel functions on ``cpu`` (what every call site calls through) with
    timers; classifies each call and counts the bytes it reads."""

    def __init__(self, vocab: int, experts: int):
        self.vocab, self.experts = vocab, experts
        self.secs: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.bytes: dict[str, int] = {}
        self.saved = {op: getattr(cpu, op) for op in _WRAPPED}

    def _classify(self, op: str, args: tuple) -> tuple[str, int]:
        if op == "dense":
            w = args[1]
            n = w.shape[0]
            nb = w.numel() * w.element_size()
            if n == self.vocab:
                return "head (sk_dense)", nb
            if n == self.experts:
                return "router (sk_dense)", nb
            return "attn projections (sk_dense)", nb
        if op == "swiglu_many":
            return "experts (sk_swiglu)", sum(3 * a[3] * a[4] * (2 if a[5] != 0 else 4) for a in args[1])
        if op == "swiglu":
            g = args[1]
            return "experts (sk_swiglu)", 3 * g.numel() * g.element_size()
        if op == "attend":
            k, v = args[1], args[2]
            length = args[3] + args[0].shape[0]
            return "attention (sk_attend)", (k.shape[0] * k.shape[-1] + v.shape[0] * v.shape[-1]) * length * 4
        if op == "rmsnorm":
            return "rmsnorm (sk_rmsnorm)", 0
        if op == "rope":
            return "rope (sk_rope)", 0
        return op, 0

    def __enter__(self):
        perf = time.perf_counter
        for op, fn in self.saved.items():

            def timed(*args, _op=op, _fn=fn, **kw):
                t = perf()
                out = _fn(*args, **kw)
                dt = perf() - t
                cls, nb = self._classify(_op, args)
                self.secs[cls] = self.secs.get(cls, 0.0) + dt
                self.calls[cls] = self.calls.get(cls, 0) + 1
                self.bytes[cls] = self.bytes.get(cls, 0) + nb
                return out

            setattr(cpu, op, timed)
        return self

    def __exit__(self, *exc):
        for op, fn in self.saved.items():
            setattr(cpu, op, fn)

    def snapshot(self) -> tuple[dict, dict, dict]:
        return dict(self.secs), dict(self.calls), dict(self.bytes)


def _wtype_check() -> None:
    """The byte count of swiglu_many's args assumes wtype 0 = f32 (sluice.kernels._WTYPE)."""
    if kernels._WTYPE[torch.float32] != 0:
        raise RuntimeError("decode_kernels: sluice.kernels._WTYPE changed; update KernelTimers._classify")


def profile_decode(
    model: Path, threads: list[int], contexts: list[int], new: int, reps: int, bw_of: Callable[[int], float]
) -> list[dict]:
    _wtype_check()
    cfg = json.loads((model / "config.json").read_text())
    vocab = cfg["vocab_size"]
    experts = cfg.get("num_local_experts", cfg.get("num_experts", 0))
    size = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    out = []
    for th in threads:
        with sluice.load(
            model, memory=int(size * 3 + (2 << 30)), threads=th, progress=False, max_context=max(contexts) + new + 16
        ) as eng:
            g = torch.Generator().manual_seed(2)
            for _ in range(2):  # every expert read
                eng.generate(
                    torch.randint(3, vocab, (32,), generator=g).tolist(),
                    max_new_tokens=8,
                    ignore_eos=True,
                    speculate=False,
                )
            for ctx in contexts:
                per: dict[str, list[float]] = {}
                walls, plain_tok_s, load = [], [], [loadavg()[0]]
                calls_tok, bytes_tok = {}, {}
                for _ in range(reps):
                    ids = torch.randint(3, vocab, (ctx,), generator=g).tolist()
                    res = eng.generate(ids, max_new_tokens=new + 1, ignore_eos=True, speculate=False)  # untimed
                    plain_tok_s.append(res.stats["decode_tok_s"])
                    with KernelTimers(vocab, experts) as kt:  # from the first token to the last
                        n = 0
                        for _st in eng.stream(ids, max_new_tokens=new + 1, ignore_eos=True, speculate=False):
                            if n == 0:
                                t1, (s1, c1, b1) = time.perf_counter(), kt.snapshot()
                            n += 1
                        t2, (s2, c2, b2) = time.perf_counter(), kt.snapshot()
                    if n != new + 1:
                        raise RuntimeError(f"decode_kernels: {n} tokens streamed, {new + 1} asked")
                    walls.append((t2 - t1) / new)
                    for cls in s2:
                        if c2[cls] == c1.get(cls, 0):
                            continue  # prefill only (e.g. swiglu_rows)
                        per.setdefault(cls, []).append((s2[cls] - s1.get(cls, 0.0)) / new)
                        calls_tok[cls] = (c2[cls] - c1.get(cls, 0)) / new
                        bytes_tok[cls] = (b2[cls] - b1.get(cls, 0)) / new
                    load.append(loadavg()[0])
                bw = bw_of(th)
                wall = statistics.median(walls)
                classes = []
                for cls, v in sorted(per.items(), key=lambda kv: -statistics.median(kv[1])):
                    s = statistics.median(v)
                    roof = bytes_tok[cls] / (bw * 1e9)
                    classes.append(
                        {
                            "class": cls,
                            "ms_per_token": s * 1e3,
                            "share": s / wall,
                            "calls_per_token": calls_tok[cls],
                            "MB_per_token": bytes_tok[cls] / 1e6,
                            "GBps": bytes_tok[cls] / s / 1e9 if s > 0 else None,
                            "x_plain_read": bytes_tok[cls] / s / 1e9 / bw if s > 0 and roof > 0 else None,
                            "roofline_ms": roof * 1e3,
                            "gap_ms": (s - roof) * 1e3,
                        }
                    )
                in_kernels = sum(c["ms_per_token"] for c in classes) / 1e3
                total_bytes = sum(bytes_tok.values())
                row = {
                    "threads": th,
                    "context": ctx,
                    "new": new,
                    "reps": reps,
                    "ms_per_token": wall * 1e3,
                    "ms_each": [w * 1e3 for w in walls],
                    "timed_tok_s": 1 / wall,
                    "untimed_decode_tok_s": statistics.median(plain_tok_s),
                    "plain_read_GBps": bw,
                    "MB_per_token": total_bytes / 1e6,
                    "roofline_ms": total_bytes / (bw * 1e9) * 1e3,
                    "outside_kernels_ms": (wall - in_kernels) * 1e3,
                    "outside_share": 1 - in_kernels / wall,
                    "classes": classes,
                    "load1": load,
                }
                out.append(row)
                print(
                    f"profile threads={th} context={ctx}: {wall * 1e3:.1f} ms/token (untimed "
                    f"{row['untimed_decode_tok_s']:.2f} tok/s), roofline {row['roofline_ms']:.1f} ms "
                    f"({total_bytes / 1e6:.0f} MB at {bw:.1f} GB/s); outside kernels "
                    f"{row['outside_kernels_ms']:.1f} ms ({row['outside_share']:.0%}); load {load}",
                    flush=True,
                )
                for c in classes:
                    frac = f"{c['x_plain_read']:5.2f}" if c["x_plain_read"] is not None else "   - "
                    print(
                        f"  {c['class']:30s} {c['ms_per_token']:7.2f} ms {c['share']:6.1%}  "
                        f"{c['calls_per_token']:5.0f} calls  {c['MB_per_token']:7.1f} MB  x plain {frac}  "
                        f"gap {c['gap_ms']:6.2f} ms",
                        flush=True,
                    )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=9, help="interleaved rounds (medians); at least 7 for the docs")
    ap.add_argument("--pool", type=int, default=1024, help="MiB of distinct operands cycled through")
    ap.add_argument(
        "--contexts", type=int, nargs="+", default=[512, 4096], help="cached positions for the attention kernel"
    )
    ap.add_argument(
        "--model",
        type=Path,
        help="also profile warm decode tokens of this checkpoint (its config.json gives the shapes)",
    )
    ap.add_argument("--profile-contexts", type=int, nargs="+", default=[32, 512], help="prompt lengths profiled")
    ap.add_argument("--profile-new", type=int, default=16, help="decoded tokens per profiled run")
    ap.add_argument("--profile-reps", type=int, default=3)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    shape = dict(DEFAULT_SHAPE)
    if a.model is not None:
        cfg = json.loads((a.model / "config.json").read_text())
        shape.update({k: cfg[k] for k in shape if k in cfg})
    print(f"shape {shape}; kernels {kernels.info()}; cpus {os.cpu_count()}", flush=True)
    res = measure_kernels(shape, a.threads, a.reps, a.pool, a.contexts)
    pool = res.pop("_pool")
    profile = []
    if a.model is not None:
        bws = {}

        def bw_of(th: int) -> float:  # the plain read at th threads, measured right after the profile
            kernels.set_threads(th)
            bws[th] = statistics.median(_plain_read(pool) for _ in range(5))
            return bws[th]

        profile = profile_decode(a.model, a.threads, a.profile_contexts, a.profile_new, a.profile_reps, bw_of)
    if a.json:
        a.json.write_text(
            json.dumps(
                {
                    "shape": shape,
                    "kernels_info": kernels.info(),
                    "cpus": os.cpu_count(),
                    "reps": a.reps,
                    **res,
                    "profile": profile,
                    "model": str(a.model) if a.model else None,
                },
                indent=1,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
