"""Tensor parallelism over NCCL on two GPUs, every backend, with CUDA graphs capturing the
all-reduces (pytest -m gpu; skipped with fewer than two GPUs)."""

from __future__ import annotations

import pytest
import torch

from pagedgen.attention.registry import backend_status
from pagedgen.cli.verify.model_checks import MODEL_TOL, check_tensor_parallel

pytestmark = pytest.mark.gpu

TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2


def gpu_backends() -> list[str]:
    if not torch.cuda.is_available():
        return ["none"]
    return [s.name for s in backend_status(torch.device("cuda"))
            if s.available and s.name != "eager"]


CASES = [(b, True) for b in gpu_backends()] + [("triton", False)]  # eager: once is enough


@pytest.mark.skipif(not TWO_GPUS, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("backend,graphs", CASES, ids=[f"{b}-{'graphs' if g else 'eager'}"
                                                       for b, g in CASES])
def test_tp2_matches_one_gpu_eager(backend, graphs):
    """bf16, sharded over 2 ranks, against eager attention on one GPU: logits within the
    model-level tolerance at every step whose context agrees, and greedy tokens agreeing."""
    row = check_tensor_parallel(backend, "tiny", "bfloat16", torch.device("cuda"), steps=16,
                                seed=0, tp=2, graphs=graphs)
    print(f"{backend} graphs={graphs}: worst rel {row.worst_rel:.2e} ({row.detail})")
    assert row.tol == MODEL_TOL[torch.bfloat16] and row.passed, row
    same, total = map(int, row.detail.split("agreement ")[1].split(";")[0].split("/"))
    assert same >= 0.9 * total, row.detail
