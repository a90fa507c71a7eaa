"""When the run began, for the start-up figure: the first line of the ``pagedgen`` command
(``cli/main.py``) or the Python API's ``LLM()``. Not the process's own start: a shell runs its
last command in its own process (``bash -c 'sleep 20 && pagedgen ...'``), whose age then
counts the 20 s before it. What the interpreter did before that first line (tens of
milliseconds) is left out."""

from __future__ import annotations

import time

_started: float | None = None


def mark() -> None:
    """The run begins now (``time.time()``)."""
    global _started
    _started = time.time()


def started() -> float | None:
    """When it began, or None where nothing marked it (an engine built directly)."""
    return _started
