"""How much of this machine's CPU other processes are using, measured over this process's own
start-up: ``start()`` early (the console script calls it before its imports), ``busy_elsewhere``
later. A CPU run sizes torch's thread pool by it (``default_threads``): threads that compete
with a busy process for the same cores spin at every barrier, and a run on 2 cores beside one
busy process ran 2.7x slower with 2 threads than with 1. Imports nothing heavy."""

from __future__ import annotations

import os
import time

_start: tuple[float, float, float] | None = None  # (wall, all cores' busy s, our CPU s)


def _busy_seconds() -> float | None:
    """Seconds every core has spent busy since boot (Linux ``/proc/stat``), or None."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
        ticks = [int(x) for x in fields]
    except (OSError, ValueError):
        return None
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def start() -> None:
    global _start
    busy = _busy_seconds()
    if busy is not None:
        _start = (time.monotonic(), busy, _own_seconds())


def busy_elsewhere(min_window_s: float = 0.25) -> float:
    """Cores kept busy by other processes since ``start()`` (0.0 when unknown or too soon)."""
    if _start is None:
        return 0.0
    t0, busy0, own0 = _start
    window = time.monotonic() - t0
    busy = _busy_seconds()
    if busy is None or window < min_window_s:
        return 0.0
    others = (busy - busy0) - (_own_seconds() - own0)
    return max(0.0, others / window)


def default_threads(cores: int) -> int:
    """torch's intra-op threads for a CPU run on ``cores`` cores: those other processes left
    free (at least 1)."""
    return max(1, cores - int(busy_elsewhere() + 0.5))
