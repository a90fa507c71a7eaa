"""Zeroed buffers as large as a KV cache or the recurrent states, which on the CPU cost nothing
until written: ``torch.zeros`` there writes every byte at once (about a second a GiB, every
start), whereas memory from the operating system's zero pages (numpy's ``zeros``: ``calloc``)
is zero already and is committed a page at a time as the run first writes it.
"""

from __future__ import annotations

import math

import numpy as np
import torch

ALIGN = 64  # bytes: a cache line, where the buffer starts


def zeros(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype,
          device: torch.device | str) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype, device=device)``; on the CPU from zero pages."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = torch.from_numpy(np.zeros(nbytes + ALIGN, dtype=np.uint8))
    start = -raw.data_ptr() % ALIGN
    return raw[start:start + nbytes].view(dtype).view(shape)
