"""The order a GEMM's programs take their output tiles in: bands of ``BAND_M`` row tiles, a
band's programs next to each other sharing a weight tile, which DRAM then sends once. Shared by
the FP8 GEMM (``fp8/kernels.py``) and the batch-invariant GEMM (``invariant_gemm.py``); the
order changes no tile's arithmetic. Also what both ask before loading tiles by TMA."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except ImportError:  # pragma: no cover - a torch without Triton
    HAVE_TRITON = False

if HAVE_TRITON:
    @triton.jit
    def banded_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BAND_M: tl.constexpr):
        """Program ``pid``'s output tile: (row tile, column tile)."""
        tiles_m = tl.cdiv(M, BLOCK_M)
        band = BAND_M * tl.cdiv(N, BLOCK_N)
        first_m = (pid // band) * BAND_M
        rows = tl.minimum(tiles_m - first_m, BAND_M)
        return first_m + (pid % band) % rows, (pid % band) // rows


def tma_fits(*tensors: torch.Tensor) -> bool:
    """Whether TMA can load these 2-D tensors: rows contiguous, 16-byte aligned."""
    return all(t.dim() == 2 and t.stride(1) == 1 and t.stride(0) * t.element_size() % 16 == 0
               and t.data_ptr() % 16 == 0 for t in tensors)
