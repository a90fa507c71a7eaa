"""Named ranges for torch.profiler, free when nobody is profiling.

``scope("normalization")`` marks the kernels launched inside it as belonging to that group in
`pagedgen profile`; outside a profile run it is a no-op context.
"""

from __future__ import annotations

import contextlib

import torch

ENABLED = False
PREFIX = "pg:"  # scope names in traces; phases are "pagedgen.<phase>"

_NULL = contextlib.nullcontext()


def scope(name: str):
    return torch.profiler.record_function(PREFIX + name) if ENABLED else _NULL


@contextlib.contextmanager
def enabled():
    global ENABLED
    old, ENABLED = ENABLED, True
    try:
        yield
    finally:
        ENABLED = old
