"""FP8 (e4m3) arithmetic: quantizing weights and activations, and the GEMMs over them.

Scales follow one layout everywhere: a weight ``[N, K]`` in e4m3 has float32 scales
``[N, K_groups]`` (one row of scales per output feature; ``K_groups`` = 1 for per-channel
scales, ``ceil(K / group_k)`` for block scales, whose blocks' rows are expanded to single rows so
that fused and sharded weights concatenate), and ``W ≈ q * scale`` group by group. Activations
are quantized per token (``[M, 1]`` scales) or per token and group of ``group_k`` columns
(``[M, K_groups]``), dynamically, or with one static scale.

GEMMs (``x`` ``[M, K]`` in bf16/fp16, the result in ``x``'s dtype):
* ``rowwise``: per-token activation quantization (a Triton kernel) then ``torch._scaled_mm``
  with row-wise scales (cuBLASLt/CUTLASS FP8 tensor cores); per-channel weights only;
  ``rowwise_fast`` the same with fast accumulation.
* ``triton_w8a8``: activations quantized per token-group, then ``scaled_gemm`` below, which
  multiplies e4m3 tiles on the tensor cores and applies both scales per K group (block weights).
* ``triton_tma``: the same arithmetic as ``triton_w8a8``, its operands' tiles loaded by
  Hopper's tensor memory accelerator into a software pipeline (``scaled_gemm_tma``).
* ``triton_w8a16``: ``scaled_gemm`` with ``x`` as it is and each e4m3 weight tile converted in
  registers (no activation quantization: for small M, where the GEMM is weight-bandwidth-bound).
The torch references (``*_ref``) define the math; the tests run the kernels against them on the
CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import importlib.util
import math
import os
from typing import NamedTuple

import torch

from pagedgen.runtime.quantization.tile_order import tma_fits

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448
MIN_SCALE = 1e-12  # an all-zero group still gets a positive scale
HAVE_TRITON = importlib.util.find_spec("triton") is not None
# Triton's interpreter (CPU tests) casts to e4m3 without carrying a rounded-up mantissa into the
# exponent (31.5 -> 16); there the kernels round to the e4m3 grid themselves first.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


class QuantizedActivations(NamedTuple):
    """Activations already quantized per token (by the kernel that made them: a fused RMSNorm
    or SwiGLU), for an FP8 linear layer: ``q`` [M, K] e4m3, ``scale`` [M, 1] float32."""

    q: torch.Tensor
    scale: torch.Tensor


# ---- references (torch ops) ---------------------------------------------------------------------

def quantize_weight(w: torch.Tensor, group_k: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 ``q`` and float32 scales ``[N, K_groups]`` of ``w`` ``[N, K]``: one scale per row
    (``group_k`` None) or per row and group of ``group_k`` columns; ``amax / 448`` each."""
    n, k = w.shape
    g = k if group_k is None else group_k
    groups = math.ceil(k / g)
    wf = torch.nn.functional.pad(w.float(), (0, groups * g - k)).view(n, groups, g)
    scale = (wf.abs().amax(dim=-1) / E4M3_MAX).clamp(min=MIN_SCALE)
    q = (wf / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).view(n, groups * g)
    return q[:, :k].contiguous(), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
               group_k: int | None = None) -> torch.Tensor:
    """``q * scale`` in ``dtype`` (scales ``[N, K_groups]`` over groups of ``group_k``
    columns; None: one scale per row)."""
    k = q.shape[1]
    s = scale if group_k is None else scale.repeat_interleave(group_k, dim=1)[:, :k]
    return (q.float() * s).to(dtype)


def quantize_activations_ref(x: torch.Tensor, group_k: int | None = None,
                             static_scale: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (or per token-group) dynamic quantization of ``x`` [M, K]; with
    ``static_scale`` (one float32 value), that scale for every token."""
    if static_scale is not None:
        s = static_scale.float().reshape(1, 1).expand(x.shape[0], 1)
        return (x.float() / s).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), s.contiguous()
    return quantize_weight(x, group_k)


def scaled_gemm_ref(a: torch.Tensor, a_scale: torch.Tensor | None, w: torch.Tensor,
                    w_scale: torch.Tensor, out_dtype: torch.dtype,
                    group_k: int | None = None) -> torch.Tensor:
    """``dequant(a) @ dequant(w)^T`` in float32, rounded to ``out_dtype``."""
    a_group = group_k if a_scale is not None and a_scale.shape[1] > 1 else None
    af = a.float() if a_scale is None else dequantize(a, a_scale, torch.float32, a_group)
    return (af @ dequantize(w, w_scale, torch.float32, group_k).t()).to(out_dtype)


# ---- Triton kernels -----------------------------------------------------------------------------

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from pagedgen.runtime.quantization.tile_order import banded_tile

    @triton.jit
    def round_to_e4m3_grid(v):
        """``v`` (float32, within ±448) rounded to the nearest e4m3 value, ties to even."""
        exp = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        step = tl.exp2((tl.maximum(exp, -6) - 3).to(tl.float32))
        magic = 12582912.0  # 1.5 * 2^23: adding and removing it rounds to an integer
        return ((v / step + magic) - magic) * step

    @triton.jit
    def _quant_kernel(X, Q, S, Static, stride_x, stride_q, K, num_groups,
                      GROUP: tl.constexpr, BLOCK: tl.constexpr, STATIC: tl.constexpr,
                      ROUND: tl.constexpr):
        """One program per (token, group): amax → scale → e4m3 values."""
        row = tl.program_id(0)
        g = tl.program_id(1)
        cols = g * GROUP + tl.arange(0, BLOCK)
        mask = (tl.arange(0, BLOCK) < GROUP) & (cols < K)
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        if STATIC:
            s = tl.load(Static)
        else:
            s = tl.maximum(tl.max(tl.abs(x), axis=0) / 448.0, 1e-12)
        q = tl.clamp(x / s, -448.0, 448.0)
        if ROUND:
            q = round_to_e4m3_grid(q)
        tl.store(Q + row * stride_q + cols, q.to(Q.dtype.element_ty), mask=mask)
        tl.store(S + row * num_groups + g, s)

    @triton.jit
    def _scaled_gemm_kernel(A, AS, W, WS, C, M, N, K, group_k, num_groups, a_groups,
                            stride_am, stride_wn, stride_cm,
                            A_QUANT: tl.constexpr, PER_ROW: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """C[M, N] = sum over K groups of (A·W^T)_group × a_scale × w_scale (``PER_ROW``: one
        group, scaled once at the end). BLOCK_K divides ``group_k``: a K tile lies in one
        group."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + rk) < K
            a = tl.load(A + rm[:, None] * stride_am + (k0 + rk)[None, :],
                        mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(W + rn[None, :] * stride_wn + (k0 + rk)[:, None],
                        mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            if A_QUANT:
                part = tl.dot(a, w, out_dtype=tl.float32)
            else:
                part = tl.dot(a, w.to(a.dtype), out_dtype=tl.float32)
            if PER_ROW:
                acc += part
            else:
                g = k0 // group_k
                ws = tl.load(WS + rn * num_groups + g, mask=n_ok, other=0.0)
                if A_QUANT:
                    asc = tl.load(AS + rm * a_groups + g % a_groups, mask=m_ok, other=0.0)
                    acc += part * asc[:, None] * ws[None, :]
                else:
                    acc += part * ws[None, :]
        if PER_ROW:
            acc = acc * tl.load(WS + rn, mask=n_ok, other=0.0)[None, :]
            if A_QUANT:
                acc = acc * tl.load(AS + rm, mask=m_ok, other=0.0)[:, None]
        tl.store(C + rm[:, None] * stride_cm + rn[None, :], acc.to(C.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _scaled_gemm_tma_kernel(a_desc, AS, w_desc, WS, C, M, N, K, group_k, num_groups,
                                a_groups, stride_cm, PER_ROW: tl.constexpr,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                BLOCK_K: tl.constexpr, BAND_M: tl.constexpr):
        """``_scaled_gemm_kernel``'s W8A8 arithmetic, both operands' tiles loaded by TMA
        (``a_desc`` over A [M, K], ``w_desc`` over W [N, K]; past the ends they read as
        zeros). One program per output tile, in bands of ``BAND_M`` row tiles
        (``tile_order.py``)."""
        pid_m, pid_n = banded_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, BAND_M)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = rm < M
        n_ok = rn < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = a_desc.load([pid_m * BLOCK_M, k0])
            w = w_desc.load([pid_n * BLOCK_N, k0])
            if PER_ROW:
                acc = tl.dot(a, w.T, acc)
            else:
                g = k0 // group_k
                ws = tl.load(WS + rn * num_groups + g, mask=n_ok, other=0.0)
                asc = tl.load(AS + rm * a_groups + g % a_groups, mask=m_ok, other=0.0)
                acc += tl.dot(a, w.T) * asc[:, None] * ws[None, :]
        if PER_ROW:
            acc = acc * tl.load(WS + rn, mask=n_ok, other=0.0)[None, :]
            acc = acc * tl.load(AS + rm, mask=m_ok, other=0.0)[:, None]
        tl.store(C + rm[:, None] * stride_cm + rn[None, :], acc.to(C.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


def quantize_activations(x: torch.Tensor, group_k: int | None = None,
                         static_scale: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_activations_ref`` as one Triton kernel launch (x: 2-D, last dim contiguous)."""
    m, k = x.shape
    group = k if group_k is None or static_scale is not None else group_k
    groups = math.ceil(k / group)
    q = torch.empty(m, k, dtype=E4M3, device=x.device)
    s = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    if m:
        _quant_kernel[(m, groups)](
            x, q, s, static_scale if static_scale is not None else s, x.stride(0), q.stride(0),
            k, groups, GROUP=group, BLOCK=triton.next_power_of_2(group),
            STATIC=static_scale is not None, ROUND=INTERPRETED, num_warps=8 if group >= 4096 else 4)
    return q, s


# The GEMM kernel's tiles, "BMxBNxBK": (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages). Small M:
# narrow N tiles, so that many programs stream the weight; large M: wide tiles for reuse.
TILES = {"16x32x256": (16, 32, 256, 4, 4), "16x64x128": (16, 64, 128, 4, 4),
         "32x64x128": (32, 64, 128, 4, 4), "64x64x128": (64, 64, 128, 4, 4),
         "64x128x128": (64, 128, 128, 4, 3), "128x128x128": (128, 128, 128, 8, 3)}


def _fitted_tile(tile: tuple, k: int, group_k: int | None, a_scale: torch.Tensor | None,
                 groups: int) -> tuple[int, tuple]:
    """``group_k`` (None: one group of all ``k`` columns) and ``tile`` with its K tile within
    one group, once the activation scales are checked against the weight's ``groups``."""
    if a_scale is not None and a_scale.shape[1] not in (1, groups):
        raise ValueError(f"activation scales {list(a_scale.shape)} do not match the weight's "
                         f"{groups} K groups")
    bm, bn, bk, warps, stages = tile
    if group_k is None:
        group_k = k
    else:
        bk = min(bk, group_k)
    if group_k != k and group_k % bk:
        raise ValueError(f"K group {group_k} is not a multiple of the kernel's K tile {bk}")
    return group_k, (bm, bn, bk, warps, stages)


def default_tile(m: int) -> str:
    return "16x64x128" if m <= 16 else "64x64x128" if m <= 64 else "128x128x128"


def scaled_gemm(a: torch.Tensor, a_scale: torch.Tensor | None, w: torch.Tensor,
                w_scale: torch.Tensor, out_dtype: torch.dtype,
                group_k: int | None = None, tile: str | None = None) -> torch.Tensor:
    """``scaled_gemm_ref`` as a Triton kernel. ``a``: e4m3 with ``a_scale`` [M, K_groups] (or
    [M, 1]), or bf16/fp16 with ``a_scale`` None; ``w`` [N, K] e4m3 with ``w_scale`` [N,
    K_groups] over groups of ``group_k`` columns (None: per row); ``tile``: a ``TILES`` name
    (None: by M)."""
    m, k = a.shape
    n = w.shape[0]
    groups = w_scale.shape[1]
    group_k, (bm, bn, bk, warps, stages) = _fitted_tile(TILES[tile or default_tile(m)], k,
                                                        group_k, a_scale, groups)
    if m and bk < 16:
        raise ValueError(f"K tile {bk} is below the tensor cores' 16")
    c = torch.empty(m, n, dtype=out_dtype, device=a.device)
    a_groups = a_scale.shape[1] if a_scale is not None else 1
    if m:
        grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
        _scaled_gemm_kernel[grid](
            a, a_scale if a_scale is not None else w_scale, w, w_scale, c, m, n, k,
            group_k, groups, a_groups, a.stride(0), w.stride(0), c.stride(0),
            A_QUANT=a_scale is not None, PER_ROW=groups == 1 and a_groups == 1,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    return c


# The TMA kernel's tiles (same notation). M = 64: narrow tiles, so that at least a program per
# SM streams the weight; M = 256: 64 or 128 rows against N = 4,096's 32-64 column tiles.
TMA_TILES = {"64x32x256": (64, 32, 256, 4, 4), "64x64x128": (64, 64, 128, 4, 4),
             "64x128x128": (64, 128, 128, 4, 4), "128x64x128": (128, 64, 128, 4, 4),
             "128x128x128": (128, 128, 128, 8, 4), "128x256x128": (128, 256, 128, 8, 3)}


def scaled_gemm_tma(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor,
                    w_scale: torch.Tensor, out_dtype: torch.dtype,
                    group_k: int | None = None, tile: str | None = None) -> torch.Tensor:
    """``scaled_gemm`` on quantized activations (e4m3 ``a`` with ``a_scale``), its tiles loaded
    by TMA (``tma_fits`` both operands); ``tile``: a ``TMA_TILES`` name (None: by M)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = a.shape
    n = w.shape[0]
    groups = w_scale.shape[1]
    if not tma_fits(a, w):
        raise ValueError("TMA loads need rows 16-byte aligned (K a multiple of 16)")
    group_k, (bm, bn, bk, warps, stages) = _fitted_tile(
        TMA_TILES[tile or ("64x64x128" if m <= 64 else "64x128x128")], k, group_k, a_scale,
        groups)
    c = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m:
        grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
        _scaled_gemm_tma_kernel[grid](
            TensorDescriptor.from_tensor(a, [bm, bk]), a_scale,
            TensorDescriptor.from_tensor(w, [bn, bk]), w_scale, c, m, n, k, group_k, groups,
            a_scale.shape[1], c.stride(0), PER_ROW=groups == 1 and a_scale.shape[1] == 1,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, BAND_M=8, num_warps=warps, num_stages=stages)
    return c


def rowwise_gemm(xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor,
                 w_scale: torch.Tensor, out_dtype: torch.dtype,
                 fast_accum: bool = False) -> torch.Tensor:
    """``torch._scaled_mm`` with per-token ``x_scale`` [M, 1] and per-channel ``w_scale``
    [N, 1] (CUDA, FP8 tensor cores); ``fast_accum``: Hopper's faster FP8 accumulation, which
    skips the periodic promotion of partial sums to float32 (as vLLM's CUTLASS kernels do)."""
    return torch._scaled_mm(xq, w.t(), scale_a=x_scale, scale_b=w_scale.view(1, -1),
                            out_dtype=out_dtype, use_fast_accum=fast_accum)
