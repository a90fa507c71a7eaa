"""MXFP4 weights meeting the grouped GEMM's tensor cores (Triton device functions for
``moe.kernels``): e2m1 codes and e8m0 scales turned into ``bf16`` / ``fp16`` tiles in
registers, in either orientation, or handed as they are to ``tl.dot_scaled``; and
``dequantize``, which writes a run of experts out dense (prefill chunks:
``moe.dequantized``). Imported only where Triton is.

They read the experts' kernel layout (``mxfp4.to_kernel_layout``): each scale group's 16
bytes of codes stored as a transposed 4 x 4 matrix of bytes, which a tile's reshape and
permute undo in registers (Hopper's MMA gives each thread bytes t, t + 4, t + 8 and t + 12 of
a group: stored so, they are one 32-bit word, and a K step's tile reaches the MMA's registers
through ``ldmatrix``, not a byte at a time); the exponents stored group-major ([groups,
rows]), so a K step's scales for a tile of rows are one contiguous run, loaded ahead with the
codes (four rows a 32-bit word where a tile's are few: ``exps_in_words``).

On the GPU, bf16 tiles come from ``e2m1_bf16``: PTX working on two values per 32-bit
register (three integer operations place two codes' bits in a bf16 pair, two bf16x2
multiplies scale them, or one where every exponent of the experts is at most
``mxfp4.FOLD_MAX_EXPONENT``: ``FOLDED``), where Triton's per-value arithmetic spends about ten
instructions a value. Triton's interpreter runs the per-value way (``e2m1_values``)."""

import torch
import triton
import triton.language as tl

from pagedgen.runtime.quantization.fp8.kernels import INTERPRETED

# Two bytes of codes, one in each 16-bit half of a word (a ``prmt``): a nibble masked out and
# multiplied by the sum of two powers of two lands its exponent and mantissa bits at a bf16's
# bits 6-8 (the exponent's low two bits and the mantissa's top one) and its sign at bit 15;
# KEEP clears the copies between. The bits read 2^-126 times the code's value (0.5 a
# subnormal), which UNBIAS (2^126) restores before the group's scale 2^(e - 127) multiplies:
# exact for every e but 0 (2^-127, below bf16's normal range: that group's values, at most
# 6 * 2^-127, read as zeros; an all-zero group, which quantizers give e = 0, is exact).
LO_MASK, LO_MUL = 0x000F000F, (1 << 6) + (1 << 12)
HI_MASK, HI_MUL = 0x00F000F0, (1 << 2) + (1 << 8)
KEEP = 0x81C081C0
UNBIAS = 0x7E807E80  # 2^126 in both bf16 halves
# FOLDED: each exponent e made the bf16 2^(e - 1) = 2^126 * 2^(e - 127) at once,
# (e << 7) + FOLD_BIAS, so one multiply scales and unbiases; finite while e + 126 < 255
FOLD_BIAS = 0x3F003F00  # 126 << 7 in both halves (e up to mxfp4.FOLD_MAX_EXPONENT)


def _pair_asm(half: int, folded: bool) -> str:
    """PTX for bytes ``2 * half`` and ``2 * half + 1`` of $4 (codes) and $5 (exponents):
    their low nibbles' bf16 pair into ``$half``, their high nibbles' into ``$(2 + half)``."""
    sel = "0x4342" if half else "0x4140"
    scale = f"mad.lo.u32 s, s, 128, {FOLD_BIAS:#x};" if folded else "shl.b32 s, s, 7;"
    unbias = "" if folded else "fma.rn.bf16x2 v, v, k, z;"
    return f"""
    prmt.b32 t, $4, 0, {sel};
    prmt.b32 s, $5, 0, {sel};
    {scale}
    and.b32 v, t, {LO_MASK:#x};
    mul.lo.u32 v, v, {LO_MUL:#x};
    and.b32 v, v, {KEEP:#x};
    {unbias}
    fma.rn.bf16x2 ${half}, v, s, z;
    and.b32 v, t, {HI_MASK:#x};
    mul.lo.u32 v, v, {HI_MUL:#x};
    and.b32 v, v, {KEEP:#x};
    {unbias}
    fma.rn.bf16x2 ${2 + half}, v, s, z;"""


def _asm(folded: bool) -> str:
    unbias = "" if folded else f"mov.b32 k, {UNBIAS:#x};\n"
    return ("{\n.reg .b32 t, s, v, k, z;\n" + unbias
            + "mov.b32 z, 0x80008000;"  # -0.0: a * b + z is a * b
            + _pair_asm(0, folded) + _pair_asm(1, folded) + "\n}")


E2M1_BF16_ASM = tl.constexpr(_asm(folded=False))
E2M1_BF16_FOLDED_ASM = tl.constexpr(_asm(folded=True))
PACKED_BF16 = tl.constexpr(not INTERPRETED)  # the interpreter runs no PTX


def e2m1_bf16_bits(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The PTX's integer steps on int64 ``words`` (two code bytes, one in each 16-bit half):
    (low nibbles' bf16 pair, high nibbles') as int64 words; the tests check the constants so."""
    def place(mask: int, mul: int) -> torch.Tensor:
        return ((words & mask) * mul) & KEEP
    return place(LO_MASK, LO_MUL), place(HI_MASK, HI_MUL)


def folded_scale_bits(exps: torch.Tensor) -> torch.Tensor:
    """The FOLDED PTX's scale on int64 ``exps`` (an exponent in each 16-bit half's low
    byte): the bf16 pair 2^(e - 1) of each, as an int64 word."""
    return exps * 128 + FOLD_BIAS


@triton.jit
def e2m1_bf16(packed, exp, FOLDED: tl.constexpr):
    """MXFP4 bytes and their e8m0 scales (uint8, one shape): (low values, high values) in
    bf16, by ``E2M1_BF16_ASM`` (FOLDED: ``E2M1_BF16_FOLDED_ASM``), four bytes an instance."""
    if FOLDED:
        lo, hi = tl.inline_asm_elementwise(E2M1_BF16_FOLDED_ASM, "=r,=r,=r,=r,r,r",
                                           [packed, exp], dtype=(tl.bfloat16, tl.bfloat16),
                                           is_pure=True, pack=4)
    else:
        lo, hi = tl.inline_asm_elementwise(E2M1_BF16_ASM, "=r,=r,=r,=r,r,r", [packed, exp],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True,
                                           pack=4)
    return lo, hi


@triton.jit
def e2m1_pair(packed, exp, dtype, FOLDED: tl.constexpr = False):
    """``e2m1_values`` of uint8 codes and exponents, by the packed PTX where it applies
    (FOLDED: every exponent at most ``mxfp4.FOLD_MAX_EXPONENT``)."""
    if PACKED_BF16 and dtype == tl.bfloat16:
        lo, hi = e2m1_bf16(packed, exp, FOLDED)
    else:
        lo, hi = e2m1_values(packed.to(tl.int32), exp.to(tl.int32), dtype)
    return lo, hi


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
def codes_by_k(b_at, k0, n0, N, K, stride_bn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows [n0, n0 + BLOCK_N)'s kernel-layout codes at columns [k0, k0 + BLOCK_K) as a
    [BLOCK_K / 2, BLOCK_N] tile (bytes along K), each group's 4 x 4 undone: in K order."""
    kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    n = n0 + tl.arange(0, BLOCK_N)
    # K is whole groups: the mask holds over 16-byte runs, which load as one vector
    packed = tl.load(b_at + n[None, :] * stride_bn + kb[:, None],
                     mask=(kb < tl.multiple_of(K // 2, 16))[:, None] & (n < N)[None, :],
                     other=0)
    return tl.reshape(tl.permute(tl.reshape(packed, (BLOCK_K // 32, 4, 4, BLOCK_N)),
                                 (0, 2, 1, 3)), (BLOCK_K // 2, BLOCK_N))


@triton.jit
def codes_of_rows(b_at, k0, n0, N, K, stride_bn, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """``codes_by_k`` as rows of bytes: [BLOCK_N, BLOCK_K / 2], in K order."""
    kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    n = n0 + tl.arange(0, BLOCK_N)
    packed = tl.load(b_at + n[:, None] * stride_bn + kb[None, :],
                     mask=(n < N)[:, None] & (kb < tl.multiple_of(K // 2, 16))[None, :],
                     other=0)
    return tl.reshape(tl.permute(tl.reshape(packed, (BLOCK_N, BLOCK_K // 32, 4, 4)),
                                 (0, 1, 3, 2)), (BLOCK_N, BLOCK_K // 2))


@triton.jit
def exps_by_k(s_at, k0, n0, N, K, stride_sg, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              WORDS: tl.constexpr):
    """Rows [n0, n0 + BLOCK_N)'s e8m0 exponents for columns [k0, k0 + BLOCK_K): [BLOCK_K /
    32, BLOCK_N] uint8, group-major (a group ``stride_sg`` apart: one contiguous run each).
    WORDS: four rows a 32-bit load (rows and strides are multiples of 32, as K groups make
    them), which Triton copies asynchronously, stages ahead; a small tile's exponents as
    bytes (one or two a thread) are a synchronous load, a memory latency every K step."""
    g = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    g_ok = (g < K // 32)[:, None]
    if WORDS:
        w = n0 // 4 + tl.arange(0, BLOCK_N // 4)
        at = (s_at + g[:, None] * stride_sg).to(tl.pointer_type(tl.int32)) + w[None, :]
        words = tl.load(at, mask=g_ok & (4 * w < N)[None, :], other=0x7F7F7F7F)
        parts = (words[:, :, None] >> (8 * tl.arange(0, 4))[None, None, :]) & 0xFF
        return tl.reshape(parts, (BLOCK_K // 32, BLOCK_N)).to(tl.uint8)
    n = n0 + tl.arange(0, BLOCK_N)
    return tl.load(s_at + g[:, None] * stride_sg + n[None, :], mask=g_ok & (n < N)[None, :],
                   other=127)


def exps_in_words(block_n: int, block_k: int) -> bool:
    """Whether a tile loads its exponents as words (``exps_by_k``): where they are 256 bytes a
    K step (k64 x n128, k128 x n64), word loads made gpt-oss's layer faster on an H100;
    where 512 (k128 x n128), slower (their unpacking costs more than the byte load's wait)."""
    return block_k // 32 * block_n <= 256


@triton.jit
def mxfp4_tile(b_at, s_at, k0, n0, N, K, stride_bn, stride_sg, dtype, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, WORDS: tl.constexpr, FOLDED: tl.constexpr = False):
    """B's [BLOCK_K, BLOCK_N] tile at columns [k0, k0 + BLOCK_K) of rows [n0, n0 + BLOCK_N)
    from MXFP4's kernel layout (codes [N, K / 2], exponents [K / 32, N] a group ``stride_sg``
    apart); (low nibbles, high nibbles) in ``dtype``, each [BLOCK_K / 2, BLOCK_N]."""
    codes = codes_by_k(b_at, k0, n0, N, K, stride_bn, BLOCK_N, BLOCK_K)
    exps = exps_by_k(s_at, k0, n0, N, K, stride_sg, BLOCK_N, BLOCK_K, WORDS)
    exp = tl.reshape(tl.broadcast_to(exps[:, None, :], (BLOCK_K // 32, 16, BLOCK_N)),
                     (BLOCK_K // 2, BLOCK_N))
    return e2m1_pair(codes, exp, dtype, FOLDED)


@triton.jit
def mxfp4_rows(b_at, s_at, k0, n0, N, K, stride_bn, stride_sg, dtype, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, WORDS: tl.constexpr, FOLDED: tl.constexpr = False):
    """The weights' rows [n0, n0 + BLOCK_N) at columns [k0, k0 + BLOCK_K) from MXFP4's
    kernel layout, [BLOCK_N, BLOCK_K] in ``dtype`` (the swapped product's left operand, in
    registers): each row's bytes loaded whole, a scale once per 32 columns."""
    packed = codes_of_rows(b_at, k0, n0, N, K, stride_bn, BLOCK_N, BLOCK_K)
    exps = tl.trans(exps_by_k(s_at, k0, n0, N, K, stride_sg, BLOCK_N, BLOCK_K, WORDS))
    exp = tl.reshape(tl.broadcast_to(exps[:, :, None], (BLOCK_N, BLOCK_K // 32, 16)),
                     (BLOCK_N, BLOCK_K // 2))
    lo, hi = e2m1_pair(packed, exp, dtype, FOLDED)
    return tl.interleave(lo, hi)


@triton.jit
def mxfp4_operands(b_at, s_at, k0, n0, N, K, stride_bn, stride_sg, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, WORDS: tl.constexpr):
    """``tl.dot_scaled``'s B operands at columns [k0, k0 + BLOCK_K) of rows [n0, n0 +
    BLOCK_N) from MXFP4's kernel layout: the packed codes [BLOCK_K / 2, BLOCK_N] (along K,
    in K order) and the e8m0 scales [BLOCK_N, BLOCK_K / 32]."""
    return (codes_by_k(b_at, k0, n0, N, K, stride_bn, BLOCK_N, BLOCK_K),
            tl.trans(exps_by_k(s_at, k0, n0, N, K, stride_sg, BLOCK_N, BLOCK_K, WORDS)))


@triton.jit
def _dequantize_kernel(b_ptr, s_ptr, out_ptr, rows, K, stride_be, stride_b, stride_se,
                       stride_sg, stride_oe, stride_o,
                       BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    e = tl.program_id(2).to(tl.int64)
    r0 = tl.program_id(0) * BLOCK_R
    k0 = tl.program_id(1) * BLOCK_K
    w = mxfp4_rows(b_ptr + e * stride_be, s_ptr + e * stride_se, k0, r0, rows, K, stride_b,
                   stride_sg, out_ptr.dtype.element_ty, BLOCK_R, BLOCK_K,
                   False)  # exponents as bytes: one tile a program, no K loop to wait in
    r = r0 + tl.arange(0, BLOCK_R)
    cols = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + e * stride_oe + r[:, None].to(tl.int64) * stride_o + cols[None, :], w,
             mask=(r < rows)[:, None] & (cols < K)[None, :])


def dequantize(codes: torch.Tensor, exps: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """MXFP4 experts in the kernel layout (``codes`` [E, R, K / 2], ``exps`` [E, K / 32, R],
    contiguous) written dense into ``out`` [E, R, K] (its dtype: bf16, fp16 or float32)."""
    e, r, k = out.shape
    block_r, block_k = 32, 128
    grid = (triton.cdiv(r, block_r), triton.cdiv(k, block_k), e)
    _dequantize_kernel[grid](codes, exps, out, r, k, codes.stride(0), codes.stride(1),
                             exps.stride(0), exps.stride(1), out.stride(0), out.stride(1),
                             BLOCK_R=block_r, BLOCK_K=block_k)
    return out
