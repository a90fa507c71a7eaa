"""Zeroed buffers (KV caches, recurrent states): zero, aligned, of the asked shape and dtype,
and on the CPU committed only as they are written."""

from __future__ import annotations

import ctypes
import os
import sys

import pytest
import torch

from pagedgen import buffers


def resident_bytes(t: torch.Tensor) -> int:
    """Resident bytes of ``t``'s own pages (``mincore``): whatever else the process frees or
    takes meanwhile (a collection of an earlier test's engines moved the whole process's
    figure by more than the buffer's), and whatever the kernel merged into its mapping."""
    page = os.sysconf("SC_PAGE_SIZE")
    start = t.data_ptr() // page * page
    length = t.data_ptr() + t.numel() * t.element_size() - start
    pages = (ctypes.c_ubyte * -(-length // page))()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), pages) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(b & 1 for b in bytes(pages)) * page


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_zeros_are_zero_aligned_and_writable(dtype):
    t = buffers.zeros((3, 5, 7), dtype, "cpu")
    assert t.shape == (3, 5, 7) and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % buffers.ALIGN == 0
    assert not t.float().any()
    t[1, 2] = 1
    assert t.float().sum().item() == 7


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="asks Linux's mincore")
def test_a_large_cpu_buffer_commits_memory_only_where_written():
    size = 512 << 20
    t = buffers.zeros((size // 4,), torch.float32, "cpu")
    assert resident_bytes(t) < size // 8  # not written yet: not resident
    t[: size // 16].fill_(1.0)  # a quarter of it written
    assert size // 8 < resident_bytes(t) < size // 2
    del t
