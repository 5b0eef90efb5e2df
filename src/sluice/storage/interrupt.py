"""Stopping remote reads in flight: a read waits in bounded slices, never inside the client for good.

A remote GET (``remote.RemoteSource``) runs in a short-lived daemon thread; the reading thread
waits for it in slices of ``SLICE_S`` and, between them, checks one process-wide event. When
``interrupt_reads(reason)`` sets it (``sluice serve`` does on SIGTERM/SIGINT, before its grace
period), every read in flight and every later one raises ``ReadInterruptedError`` naming the
reason within a slice, however long the server stalls; the request that waited on it ends with a
503 naming shutdown, and the process exits (the abandoned client thread is a daemon). The wait is
also where Ctrl-C reaches a ``sluice run`` whose read stalls. ``resume_reads()`` clears the event
(a server run in a thread of a longer-lived process, ended).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
SLICE_S = 0.05  # the longest a read goes on after an interrupt

_event = threading.Event()
_reason = ["reads were interrupted"]


class ReadInterruptedError(OSError):
    """A remote read stopped because the process is shutting down (``interrupt_reads``)."""


def interrupt_reads(reason: str) -> None:
    """Stop every remote read in flight and refuse new ones, naming ``reason``."""
    _reason[0] = reason
    _event.set()


def resume_reads() -> None:
    _event.clear()


def interrupted() -> str | None:
    """The reason reads are interrupted, or None."""
    return _reason[0] if _event.is_set() else None


def call(fn: Callable[[], T], what: str) -> T:
    """``fn()`` (a blocking client call) in a daemon thread, waited for in slices; ``ReadInterruptedError``
    naming ``what`` as soon as reads are interrupted. ``fn``'s own exception is raised here."""
    if _event.is_set():
        raise ReadInterruptedError(f"{what}: stopped: {_reason[0]}")
    box: dict = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            box["error"] = e
        finally:
            done.set()

    threading.Thread(target=run, name="sluice-remote-read", daemon=True).start()
    while not done.wait(SLICE_S):
        if _event.is_set():
            raise ReadInterruptedError(f"{what}: stopped: {_reason[0]}")
    if "error" in box:
        raise box.pop("error")
    return box["value"]


__all__ = ["ReadInterruptedError", "SLICE_S", "call", "interrupt_reads", "interrupted", "resume_reads"]
