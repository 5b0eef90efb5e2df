"""The memory budget is a promise: peak RSS stays under it, or Sluice refuses to start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

import sluice
from conftest import BUDGET

# The child reports its peak RSS as VmHWM: getrusage's ru_maxrss in a child also carries the
# parent's (pytest's) high-water mark across exec on Linux (see test_peak_rss_ignores_the_parent).
RUNNER = r"""
import json, sys, sluice
from sluice.sysmem import peak_rss
engine = sluice.load(sys.argv[1], memory=int(sys.argv[2]), max_context=1024, progress=False)
r = engine.generate(list(range(3, 260)), max_new_tokens=12, ignore_eos=True)
print(json.dumps({"peak": peak_rss(), "stats": r.stats, "plan": engine.plan.to_dict()}))
"""


def _run(cmd: list[str]) -> dict:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_peak_rss_under_budget(big_model):
    path, size = big_model
    assert size >= 3 * BUDGET
    res = _run([sys.executable, "-c", RUNNER, str(path), str(BUDGET)])
    assert res["peak"] <= BUDGET, f"peak RSS {res['peak'] / 2**20:.0f} MiB > budget {BUDGET / 2**20:.0f} MiB"
    assert res["stats"]["peak_rss_bytes"] <= BUDGET
    assert res["plan"]["cache_slots"] < res["plan"]["total_experts"] / 3  # really streaming
    assert res["stats"]["bytes_read"] > 0 and res["stats"]["expert_misses"] > 0


def test_peak_rss_ignores_the_parent():
    """VmHWM measures the child program alone; ru_maxrss would report the large parent's peak."""
    ballast = bytearray(300 << 20)
    for i in range(0, len(ballast), 4096):
        ballast[i] = 1
    script = ("import resource; from sluice.sysmem import peak_rss; "
              "print(peak_rss(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    vmhwm, maxrss = map(int, out.stdout.split())
    assert vmhwm < 300 << 20, (f"peak_rss() {vmhwm >> 20} MiB includes the parent's memory "
                               f"(ru_maxrss {maxrss >> 20} MiB)")
    del ballast


def _cgroup_v1() -> Path | None:
    root = Path("/sys/fs/cgroup/memory")
    if not (root / "memory.limit_in_bytes").exists() or not os.access(root, os.W_OK):
        return None
    return root


def test_cgroup_limit_holds(big_model):
    """Under a cgroup limit equal to the budget (page cache charged too) the run never hits the limit."""
    root = _cgroup_v1()
    if root is None:
        pytest.skip("cgroup v1 memory controller not writable here (needs root); RSS test above still runs")
    path, _ = big_model
    group = root / f"sluice-test-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(BUDGET))
        script = f'echo $$ > {group}/cgroup.procs && exec "$0" -c "$1" "$2" "$3"'
        res = _run(["sh", "-c", script, sys.executable, RUNNER, str(path), str(BUDGET)])
        assert res["peak"] <= BUDGET
        failcnt = int((group / "memory.failcnt").read_text())
        max_usage = int((group / "memory.max_usage_in_bytes").read_text())
        assert failcnt == 0, f"the cgroup limit was hit {failcnt} times (max usage {max_usage / 2**20:.0f} MiB)"
    finally:
        for _ in range(50):
            try:
                group.rmdir()
                break
            except OSError:
                import time

                time.sleep(0.1)


def test_budget_below_floor_is_refused(big_model):
    path, _ = big_model
    with pytest.raises(sluice.BudgetError) as e:
        sluice.load(path, memory="300MiB", max_context=1024, progress=False)
    msg = str(e.value)
    assert "memory budget 300.00 MiB is below the floor" in msg
    assert "one step of one layer's experts (top-2 + 2 lookahead reads = 4 x" in msg
    assert "Raise --memory to at least" in msg and "keeps one token's working set of 16 experts" in msg


def test_cache_experts_must_fit_budget(big_model):
    path, _ = big_model
    from sluice.sysmem import current_rss

    budget = current_rss() + (400 << 20)  # above the floor of this process, far below 1000 experts
    with pytest.raises(sluice.BudgetError, match="cannot hold a cache of 1000 experts"):
        sluice.load(path, memory=budget, cache_experts=1000, max_context=1024, progress=False)
    with pytest.raises(sluice.BudgetError, match="below the 2 experts one layer uses at once"):
        sluice.load(path, memory="2GiB", cache_experts=1, max_context=1024, progress=False)
