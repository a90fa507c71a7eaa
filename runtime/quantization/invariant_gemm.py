"""The dense GEMM ``x W^T (+ b)`` whose every output row is the same bits whatever the other
rows (``--batch-invariant``, issue 97).

cuBLAS (and MKL) choose tiles, split-K and even the algorithm by the problem's shape, so a
row's sums take another order when the batch has more or fewer rows. On a GPU every program
makes one fixed tile of ``BLOCK_M`` rows by ``BLOCK_N`` columns, its K loop in the same order
for any row count, no split-K, the tensor cores summing each element alike wherever its row
sits: a row's result depends on that row alone. On a CPU each row is its own product (a
BLAS's rounding also follows where a row sits in its register block, so tiles would not do).
Hand-written: torch has no GEMM with a fixed reduction order (vLLM's and SGLang's
batch-invariant modes carry their own Triton GEMMs for the same reason). Not tuned yet: a first
kernel, its speed unmeasured.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except ImportError:  # pragma: no cover - a torch without Triton
    HAVE_TRITON = False

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64

if HAVE_TRITON:
    @triton.jit
    def _gemm_kernel(X, W, B, Out, M, N, K, stride_xm, stride_wn, stride_om,
                     HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
        pm, pn = tl.program_id(0), tl.program_id(1)
        rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            x = tl.load(X + rm[:, None] * stride_xm + kk[None, :],
                        mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
            w = tl.load(W + rn[None, :] * stride_wn + kk[:, None],
                        mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(B + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(Out + rm[:, None] * stride_om + rn[None, :], acc.to(Out.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))


def by_rows(op, x: torch.Tensor, *args):
    """``op`` a row at a time, a row's result its own: on a CPU a BLAS rounds a row by its place
    in the register block, and torch's exp and tanh by a value's place in the tensor (SIMD lane
    or scalar tail), so a row's bits would follow the rows around it."""
    return torch.cat([op(row, *args) for row in x.split(1)]) if len(x) else op(x, *args)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     out: torch.Tensor | None = None, tiles: bool | None = None) -> torch.Tensor:
    """``x W^T (+ b)`` in fixed tiles on a GPU, a row at a time on a CPU (``x``: [..., K],
    ``weight``: [N, K]); into ``out`` ([rows, N]) when given. ``tiles`` forces the tiled
    kernel (Triton's interpreter on a CPU: the tests)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if not (x.is_cuda if tiles is None else tiles):
        got = by_rows(torch.nn.functional.linear, x2, weight, bias)
        if out is not None:
            out.copy_(got)
            got = out
        return got.reshape(*shape[:-1], weight.shape[0])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    m, k = x2.shape
    n = w.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
        _gemm_kernel[grid](x2, w, bias if bias is not None else w, out, m, n, k,
                           x2.stride(0), w.stride(0), out.stride(0), HAS_BIAS=bias is not None,
                           BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                           PRECISION="ieee" if x.dtype == torch.float32 else "tf32")
    return out.reshape(*shape[:-1], n)
