"""The tier guard (tests/tiers.py): where there is no GPU, a test that starts a process or
interprets a Triton kernel without its mark fails, naming the mark; with the mark it runs."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys

import pytest
from tiers import TierError

GUARDED = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                             reason="the guard stands where there is no GPU (as in CI)")


@GUARDED
def test_an_unmarked_test_starts_no_process():
    with pytest.raises(TierError, match="@pytest.mark.process"):
        subprocess.run([sys.executable, "-c", "pass"])
    with pytest.raises(TierError, match="@pytest.mark.process"):
        multiprocessing.get_context("spawn").Process(target=print).start()


@GUARDED
def test_an_unmarked_test_interprets_no_kernel():
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def one(X):
        tl.store(X, 1.0)

    x = torch.zeros(1)
    with pytest.raises(TierError, match="@pytest.mark.kernels"):
        one[(1,)](x)
    assert x.item() == 0.0


@pytest.mark.process
def test_a_process_test_starts_processes():
    assert subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True,
                          text=True).stdout.strip() == "42"
