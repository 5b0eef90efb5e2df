"""A small progress bar on stderr for long work (loading, converting, writing models)."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, desc: str, unit: str = "B", enabled: bool = True):
        self.total, self.desc, self.unit = max(total, 1), desc, unit
        self.enabled = enabled
        self.done = 0
        self.t0 = time.perf_counter()
        self._last = 0.0
        self._tty = sys.stderr.isatty()
        self._last_pct = -1

    def _fmt(self, n: float) -> str:
        if self.unit != "B":
            return f"{n:.0f}"
        for u in ("B", "KB", "MB", "GB", "TB"):
            if n < 1000 or u == "TB":
                return f"{n:.1f} {u}" if u != "B" else f"{n:.0f} B"
            n /= 1000
        return str(n)

    def update(self, n: int) -> None:
        self.done += n
        if not self.enabled:
            return
        now = time.perf_counter()
        pct = int(100 * self.done / self.total)
        if self._tty and (now - self._last > 0.1 or self.done >= self.total):
            self._last = now
            rate = self.done / max(now - self.t0, 1e-9)
            bar = "#" * (pct // 4) + "." * (25 - pct // 4)
            eta = (self.total - self.done) / rate if rate > 0 else 0
            sys.stderr.write(f"\r{self.desc} [{bar}] {pct:3d}% {self._fmt(self.done)}/{self._fmt(self.total)}"
                             f" {self._fmt(rate)}/s eta {eta:4.0f}s ")
            sys.stderr.flush()
        elif not self._tty and pct // 25 != self._last_pct // 25:
            self._last_pct = pct
            rate = self.done / max(now - self.t0, 1e-9)
            eta = f", eta {(self.total - self.done) / rate:.0f}s" if 0 < self.done < self.total else ""
            sys.stderr.write(f"{self.desc}: {pct}% ({self._fmt(self.done)}/{self._fmt(self.total)}{eta})\n")

    def close(self) -> None:
        if self.enabled and self._tty:
            dt = time.perf_counter() - self.t0
            sys.stderr.write(f"\r{self.desc}: {self._fmt(self.done)} in {dt:.1f}s" + " " * 40 + "\n")
            sys.stderr.flush()
