"""MXFP4 weights meeting the grouped GEMM's tensor cores (Triton device functions for
``moe_kernels``): e2m1 codes and e8m0 scales turned into ``bf16`` / ``fp16`` tiles in
registers, in either orientation, or handed as they are to ``tl.dot_scaled``; and
``dequantize``, which writes a run of experts out dense (prefill chunks:
``moe_dequantized``). Imported only where Triton is."""

import torch
import triton
import triton.language as tl


@triton.jit
def e2m1_values(packed, exp, dtype):
    """MXFP4 bytes (two e2m1 codes, the low nibble first) and their e8m0 scales (a power of
    two, biased by 127), int32 of one shape: (low values, high values) in ``dtype``. By
    bits alone: a code's exponent and mantissa bits moved into a float16's (its exponent
    field 0-3: 0.5 is a subnormal) read 2^-14 times the value, and the scale times 2^14
    is a float32 made from its exponent."""
    scale = ((tl.minimum(exp, 240) + 14) << 23).to(tl.float32, bitcast=True)
    lo = (((packed & 7) << 9) | ((packed & 8) << 12)).to(tl.int16)
    hi = (((packed & 0x70) << 5) | ((packed & 0x80) << 8)).to(tl.int16)
    return ((lo.to(tl.float16, bitcast=True).to(tl.float32) * scale).to(dtype),
            (hi.to(tl.float16, bitcast=True).to(tl.float32) * scale).to(dtype))


@triton.jit
def mxfp4_tile(b_at, s_at, kb, offs_n, n_ok, K, stride_bn, num_groups, dtype):
    """B's [BLOCK_K, BLOCK_N] tile at byte columns ``kb`` (contiguous: loads of whole
    runs) from MXFP4: bytes [N, K / 2] and e8m0 scales [N, K / 32]; (low nibbles, high
    nibbles) in ``dtype``, each [BLOCK_K / 2, BLOCK_N]."""
    ok = (kb < K // 2)[:, None] & n_ok[None, :]
    packed = tl.load(b_at + offs_n[None, :] * stride_bn + kb[:, None], mask=ok,
                     other=0).to(tl.int32)
    exp = tl.load(s_at + offs_n[None, :] * num_groups + (kb // 16)[:, None], mask=ok,
                  other=127).to(tl.int32)
    return e2m1_values(packed, exp, dtype)


@triton.jit
def mxfp4_rows(b_at, s_at, k0, offs_n, n_ok, K, stride_bn, num_groups, dtype,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The weights' rows ``offs_n`` at columns [k0, k0 + BLOCK_K) from MXFP4, [BLOCK_N,
    BLOCK_K] in ``dtype`` (the swapped product's left operand, in registers): each row's
    bytes loaded whole, a scale once per 32 columns."""
    kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    g = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    packed = tl.load(b_at + offs_n[:, None] * stride_bn + kb[None, :],
                     mask=n_ok[:, None] & (kb < K // 2)[None, :], other=0).to(tl.int32)
    exps = tl.load(s_at + offs_n[:, None] * num_groups + g[None, :],
                   mask=n_ok[:, None] & (g < num_groups)[None, :], other=127).to(tl.int32)
    exp = tl.reshape(tl.broadcast_to(exps[:, :, None], (BLOCK_N, BLOCK_K // 32, 16)),
                     (BLOCK_N, BLOCK_K // 2))
    lo, hi = e2m1_values(packed, exp, dtype)
    return tl.interleave(lo, hi)


@triton.jit
def mxfp4_operands(b_at, s_at, k0, offs_n, n_ok, K, stride_bn, num_groups,
                   BLOCK_K: tl.constexpr):
    """``tl.dot_scaled``'s B operands at columns [k0, k0 + BLOCK_K): the packed codes
    [BLOCK_K / 2, BLOCK_N] (along K) and the e8m0 scales [BLOCK_N, BLOCK_K / 32]."""
    kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    g = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    codes = tl.load(b_at + offs_n[None, :] * stride_bn + kb[:, None],
                    mask=(kb < K // 2)[:, None] & n_ok[None, :], other=0)
    exps = tl.load(s_at + offs_n[:, None] * num_groups + g[None, :],
                   mask=n_ok[:, None] & (g < num_groups)[None, :], other=127)
    return codes, exps


@triton.jit
def _dequantize_kernel(b_ptr, s_ptr, out_ptr, rows, K, stride_b, num_groups, stride_o,
                       BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    k0 = tl.program_id(1) * BLOCK_K
    ok = r < rows
    w = mxfp4_rows(b_ptr, s_ptr, k0, r, ok, K, stride_b, num_groups,
                   out_ptr.dtype.element_ty, BLOCK_R, BLOCK_K)
    cols = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + r[:, None].to(tl.int64) * stride_o + cols[None, :], w,
             mask=ok[:, None] & (cols < K)[None, :])


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """MXFP4 rows (``blocks`` [..., R, K / 2] codes, ``scales`` [..., R, K / 32] exponents,
    contiguous) written dense into ``out`` [..., R, K] (its dtype: bf16, fp16 or float32)."""
    k = blocks.shape[-1] * 2
    b, s, o = blocks.reshape(-1, k // 2), scales.reshape(-1, k // 32), out.view(-1, k)
    block_r, block_k = 32, 128
    grid = (triton.cdiv(b.shape[0], block_r), triton.cdiv(k, block_k))
    _dequantize_kernel[grid](b, s, o, b.shape[0], k, b.stride(0), s.shape[1], o.stride(0),
                             BLOCK_R=block_r, BLOCK_K=block_k)
    return out
