"""Zeroed buffers (KV caches, recurrent states): zero, aligned, of the asked shape and dtype,
and on the CPU committed only as they are written."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from pagedgen import buffers


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_zeros_are_zero_aligned_and_writable(dtype):
    t = buffers.zeros((3, 5, 7), dtype, "cpu")
    assert t.shape == (3, 5, 7) and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % buffers.ALIGN == 0
    assert not t.float().any()
    t[1, 2] = 1
    assert t.float().sum().item() == 7


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_a_large_cpu_buffer_commits_memory_only_where_written():
    size = 512 << 20
    before = resident_bytes()
    t = buffers.zeros((size // 4,), torch.float32, "cpu")
    assert resident_bytes() - before < size // 8  # not written yet: not resident
    t[: size // 16].fill_(1.0)  # a quarter of it written
    grown = resident_bytes() - before
    assert size // 8 < grown < size // 2
    del t
