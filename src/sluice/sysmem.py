"""What the machine allows: available memory, cgroup limits, peak RSS."""

from __future__ import annotations

import os
import resource

def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if text in ("", "max"):
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _cgroup_v2_dir() -> str | None:
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                parts = line.strip().split(":", 2)
                if len(parts) == 3 and parts[0] == "0":
                    return "/sys/fs/cgroup" + parts[2]
    except OSError:
        return None
    return None


def cgroup_limit() -> tuple[int | None, int | None]:
    """The cgroup memory limit of this process and the group's current usage, if any."""
    v2 = _cgroup_v2_dir()
    if v2:
        limit = _read_int(os.path.join(v2, "memory.max"))
        if limit is not None:
            return limit, _read_int(os.path.join(v2, "memory.current"))
    v1 = "/sys/fs/cgroup/memory"
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                parts = line.strip().split(":", 2)
                if len(parts) == 3 and "memory" in parts[1].split(","):
                    cand = v1 + parts[2]
                    if os.path.exists(os.path.join(cand, "memory.limit_in_bytes")):
                        v1 = cand
    except OSError:
        pass
    limit = _read_int(os.path.join(v1, "memory.limit_in_bytes"))
    if limit is not None and limit < (1 << 60):
        return limit, _read_int(os.path.join(v1, "memory.usage_in_bytes"))
    return None, None


def mem_available() -> int:
    """MemAvailable from /proc/meminfo (bytes); physical memory if unreadable."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_budget(share: float = 0.85) -> int:
    """A safe default memory budget: a share of what is available to this process now.

    Respects the cgroup limit (page cache is charged there too) and MemAvailable.
    """
    avail = mem_available()
    limit, usage = cgroup_limit()
    if limit is not None:
        avail = min(avail, limit - (usage or 0) + current_rss())
    return int(avail * share)


def current_rss() -> int:
    """Resident set size of this process now (bytes)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return peak_rss()


def peak_rss() -> int:
    """Peak resident set size of this program so far (bytes).

    Reads VmHWM from /proc/self/status: getrusage's ru_maxrss also counts the parent's
    memory when this process was spawned from a large one (Linux carries the pre-exec
    high-water mark into the child), which would overstate the peak. Falls back to
    getrusage where /proc is unavailable.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
