"""Zeroed buffers as large as a KV cache or the recurrent states, which on the CPU cost nothing
until written: ``torch.zeros`` there writes every byte at once (about a second a GiB, every
start), whereas an anonymous mapping is the operating system's zero pages, committed a page at
a time as the run first writes it. Mapped directly, not through ``calloc`` (numpy's
``zeros``): that one clears a chunk it reuses from the heap byte by byte, committing it all
(found in CI, after tests that had freed large engines).
"""

from __future__ import annotations

import math
import mmap

import numpy as np
import torch

ALIGN = 64  # bytes: a cache line at least, where the buffer starts (a mapping: a page)


def zeros(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype,
          device: torch.device | str) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype, device=device)``; on the CPU from zero pages."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    region = mmap.mmap(-1, nbytes)  # anonymous, page-aligned; unmapped with the last view
    return torch.from_numpy(np.frombuffer(region, dtype=np.uint8)).view(dtype).view(shape)
