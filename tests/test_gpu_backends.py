"""The full verify matrix for every GPU backend that runs here (pytest -m gpu)."""

from __future__ import annotations

import pytest
import torch

from pagedgen.attention.cases import make_paged_batch, run_backend
from pagedgen.attention.metadata import ScheduledSeq
from pagedgen.attention.registry import backend_status, get_backend
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


def test_triton_attention_reads_pages_past_two_to_the_31_elements():
    """One layer's cache passes 2**31 elements on a big GPU when a model has few attention
    layers (Qwen3.5's hybrid: a quarter of its layers; small models), and CUDA-graph padding
    reads its last page: the kernels' page offsets are 64-bit (they overflowed to a negative
    address, an illegal memory access, before). The same pages far into the cache give the
    same output as at its start."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    backend = get_backend("triton", torch.device("cuda"))
    near = make_paged_batch(3, dtype=torch.float16, device="cuda")
    want, _ = run_backend(backend, near)
    skip = 2**31 // near.kv_cache[0].numel() + 1  # pages before the batch's first one
    far = near.kv_cache.new_zeros(skip + near.kv_cache.shape[0], *near.kv_cache.shape[1:])
    far[skip:] = near.kv_cache

    def shifted(seqs: list[ScheduledSeq]) -> list[ScheduledSeq]:
        return [ScheduledSeq([b + skip for b in s.block_table], s.num_context, s.num_new)
                for s in seqs]
    near.kv_cache, near.prefills, near.decodes = far, shifted(near.prefills), \
        shifted(near.decodes)
    got, _ = run_backend(backend, near)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
