"""``sluice inspect``: what a model is and what a memory budget buys, without loading it."""

from __future__ import annotations

from pathlib import Path

from .engine import ModelInfo, Options
from .errors import BudgetError
from .sysmem import current_rss
from .units import format_size


def format_params(n: int) -> str:
    """A parameter count in K/M/B (10,414,080 -> '10.4 M', 30,532,122,624 -> '30.5 B')."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return str(n)


def inspect_model(path: str | Path, memory: int | None = None, max_context: int | None = None,
                  revision: str | None = None, ca_bundle: str | None = None) -> dict:
    info = ModelInfo(path, revision=revision, ca_bundle=ca_bundle)
    d = info.desc
    total, active = info.param_counts()
    opts = Options(max_context=max_context)
    baseline = current_rss()
    base = info.plan(1 << 50, opts, baseline=baseline)  # everything resident: the fixed parts
    expert_bytes = info.experts.record_bytes
    glob, layers = info.spine_split()
    budgets = sorted({base.floor, base.floor_resident, base.budget_for_slots(d.total_experts // 4),
                      base.budget_for_slots(d.total_experts // 2), base.budget_for_slots(d.total_experts)}
                     | ({memory} if memory else set()))
    table = []
    for b in budgets:
        try:
            p = info.plan(b, opts, baseline=baseline)
            table.append({"budget_bytes": b, "cache_experts": p.cache_slots, "ok": True,
                          "cache_share": p.cache_slots / max(d.total_experts, 1),
                          "streamed_layers": len(p.streamed_layers), "spine_read_per_token": p.spine_streamed_bytes})
        except BudgetError:
            table.append({"budget_bytes": b, "cache_experts": 0, "ok": False, "cache_share": 0.0,
                          "streamed_layers": 0, "spine_read_per_token": 0})
    report = {
        "path": str(info.path),
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
        "kv_state_bytes": base.state_bytes,
        "baseline_bytes": baseline,
        "floor_bytes": base.floor,
        "floor_resident_bytes": base.floor_resident,
        "budgets": table,
        "notes": list(d.notes),
    }
    if memory:
        try:
            report["plan"] = info.plan(memory, opts, baseline=baseline).to_dict()
        except BudgetError as e:
            report["plan_error"] = str(e)
    info.checkpoint.close()
    return report


def render_inspect(r: dict) -> str:
    lines = [
        f"{r['model_id']} ({r['path']})",
        f"  family            {r['model_type']}: {r['layers']} layers ({r['moe_layers']} MoE), "
        f"{r['experts_per_layer']} experts/layer, top-{r['experts_per_token']}",
        f"  parameters        {format_params(r['params_total'])} total, "
        f"{format_params(r['params_active_per_token'])} active per token",
        f"  expert format     {r['expert_format']}",
        f"  spine             {format_size(r['spine_bytes'])} ({format_size(r['spine_always_resident_bytes'])} always "
        f"resident, largest layer {format_size(r['spine_layer_bytes_max'])})"
        + (f", matrices {r['spine_format']} (lossy)" if r["spine_format"] != "stored" else ""),
        f"  one expert        {format_size(r['bytes_per_expert'])} ({format_size(r['slot_bytes'])} per cache slot)",
        f"  all experts       {r['experts_total']} = {format_size(r['expert_bytes_total'])}",
        f"  one token reads   {r['working_set_experts']} experts = {format_size(r['working_set_bytes'])} (cold)",
        f"  KV/state          {format_size(r['kv_state_bytes'])} for {r['max_context']} tokens",
        f"  memory floor      {format_size(r['floor_resident_bytes'])} with the whole spine resident "
        f"(baseline {format_size(r['baseline_bytes'])} + spine + one token's experts + KV + buffers)",
        f"                    {format_size(r['floor_bytes'])} streaming the spine layer by layer "
        "(slower: layers are read every token)",
        "  budget -> expert cache, spine streaming:",
    ]
    for b in r["budgets"]:
        if not b["ok"]:
            lines.append(f"    {format_size(b['budget_bytes']):>12}  below the floor: refused")
            continue
        stream = (f", {b['streamed_layers']} layers streamed ({format_size(b['spine_read_per_token'])}/token)"
                  if b["streamed_layers"] else "")
        lines.append(f"    {format_size(b['budget_bytes']):>12}  {b['cache_experts']:6d} experts "
                     f"({100 * b['cache_share']:5.1f}% of all){stream}")
    if "plan" in r:
        p = r["plan"]
        lines.append(f"  --memory plan: cache {p['cache_slots']} experts, {len(p['streamed_layers'])} layers streamed")
    if "plan_error" in r:
        lines.append(f"  --memory: {r['plan_error']}")
    for n in r["notes"]:
        lines.append(f"  note: {n}")
    return "\n".join(lines)
