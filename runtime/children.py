"""Worker processes end with the process that started them, however it ends (a SIGKILL of
the parent included, which runs no clean-up): on Linux the kernel kills them
(``PR_SET_PDEATHSIG``); everywhere a watchdog thread sees the parent gone within a second.
A worker left running would hold its GPU's memory and the run's CPU."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1
WATCH_INTERVAL_S = 1.0


def die_with_parent() -> None:
    """Call first thing in a worker process."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
        except (OSError, AttributeError):  # no prctl: the watchdog alone
            pass
    if os.getppid() != parent or parent == 1:  # the parent died before we could ask
        os._exit(1)
    threading.Thread(target=_watch, args=(parent,), name="parent-watchdog",
                     daemon=True).start()


def _watch(parent: int) -> None:
    while True:
        time.sleep(WATCH_INTERVAL_S)
        if os.getppid() != parent:
            os._exit(1)
