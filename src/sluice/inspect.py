"""``sluice inspect``: what a model is and what a memory budget buys, without loading it."""

from __future__ import annotations

from pathlib import Path

from .engine import ModelInfo, Options
from .errors import BudgetError
from .sysmem import current_rss
from .units import format_size


def inspect_model(path: str | Path, memory: int | None = None, max_context: int | None = None) -> dict:
    info = ModelInfo(path)
    d = info.desc
    total, active = info.param_counts()
    opts = Options(max_context=max_context, cache_experts=d.top_k)
    base = info.plan(10**15, opts, baseline=current_rss())  # fixed parts; budget irrelevant here
    floor = base.floor
    expert_bytes = info.experts.record_bytes
    budgets = sorted({floor, base.budget_for_slots(d.total_experts // 4), base.budget_for_slots(d.total_experts // 2),
                      base.budget_for_slots(d.total_experts)} | ({memory} if memory else set()))
    table = []
    for b in budgets:
        slots = base.slots_for(b)
        table.append({"budget_bytes": b, "cache_experts": slots, "cache_share": slots / max(d.total_experts, 1),
                      "ok": b >= floor})
    report = {
        "path": str(path),
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
        "spine_bytes": info.spine_bytes(),
        "bytes_per_expert": expert_bytes,
        "slot_bytes": base.slot_bytes,
        "experts_total": d.total_experts,
        "expert_bytes_total": expert_bytes * d.total_experts,
        "working_set_experts": d.working_set,
        "working_set_bytes": d.working_set * expert_bytes,
        "max_context": base.max_context,
        "kv_state_bytes": base.state_bytes,
        "baseline_bytes": base.baseline,
        "floor_bytes": floor,
        "budgets": table,
        "notes": list(d.notes),
    }
    if memory:
        try:
            report["plan"] = info.plan(memory, Options(max_context=max_context)).to_dict()
        except BudgetError as e:
            report["plan_error"] = str(e)
    info.checkpoint.close()
    return report


def render_inspect(r: dict) -> str:
    lines = [
        f"{r['path']}",
        f"  family            {r['model_type']}: {r['layers']} layers ({r['moe_layers']} MoE), "
        f"{r['experts_per_layer']} experts/layer, top-{r['experts_per_token']}",
        f"  parameters        {r['params_total'] / 1e9:.3f} B total, {r['params_active_per_token'] / 1e9:.3f} B "
        "active per token",
        f"  expert format     {r['expert_format']}",
        f"  spine (resident)  {format_size(r['spine_bytes'])}",
        f"  one expert        {format_size(r['bytes_per_expert'])} ({format_size(r['slot_bytes'])} per cache slot)",
        f"  all experts       {r['experts_total']} = {format_size(r['expert_bytes_total'])}",
        f"  one token reads   {r['working_set_experts']} experts = {format_size(r['working_set_bytes'])} (cold)",
        f"  KV/state          {format_size(r['kv_state_bytes'])} for {r['max_context']} tokens",
        f"  memory floor      {format_size(r['floor_bytes'])} (baseline {format_size(r['baseline_bytes'])} "
        "+ spine + one token's experts + KV + buffers)",
        "  budget -> expert cache:",
    ]
    for b in r["budgets"]:
        mark = "" if b["ok"] else "  (below floor: refused)"
        lines.append(f"    {format_size(b['budget_bytes']):>12}  {b['cache_experts']:6d} experts "
                     f"({100 * b['cache_share']:5.1f}% of all){mark}")
    if "plan_error" in r:
        lines.append(f"  --memory: {r['plan_error']}")
    for n in r["notes"]:
        lines.append(f"  note: {n}")
    return "\n".join(lines)
