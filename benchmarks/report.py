"""Tables and charts from the JSON results of ``benchmarks/run.py``.

    python benchmarks/report.py [--results benchmarks/results] [--doc docs/benchmarks.md]

Rewrites the part of the doc between ``<!-- results:begin -->`` and ``<!-- results:end -->``
(the rest is prose kept by hand) and writes the PNG charts next to it (``docs/benchmarks/``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
LABEL = {"sluice": "Sluice", "hf": "transformers + accelerate", "llamacpp": "llama.cpp", "airllm": "AirLLM"}


def gb(x, nd=2):
    return "-" if x is None else f"{x / 1e9:.{nd}f} GB"


def gib(x):
    return "-" if x is None else f"{x / 2**30:.2f} GiB"


def f(x, nd=2):
    return "-" if x is None else f"{x:.{nd}f}"


def pct(x):
    return "-" if x is None else f"{100 * x:.0f}%"


def disk_bw(data: dict) -> tuple[float, dict]:
    """The disk bandwidth rooflines use: the better of O_DIRECT random reads at the expert record
    size and buffered sequential reads, averaged over the measurements before and after the runs."""
    vals = []
    for key in ("limits", "limits_after"):
        lim = data.get(key)
        if lim:
            vals.append(max(lim["direct_read"]["bytes_per_s"], lim["buffered_sequential_read"]["bytes_per_s"]))
    lim = data["limits"]
    return sum(vals) / len(vals), {
        "direct": [data[k]["direct_read"]["bytes_per_s"] for k in ("limits", "limits_after") if data.get(k)],
        "buffered": [data[k]["buffered_sequential_read"]["bytes_per_s"]
                     for k in ("limits", "limits_after") if data.get(k)],
        "record_bytes": lim["direct_read"]["record_bytes"],
    }


def status(r: dict) -> str:
    if r.get("skipped"):
        return "skipped: " + r["skipped"]
    if not r.get("ok"):
        return "FAILED: " + (r.get("error") or "")[:160].replace("|", "/").replace("\n", " ")
    return "ok"


def match_cell(r: dict, n: int | None) -> str:
    if r.get("match") is None:
        return "-"
    return "yes" if r["match"] else f"no ({r.get('agree_prefix')}/{n} agree)"


def ref_note(data: dict) -> str:
    ref = data.get("reference")
    if not ref:
        return "none (run without a reference)"
    if not ref.get("ok"):
        return f"the fp32 reference run failed ({status(ref)})"
    return ("transformers' modules in fp32, run layer by layer by AirLLM with dtype=float32, no cap "
            "(an fp32 copy of this model does not fit in RAM for transformers itself)")


def header(data: dict) -> list[str]:
    m = data["machine"]
    la = m.get("loadavg") or []
    return [
        f"Command: `{data['command']}`  ",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['mem_total_bytes'] / 2**30:.1f} GiB RAM, kernel {m['kernel']}, "
        f"AVX2 {'yes' if m.get('avx2') else 'no'}, AVX-512 {'yes' if m.get('avx512f') else 'no'}"
        f"{', AVX512-BF16 ' + ('yes' if m['avx512_bf16'] else 'no') if 'avx512_bf16' in m else ''}; finished "
        f"{data['finished']}; 1-minute load average at the end {la[0] if la else '?'}.  ",
    ]


def loads(runs: list[dict]) -> str:
    vals = [r["loadavg_before"][0] for r in runs if r.get("loadavg_before")]
    return f"{min(vals):.1f}-{max(vals):.1f}" if vals else "?"


def cold_section(data: dict, charts: Path, rel: str) -> list[str]:
    facts, runs = data["model_facts"], data["runs"]
    bw, parts = disk_bw(data)
    need = facts["expert_bytes_per_token"]
    roof = bw / need
    n = max((r.get("result") or {}).get("generated_tokens") or 0 for r in runs) or None
    if data.get("cgroup"):
        cgroup = "yes (" + str(data.get("cgroup")) + ")"
    else:
        cgroup = "NO (" + str(data.get("cgroup_note")) + ")"
    out = ["### (a) Cold: model 4x larger than the memory cap", ""] + header(data) + [
        f"Model: {facts['model_type']} {facts['checkpoint_bytes'] / 1e9:.2f} GB ({facts['dtype']}), "
        f"{facts['moe_layers']} MoE layers x {facts['experts_per_layer']} experts "
        f"of {facts['expert_bytes'] / 1e6:.1f} MB, "
        f"top-{facts['top_k']}: a token needs {gb(need)} of experts. Cap {gib(data['cap_bytes'])} "
        f"({100 * data['cap_bytes'] / facts['checkpoint_bytes']:.0f}% of the model), enforced by a cgroup: "
        f"{cgroup}; "
        f"page cache dropped before each engine: {all(r.get('page_cache_dropped') for r in runs if r.get('ok'))}. "
        f"Prompt {len(data['prompt_ids'])} tokens, {n} greedy tokens, 2 threads. "
        f"1-minute load average during the runs: {loads(runs)}.",
        "",
        f"Disk, measured in the same run (before/after): O_DIRECT random {parts['record_bytes'] / 1e6:.1f} MB reads, "
        "4 threads: "
        + " / ".join(f"{x / 1e9:.2f}" for x in parts["direct"]) + " GB/s; buffered sequential: "
        + " / ".join(f"{x / 1e9:.2f}" for x in parts["buffered"]) + f" GB/s. Rooflines use {bw / 1e9:.2f} GB/s. "
        f"**I/O roofline with no cache: {roof:.2f} tok/s** ({gb(need)} per token / disk bandwidth). "
        f"Reference tokens: {ref_note(data)}.",
        "",
        "| engine | decode tok/s | prefill tok/s | TTFT s | load s | disk read per token | disk read total | "
        "peak RSS | cgroup peak | x no-cache roofline | x own I/O roofline | greedy = fp32 reference | "
        "greedy = transformers bf16 | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        per = r.get("read_bytes_per_decode_token")
        dec = r.get("decode_tok_s")
        own = (dec * per / bw) if dec and per else None
        cg = (r.get("cgroup") or {}).get("max_usage_bytes")
        bf16 = {"match": r.get("match_bf16"), "agree_prefix": r.get("agree_prefix_bf16")}
        out.append(
            f"| {LABEL.get(r['engine'], r['engine'])} | {f(dec)} | {f(r.get('prefill_tok_s'))} | "
            f"{f(r.get('ttft_s'), 1)} | {f(r.get('load_s'), 1)} | {gb(per, 3)} | {gb(r.get('read_bytes_total'))} | "
            f"{gib(r.get('peak_rss_bytes'))} | {gib(cg)} | {f(dec / roof) if dec else '-'} | {f(own)} | "
            f"{match_cell(r, n)} | {match_cell(bf16, n)} | {status(r)} |")
    s = next((r for r in runs if r["engine"] == "sluice" and r.get("ok")), None)
    if s:
        st = s["result"]["engine_stats"]
        under = "under" if st["peak_rss_bytes"] <= st["budget_bytes"] else "OVER"
        out += ["", f"Sluice's own counters (decode and prefill of the measured run): "
                f"{st['expert_lookups']} expert lookups, "
                f"{st['expert_hits']} hits, {st['expert_misses']} misses (hit rate {pct(st['hit_rate'])}), "
                f"{st['demand_reads']} demand reads + {st['prefetch_reads']} lookahead prefetch reads "
                f"({st['prefetch_used']} used), "
                f"{gb(st['bytes_read'])} read by the engine; cache {st['cache_slots']}/{st['total_experts']} experts; "
                f"prefill and decode together: read wait {f(st['read_wait_s'])} s, expert compute "
                f"{f(st['expert_compute_s'])} s of {f(st['total_s'])} s; peak RSS {gib(st['peak_rss_bytes'])} "
                f"vs budget {gib(st['budget_bytes'])} ({under})."]
        peers = [r for r in runs if r["engine"] != "sluice" and r.get("ok") and r.get("decode_tok_s")]
        if peers:
            best = max(peers, key=lambda r: r["decode_tok_s"])
            out.append(f"Sluice decodes {s['decode_tok_s'] / best['decode_tok_s']:.1f}x faster than the best peer "
                       f"({LABEL[best['engine']]}).")
    prof = (data.get("profiled") or {}).get("profile")
    if prof:
        out.append(f"A separate Sluice run under cProfile (not in the table): `benchmarks/results/{Path(prof).name}`.")
    out += ["", f"![cold decode]({rel}/cold.png)", ""]
    chart_cold(runs, roof, charts / "cold.png")
    return out


def warm_section(data: dict, charts: Path, rel: str) -> list[str]:
    facts, runs = data["model_facts"], data["runs"]
    mem_bw = data["limits"]["memory_read"]["bytes_per_s"]
    touched = facts["bytes_touched_per_token"]
    roof = mem_bw / touched
    ref = (data.get("reference") or {}).get("result") or {}
    margins = ref.get("logit_margins")
    n = max((r.get("result") or {}).get("generated_tokens") or 0 for r in runs) or None
    out = ["### (b) Warm: the model fits, everything in RAM", ""] + header(data) + [
        f"Model: {facts['model_type']} {facts['checkpoint_bytes'] / 1e9:.2f} GB ({facts['dtype']}), "
        f"{facts['experts_per_layer']} experts per layer, top-{facts['top_k']}; each engine generated once before the "
        f"measured run (same process); cap {gib(data['cap_bytes'])}. Weights touched per token: {gb(touched)}. "
        f"Memory read bandwidth (fp32 sum over 1 GiB, 2 threads, same run): {mem_bw / 1e9:.1f} GB/s, so the "
        f"**memory roofline is {roof:.1f} tok/s**. Greedy tokens compared with transformers in fp32 on the same "
        f"weights{'' if not margins else f' (smallest top-1/top-2 logit margin of the reference {min(margins):.3f})'}. "
        f"1-minute load average during the runs: {loads(runs)}.",
        "",
        "| engine | decode tok/s | x memory roofline | prefill tok/s | TTFT s | peak RSS | disk read (measured run) | "
        "greedy = fp32 reference | status |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        dec = r.get("decode_tok_s")
        out.append(
            f"| {LABEL.get(r['engine'], r['engine'])} | {f(dec)} | {f(dec / roof) if dec else '-'} | "
            f"{f(r.get('prefill_tok_s'))} | {f(r.get('ttft_s'), 2)} | {gib(r.get('peak_rss_bytes'))} | "
            f"{gb((r.get('read_bytes_prefill') or 0) + (r.get('read_bytes_decode') or 0)) if r.get('ok') else '-'} | "
            f"{match_cell(r, n)} | {status(r)} |")
    s = next((r for r in runs if r["engine"] == "sluice" and r.get("ok")), None)
    lc = next((r for r in runs if r["engine"] == "llamacpp" and r.get("ok")), None)
    if s and lc and lc.get("decode_tok_s"):
        ratio = s["decode_tok_s"] / lc["decode_tok_s"]
        out += ["", f"Sluice / llama.cpp decode at the same dtype (bf16): **{ratio:.2f}x**."]
    prof = (data.get("profiled") or {}).get("profile")
    if prof:
        out.append(f"A separate Sluice run under cProfile (not in the table): `benchmarks/results/{Path(prof).name}`.")
    out += ["", f"![warm decode]({rel}/warm.png)", ""]
    chart_warm(runs, roof, charts / "warm.png")
    return out


def sweep_section(data: dict, charts: Path, rel: str) -> list[str]:
    facts, runs = data["model_facts"], data["runs"]
    out = ["### (c) Sluice alone: memory cap from the floor to the whole model", ""] + header(data) + [
        f"Model: {facts['checkpoint_bytes'] / 1e9:.2f} GB, {facts['experts_total']} experts. Each cap: page cache "
        f"dropped, a cgroup limit = Sluice's budget, a first generation from a cold cache on another prompt "
        f"(\"cold\" columns), then the measured generation (\"warm\" columns). Floor {gib(data['floor_bytes'])}. "
        f"1-minute load average during the runs: {loads(runs)}.",
        "",
        "| cap | cap / model | cache experts | cold decode tok/s | cold hit rate | warm decode tok/s | warm hit rate | "
        "warm hits / misses | disk read per decode token (warm) | peak RSS | RSS <= cap | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    pts = []
    for r in runs:
        res = r.get("result") or {}
        st, w = res.get("engine_stats") or {}, res.get("warmup_stats") or {}
        cap = r["cap_bytes"]
        rss = r.get("peak_rss_bytes")
        out.append(
            f"| {gib(cap)} | {pct(cap / facts['checkpoint_bytes'])} | {st.get('cache_slots', '-')} | "
            f"{f(w.get('decode_tok_s'))} | {pct(w.get('hit_rate'))} | {f(st.get('decode_tok_s'))} | "
            f"{pct(st.get('hit_rate'))} | {st.get('expert_hits', '-')} / {st.get('expert_misses', '-')} | "
            f"{gb(r.get('read_bytes_per_decode_token'), 3)} | {gib(rss)} | "
            f"{'-' if rss is None else ('yes' if rss <= cap else 'NO')} | {status(r)} |")
        if r.get("ok"):
            pts.append((cap, w.get("decode_tok_s"), w.get("hit_rate"), st.get("decode_tok_s"), st.get("hit_rate")))
    out += ["", f"![sweep]({rel}/sweep.png)", ""]
    chart_sweep(pts, facts["checkpoint_bytes"], charts / "sweep.png")
    return out


def repeats_section(data: dict) -> list[str]:
    """Warm decode, engines run in turn several times: the spread a shared machine gives."""
    facts, runs = data["model_facts"], data["runs"]
    roof = data["limits"]["memory_read"]["bytes_per_s"] / facts["bytes_touched_per_token"]
    by: dict[str, list[dict]] = {}
    for r in runs:
        by.setdefault(r["engine"], []).append(r)
    out = ["#### Warm decode, repeated: engines in turn, same model and settings", ""] + header(data) + [
        f"Each engine ran {max(len(v) for v in by.values())} times, interleaved (1-minute load average "
        f"{loads(runs)}); memory roofline {roof:.1f} tok/s.",
        "",
        "| engine | decode tok/s, each run | best | median | best x memory roofline | prefill tok/s (best run) |",
        "|---|---|---|---|---|---|",
    ]
    best = {}
    for e, rs in by.items():
        vals = [r["decode_tok_s"] for r in rs if r.get("ok") and r.get("decode_tok_s")]
        if not vals:
            out.append(f"| {LABEL.get(e, e)} | - | - | - | - | - |")
            continue
        top = max((r for r in rs if r.get("ok")), key=lambda r: r["decode_tok_s"])
        best[e] = max(vals)
        med = sorted(vals)[len(vals) // 2]
        out.append(f"| {LABEL.get(e, e)} | {', '.join(f(v) for v in vals)} | {f(max(vals))} | {f(med)} | "
                   f"{f(max(vals) / roof)} | {f(top.get('prefill_tok_s'))} |")
    if "sluice" in best and "llamacpp" in best:
        sv = sorted(r["decode_tok_s"] for r in by["sluice"] if r.get("ok"))
        lv = sorted(r["decode_tok_s"] for r in by["llamacpp"] if r.get("ok"))
        out += ["", f"Sluice / llama.cpp (bf16): best {best['sluice'] / best['llamacpp']:.2f}x, "
                f"median {sv[len(sv) // 2] / lv[len(lv) // 2]:.2f}x."]
    return out + [""]


def exact_section(data: dict) -> list[str]:
    facts, runs = data["model_facts"], data["runs"]
    ref = (data.get("reference") or {}).get("result") or {}
    margins = ref.get("logit_margins") or []
    n = len(ref.get("token_ids") or []) or None
    out = ["### Exactness: greedy tokens against transformers' fp32 reference", ""] + header(data) + [
        f"Model: {facts['model_type']} {facts['checkpoint_bytes'] / 1e9:.2f} GB ({facts['dtype']} weights), "
        f"{facts['layers']} layers, {facts['experts_per_layer']} experts, top-{facts['top_k']}. "
        f"Reference: transformers with the weights upcast to fp32; "
        f"smallest top-1/top-2 logit margin over its {n} tokens: "
        f"{f(min(margins), 3) if margins else '-'}.",
        "",
        "| engine | arithmetic | greedy tokens = reference | status |",
        "|---|---|---|---|",
    ]
    for r in runs:
        out.append(f"| {LABEL.get(r['engine'], r['engine'])} | {r.get('arithmetic') or '-'} | {match_cell(r, n)} | "
                   f"{status(r)} |")
    return out + [""]


# -- charts ---------------------------------------------------------------------------------


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def chart_cold(runs, roof, path: Path) -> None:
    plt = _plt()
    ok = [r for r in runs if r.get("ok") and r.get("decode_tok_s")]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
    names = [LABEL[r["engine"]] for r in ok]
    vals = [r["decode_tok_s"] for r in ok]
    bars = a1.bar(names, vals, color="#3b7dd8")
    a1.bar_label(bars, labels=[f"{v:.2f}" for v in vals], fontsize=8)
    a1.axhline(roof, color="#d83b3b", ls="--", label=f"I/O roofline, no cache ({roof:.2f} tok/s)")
    a1.set_yscale("log")
    a1.set_ylim(min(vals) / 2, max(roof, max(vals)) * 2)
    a1.set_ylabel("decode tok/s (log)")
    a1.legend(fontsize=8)
    a1.tick_params(axis="x", labelsize=8, rotation=15)
    a2.bar(names, [(r.get("read_bytes_per_decode_token") or 0) / 1e9 for r in ok], color="#7a7a7a")
    a2.set_ylabel("GB read from disk per token")
    a2.tick_params(axis="x", labelsize=8, rotation=15)
    fig.suptitle("Cold, model 4x the memory cap")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def chart_warm(runs, roof, path: Path) -> None:
    plt = _plt()
    ok = [r for r in runs if r.get("ok") and r.get("decode_tok_s")]
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    bars = ax.bar([LABEL[r["engine"]] for r in ok], [r["decode_tok_s"] for r in ok], color="#3b7dd8")
    ax.bar_label(bars, labels=[f"{r['decode_tok_s']:.2f}" for r in ok], fontsize=8)
    ax.axhline(roof, color="#d83b3b", ls="--", label=f"memory roofline ({roof:.1f} tok/s)")
    ax.set_ylabel("decode tok/s")
    ax.legend(fontsize=8)
    ax.tick_params(axis="x", labelsize=8, rotation=15)
    ax.set_title("Warm, model in RAM (bf16)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def chart_sweep(pts, model_bytes, path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    x = [p[0] / 2**30 for p in pts]
    ax.plot(x, [p[3] or 0 for p in pts], "o-", color="#3b7dd8", label="decode tok/s (warm cache)")
    ax.plot(x, [p[1] or 0 for p in pts], "o--", color="#9bbbe8", label="decode tok/s (cold cache)")
    ax.set_xlabel("memory cap (GiB)")
    ax.set_ylabel("decode tok/s")
    ax2 = ax.twinx()
    ax2.plot(x, [100 * (p[4] or 0) for p in pts], "s-", color="#d8893b", label="hit rate % (warm)")
    ax2.set_ylabel("expert cache hit rate %")
    ax2.set_ylim(0, 100)
    ax.axvline(model_bytes / 2**30, color="#888", ls=":", lw=1, label="model size")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="upper left")
    ax.set_title("Sluice: speed and hit rate vs memory cap")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(results: Path, charts: Path, rel: str) -> str:
    charts.mkdir(parents=True, exist_ok=True)
    parts = []
    for name, fn in (("cold", cold_section), ("warm", warm_section), ("warm-repeats", None), ("sweep", sweep_section)):
        p = results / f"{name}.json"
        if p.exists():
            data = json.loads(p.read_text())
            parts += repeats_section(data) if fn is None else fn(data, charts, rel)
    p = results / "exact.json"
    if p.exists():
        parts += exact_section(json.loads(p.read_text()))
    return "\n".join(parts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--results", default=str(BENCH / "results"))
    p.add_argument("--doc", default=str(BENCH.parent / "docs" / "benchmarks.md"))
    args = p.parse_args(argv)
    doc = Path(args.doc)
    charts = doc.parent / doc.stem
    body = render(Path(args.results), charts, doc.stem)
    text = doc.read_text() if doc.exists() else f"# Benchmarks\n\n{BEGIN}\n{END}\n"
    if BEGIN not in text or END not in text:
        text += f"\n{BEGIN}\n{END}\n"
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(f"{head}{BEGIN}\n{body}\n{END}{tail}")
    print(f"wrote {doc} and charts in {charts}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
