"""MXFP4 weights (OCP microscaling): 4-bit e2m1 values, two a byte (the low nibble first),
with one e8m0 scale (a power of two, biased by 127) per 32 values along the input features.
gpt-oss's checkpoints hold their experts so: ``*_blocks`` [..., rows, groups, 16] uint8 and
``*_scales`` [..., rows, groups] uint8.

``dequantize`` turns them into a dense tensor [..., rows, groups * 32] (the CPU's experts);
``quantize`` is its inverse (round to the nearest e2m1 value under the group's power-of-two
scale: dummy weights, tests). Experts keep them 4-bit (``moe.py``), in the layout the
grouped GEMM reads (``to_kernel_layout``; ``from_kernel_layout`` undoes it).
"""

from __future__ import annotations

import torch

# the 16 e2m1 codes: sign bit 3, then exponent and mantissa
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32  # values per scale
SCALE_BIAS = 127
# the largest exponent the GPU's one-multiply conversion takes (``kernels``: FOLDED)
FOLD_MAX_EXPONENT = 128


def check_pair(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """ValueError unless ``blocks`` [..., rows, G, 16] and ``scales`` [..., rows, G] are a
    checkpoint's MXFP4 pair (uint8 both)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 \
            or blocks.shape[:-1] != scales.shape or blocks.shape[-1] != GROUP // 2:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} ({blocks.dtype}) and scales "
                         f"{list(scales.shape)} ({scales.dtype}) do not pair (uint8, "
                         f"[..., groups, {GROUP // 2}] and [..., groups])")


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., rows, G, 16] packed codes and [..., rows, G] exponents → [..., rows, G * 32]."""
    check_pair(blocks, scales)
    table = torch.tensor(E2M1, dtype=torch.float32, device=blocks.device)
    values = torch.stack([table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]], -1)
    values = torch.ldexp(values.flatten(-2), scales.int()[..., None] - SCALE_BIAS)
    return values.flatten(-2).to(dtype)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., rows, K] (K a multiple of 32) → (blocks, scales) as ``dequantize`` reads them: each
    group scaled by the power of two that brings its largest magnitude to at most 6."""
    w = weight.float().unflatten(-1, (-1, GROUP))
    peak = w.abs().amax(-1).clamp(min=2.0 ** -126)
    exp = torch.ceil(torch.log2(peak / 6.0)).clamp(-SCALE_BIAS, 127)
    scaled = w / torch.exp2(exp)[..., None]
    # the nearest magnitude (a tie to the smaller): its index among the sorted eight
    mids = torch.tensor(E2M1[:8], device=w.device)
    code = torch.bucketize(scaled.abs().contiguous(), (mids[1:] + mids[:-1]) / 2)
    code = code + 8 * ((scaled < 0) & (code > 0))  # the sign bit (no negative zero)
    code = code.to(torch.uint8).unflatten(-1, (-1, 2))
    blocks = code[..., 0] | (code[..., 1] << 4)
    return blocks, (exp + SCALE_BIAS).to(torch.uint8)


def small_exponents(*exps: torch.Tensor) -> bool:
    """Whether every e8m0 exponent in ``exps`` is at most ``FOLD_MAX_EXPONENT`` (group peaks
    up to 12: any checkpoint's weights), so the kernels take the one-multiply conversion. One
    host sync."""
    return all(e.numel() == 0 or int(e.max()) <= FOLD_MAX_EXPONENT for e in exps)


def kernel_codes(codes: torch.Tensor) -> torch.Tensor:
    """Codes [..., K / 2] with each scale group's 16 bytes read as a 4 x 4 matrix and
    transposed (``to_kernel_layout``'s codes; its own inverse)."""
    return codes.unflatten(-1, (-1, 4, 4)).transpose(-1, -2).flatten(-3).contiguous()


def to_kernel_layout(codes: torch.Tensor, scales: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes [..., rows, K / 2] and exponents [..., rows, K / 32] → the grouped GEMM's layout
    (``kernels``): the codes with each group's 16 bytes transposed as a 4 x 4 matrix
    (byte ``4 j + t`` of a group moves to ``4 t + j``: the four bytes one thread of Hopper's
    MMA takes lie together), the exponents group-major [..., K / 32, rows]."""
    return kernel_codes(codes), scales.transpose(-1, -2).contiguous()


def from_kernel_layout(codes: torch.Tensor, exps: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``to_kernel_layout``'s inverse: (blocks [..., rows, G, 16], scales [..., rows, G]) as
    ``dequantize`` reads them."""
    return (kernel_codes(codes).unflatten(-1, (-1, GROUP // 2)),
            exps.transpose(-1, -2).contiguous())
