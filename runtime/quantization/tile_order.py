"""The order a GEMM's programs take their output tiles in: bands of ``BAND_M`` row tiles, a
band's programs next to each other sharing a weight tile, which DRAM then sends once. Shared by
the FP8 GEMM (``fp8/kernels.py``) and the batch-invariant GEMM (``invariant_gemm.py``); the
order changes no tile's arithmetic."""

from __future__ import annotations

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
