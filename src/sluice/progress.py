"""Progress on stderr for long work: a bar (``Progress``: loading, converting, writing models) and a
running count (``Activity``: a remote model's metadata requests)."""

from __future__ import annotations

import sys
import threading
import time


def fmt_bytes(n: float) -> str:
    for u in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or u == "TB":
            return f"{n:.1f} {u}" if u != "B" else f"{n:.0f} B"
        n /= 1000
    return str(n)


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
        return fmt_bytes(n) if self.unit == "B" else f"{n:.0f}"

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


class Activity:
    """Progress of many small pieces of work with no known total (a remote model's metadata requests).

    ``step(what)`` before a piece (names it on the line), ``done(nbytes, cached=)`` after it. On a
    terminal: one line on stderr, redrawn at most every 0.1 s, naming the piece in hand with the
    pieces and bytes done; ``close()`` ends it with a summary. Nothing at all when ``enabled`` is
    False or stderr is not a terminal (logs and pipes stay clean); calls after ``close`` are ignored.
    """

    def __init__(self, desc: str, enabled: bool = True, noun: str = "requests"):
        self.desc, self.noun = desc, noun
        self.enabled = enabled and sys.stderr.isatty()
        self.count = self.nbytes = self.cached = 0
        self.t0 = time.perf_counter()
        self._last = -1.0
        self._shown = False
        self._closed = False
        self._lock = threading.Lock()

    def _line(self, what: str | None) -> str:
        dt = time.perf_counter() - self.t0
        cached = f", {self.cached} from the local cache" if self.cached else ""
        now = f": {what}" if what else ""
        return f"{self.desc}: {self.count} {self.noun}, {fmt_bytes(self.nbytes)}{cached}, {dt:.1f}s{now}"

    def step(self, what: str) -> None:
        if not self.enabled or self._closed:
            return
        now = time.perf_counter()
        with self._lock:
            if now - self._last < 0.1:
                return
            self._last = now
            self._shown = True
            line = self._line(what)
        sys.stderr.write(f"\r{line[:160]}\x1b[K")
        sys.stderr.flush()

    def done(self, nbytes: int = 0, cached: bool = False) -> None:
        if self._closed:  # the sources live on (expert reads): nothing to count once the work is over
            return
        with self._lock:
            self.count += 0 if cached else 1
            self.cached += 1 if cached else 0
            self.nbytes += nbytes

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.enabled and self._shown:
            sys.stderr.write(f"\r{self._line(None)}\x1b[K\n")
            sys.stderr.flush()
