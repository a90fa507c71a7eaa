"""Worker processes end with the process that started them, however it ends (a SIGKILL of
the parent included, which runs no clean-up): on Linux the kernel kills them
(``PR_SET_PDEATHSIG``); everywhere a watchdog thread sees the parent gone within a second.
A worker left running would hold its GPU's memory and the run's CPU.

A forkserver's child names the process that asked for it: its own parent is the server,
which outlives that process while any of its children live, so a thread waits on the
named process itself (a pidfd where Linux has one, else a poll every second)."""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1
WATCH_INTERVAL_S = 1.0


def die_with_parent(parent: int | None = None) -> None:
    """Call first thing in a worker process; ``parent``: the process to end with, when it
    is not this one's parent (a forkserver's child)."""
    if parent is not None and parent != os.getppid():
        threading.Thread(target=_wait_for_exit, args=(parent,), name="parent-watchdog",
                         daemon=True).start()
        return
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


def _wait_for_exit(pid: int) -> None:
    """Ends this process when ``pid`` has exited (a zombie included: it has exited)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:  # gone already
        os._exit(1)
    except (AttributeError, OSError):  # no pidfd here: poll
        while _running(pid):
            time.sleep(WATCH_INTERVAL_S)
        os._exit(1)
    select.select([fd], [], [])
    os._exit(1)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] not in "ZX"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
