"""The full verify matrix for every GPU backend that runs here (pytest -m gpu)."""

from __future__ import annotations

import pytest
import torch

from pagedgen.attention.registry import backend_status
from pagedgen.cli.verify.runner import verify_backend

pytestmark = pytest.mark.gpu


def gpu_backends() -> list[str]:
    if not torch.cuda.is_available():
        return []
    # flashinfer's and flash-attn's matrices live in their own files (each kernel variant costs
    # a JIT compile there, so those matrices are trimmed)
    return [s.name for s in backend_status(torch.device("cuda"))
            if s.available and s.name not in ("eager", "flashinfer", "flash-attn")]


@pytest.mark.parametrize("name", gpu_backends() or ["none"])
def test_verify_matrix_passes(name):
    if name == "none":
        pytest.skip("no GPU")
    rep = verify_backend(name, torch.device("cuda"), "tiny", "auto", cases=24, steps=16, seed=1)
    for r in rep.rows:
        print(f"{name:10s} {r.group:45s} abs {r.worst_abs:.2e} tol {r.tol:.0e} "
              f"{'pass' if r.passed else 'FAIL'} {r.detail}")
    assert rep.passed
