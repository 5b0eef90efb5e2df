"""``sluice inspect``: what a model is and what a memory budget buys, without loading it."""

from __future__ import annotations

from pathlib import Path

from .engine import ModelInfo, Options
from .errors import BudgetError
from .plan import max_parallel
from .storage.urls import mask
from .sysmem import current_rss
from .units import format_size


def format_params(n: int) -> str:
    """A parameter count in K/M/B (10,414,080 -> '10.4 M', 30,532,122,624 -> '30.5 B')."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return str(n)


def inspect_model(path: str | Path, memory: int | None = None, max_context: int | None = None,
                  revision: str | None = None, ca_bundle: str | None = None, parallel: int | None = None,
                  disk_cache: int | str | None = None, disk_cache_dir: str | None = None,
                  progress: bool = False, allow_unversioned_remote: bool = False) -> dict:
    """The model report; ``parallel``: sequences at once (None: the default rule per budget); ``progress``:
    show a remote model's metadata requests on a terminal."""
    opened = Options(ca_bundle=ca_bundle, disk_cache=disk_cache, disk_cache_dir=disk_cache_dir, progress=progress,
                     allow_unversioned_remote=allow_unversioned_remote)
    info = ModelInfo(path, opened, revision=revision)
    try:
        return _report(info, memory, max_context, parallel)
    finally:
        info.close()


def _report(info: ModelInfo, memory: int | None, max_context: int | None, parallel: int | None) -> dict:
    d = info.desc
    total, active = info.param_counts()
    opts = Options(max_context=max_context, parallel=parallel)
    baseline = current_rss()
    # everything resident: the fixed parts, with the floor for ``parallel`` sequences (1 by default)
    base = info.plan(1 << 50, Options(max_context=max_context, parallel=parallel or 1), baseline=baseline)
    expert_bytes = info.experts.record_bytes
    glob, layers = info.spine_split()
    budgets = sorted({base.floor, base.floor_resident, base.working_set_budget,
                      base.budget_for_slots(d.total_experts // 4), base.budget_for_slots(d.total_experts // 2),
                      base.budget_for_slots(d.total_experts)}
                     | ({memory} if memory else set()))
    table = []
    for b in budgets:
        try:
            p = info.plan(b, opts, baseline=baseline)
            table.append({"budget_bytes": b, "cache_experts": p.cache_slots, "ok": True,
                          "below_working_set": p.below_working_set, "prefill_chunk": p.prefill_chunk,
                          "cache_share": p.cache_slots / max(d.total_experts, 1),
                          "streamed_layers": len(p.streamed_layers), "spine_read_per_token": p.spine_streamed_bytes,
                          "parallel": p.parallel,
                          "parallel_max": max_parallel(**info.plan_args(b, opts, baseline=baseline)),
                          "rows_resident": p.rows_resident, "row_bytes": p.row_bytes})
        except BudgetError:
            table.append({"budget_bytes": b, "cache_experts": 0, "ok": False, "cache_share": 0.0,
                          "below_working_set": False, "prefill_chunk": 0,
                          "streamed_layers": 0, "spine_read_per_token": 0, "parallel": 0, "parallel_max": 0,
                          "rows_resident": False, "row_bytes": 0})
    report = {
        "path": mask(str(info.path)),  # a URL's password is never shown
        "model_id": info.model_id,
        "model_type": d.model_type,
        "layers": d.n_layers,
        "moe_layers": len(d.moe_layers),
        "experts_per_layer": d.n_experts,
        "experts_per_token": d.top_k,
        "hidden_size": d.hidden,
        "vocab_size": d.vocab,
        "params_total": total,
        "params_active_per_token": active,
        "expert_format": info.experts.format,
        "expert_lossy": info.expert_loss,  # None: the source checkpoint's own weights
        "container": info.is_container,
        "spine_bytes": info.spine_bytes(),
        "spine_format": info.spine_format,
        "spine_always_resident_bytes": glob,
        "spine_layer_bytes_max": max(layers.values(), default=0),
        "bytes_per_expert": expert_bytes,
        "slot_bytes": base.slot_bytes,
        "experts_total": d.total_experts,
        "expert_bytes_total": expert_bytes * d.total_experts,
        "working_set_experts": d.working_set,
        "working_set_bytes": d.working_set * expert_bytes,
        "max_context": base.max_context,
        "kv_state_bytes": base.seq_state_bytes,  # one sequence's
        "baseline_bytes": baseline,
        "floor_bytes": base.floor,
        "floor_resident_bytes": base.floor_resident,
        "floor_slots": base.floor_slots,  # one step of one layer: top-k + the lookahead's reads in flight
        "working_set_budget_bytes": base.working_set_budget,  # the smallest budget keeping one token's experts
        "budgets": table,
        "notes": list(d.notes),
        # token-keyed tables (rows/): their bytes, and what the planner does with them at each budget
        "row_tables": {name: {"rows": t.rows, "dim": t.dim, "dtype": t.dtype, "bytes": t.nbytes}
                       for name, t in info.row_tables.items()},
        "row_table_bytes": sum(t.nbytes for t in info.row_tables.values()),
    }
    if memory:
        try:
            report["plan"] = info.plan(memory, opts, baseline=baseline).to_dict()
        except BudgetError as e:
            report["plan_error"] = str(e)
    tier = info.disk_tier
    if tier is not None:  # memory -> disk tier -> remote: what the tier holds of this model
        stats = info.checkpoint.stats
        report["disk_tier"] = {"dir": str(tier.dir), "capacity_bytes": tier.capacity, **tier.usage(),
                               "model": {**tier.usage(info.store.location)},
                               "opening": {"hits": stats.tier_hits, "misses": stats.tier_misses,
                                           "bytes_from_tier": stats.tier_bytes,
                                           "bytes_from_remote": stats.remote_bytes}}
    return report


def render_inspect(r: dict) -> str:
    lines = [
        f"{r['model_id']} ({r['path']})",
        f"  family            {r['model_type']}: {r['layers']} layers ({r['moe_layers']} MoE), "
        f"{r['experts_per_layer']} experts/layer, top-{r['experts_per_token']}",
        f"  parameters        {format_params(r['params_total'])} total, "
        f"{format_params(r['params_active_per_token'])} active per token",
        f"  expert format     {r['expert_format']}"
        + (f" (LOSSY: {r['expert_lossy']}; outputs differ from the source model's)" if r.get("expert_lossy") else ""),
        f"  spine             {format_size(r['spine_bytes'])} ({format_size(r['spine_always_resident_bytes'])} always "
        f"resident, largest layer {format_size(r['spine_layer_bytes_max'])})"
        + (f", matrices {r['spine_format']} (lossy)" if r["spine_format"] != "stored" else ""),
        f"  one expert        {format_size(r['bytes_per_expert'])} ({format_size(r['slot_bytes'])} per cache slot)",
        f"  all experts       {r['experts_total']} = {format_size(r['expert_bytes_total'])}",
        f"  one token reads   {r['working_set_experts']} experts = {format_size(r['working_set_bytes'])} (cold)",
        f"  KV/state          {format_size(r['kv_state_bytes'])} for {r['max_context']} tokens, per sequence that "
        "runs at once (--parallel)",
        *([f"  row tables        {len(r['row_tables'])} token-keyed table(s), {format_size(r['row_table_bytes'])}: "
           "resident when they fit in a tenth of the budget above the floor, else read by row through a row "
           "cache of that tenth"] if r.get("row_tables") else []),
        f"  memory floor      {format_size(r['floor_resident_bytes'])} with the whole spine resident "
        f"(baseline {format_size(r['baseline_bytes'])} + spine + one step of one layer's experts: "
        f"{r['floor_slots']} slots + KV + buffers)",
        f"                    {format_size(r['floor_bytes'])} streaming the spine layer by layer "
        "(slower: layers are read every token)",
        f"  working set       {format_size(r['working_set_budget_bytes'])} keeps one token's experts "
        f"({r['working_set_experts']}); below it every token reads its experts again",
        "  budget -> expert cache, sequences at once (default, most), spine streaming:",
    ]
    for b in r["budgets"]:
        if not b["ok"]:
            lines.append(f"    {format_size(b['budget_bytes']):>12}  below the floor: refused")
            continue
        stream = (f", {b['streamed_layers']} layers streamed ({format_size(b['spine_read_per_token'])}/token)"
                  if b["streamed_layers"] else "")
        below = (f", below the working set (prefill chunk {b['prefill_chunk']})"
                 if b["below_working_set"] else "")
        rows = ("" if not r.get("row_tables") else ", row tables resident" if b["rows_resident"] else
                f", row cache {format_size(b['row_bytes'])}")
        lines.append(f"    {format_size(b['budget_bytes']):>12}  {b['cache_experts']:6d} experts "
                     f"({100 * b['cache_share']:5.1f}% of all), parallel {b['parallel']} (at most "
                     f"{b['parallel_max']}){stream}{below}{rows}")
    if "plan" in r:
        p = r["plan"]
        lines.append(f"  --memory plan: cache {p['cache_slots']} experts, "
                     f"{p['parallel']} sequences at once (--parallel), "
                     f"{len(p['streamed_layers'])} layers streamed"
                     + ((", row tables resident" if p["rows_resident"] else
                         f", row tables streamed through a row cache of {format_size(p['row_bytes'])}")
                        if p.get("row_table_bytes") else ""))
    if "plan_error" in r:
        lines.append(f"  --memory: {r['plan_error']}")
    if "disk_tier" in r:
        t, m = r["disk_tier"], r["disk_tier"]["model"]
        o = t["opening"]
        lines.append(f"  disk tier         {t['dir']}: {format_size(t['bytes'])} of {format_size(t['capacity_bytes'])} "
                     f"used ({t['entries']} entries); this model {format_size(m['bytes'])} in {m['entries']} entries, "
                     f"{m['hits']} hits recorded")
        lines.append(f"                    opening it: {o['hits']} tier hits ({format_size(o['bytes_from_tier'])}), "
                     f"{o['misses']} misses, {format_size(o['bytes_from_remote'])} fetched")
    for n in r["notes"]:
        lines.append(f"  note: {n}")
    return "\n".join(lines)
