"""MXFP4 experts kept 4-bit (``runtime/quantization/mxfp4_moe.py``): the grouped GEMM kernels
convert the e2m1 codes and e8m0 scales in registers and give the per-expert loop's result on
the dequantized weights (Triton's interpreter), plain SwiGLU experts and gpt-oss's biased,
clamped ones alike, K tiles that split a scale group or run past K included."""

from __future__ import annotations

import pytest
import torch

from pagedgen.runtime.layers import moe_kernels as mk
from pagedgen.runtime.layers.moe_act import clamped_swiglu
from pagedgen.runtime.quantization import mxfp4
from pagedgen.runtime.quantization.fp8_moe import ExpertScales
from test_moe import INTERPRETED_ONLY, _experts


def packed(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [E, rows, K / 2], exponents [E, rows, K / 32], the values they hold)."""
    blocks, scales = mxfp4.quantize(w)
    return blocks.flatten(-2), scales, mxfp4.dequantize(blocks, scales, torch.float32)


@INTERPRETED_ONLY
@pytest.mark.parametrize("h,i,block_k", [(64, 32, 32), (96, 64, 64), (64, 96, 128)])
@pytest.mark.parametrize("biased", [False, True])
def test_mxfp4_grouped_gemms_equal_the_loop_on_the_dequantized_weights(h, i, block_k, biased):
    x, w13, w2, weights, chosen = _experts(29, 8, 3, h, i)
    q13, s13, d13 = packed(w13)
    q2, s2, d2 = packed(w2)
    if biased:
        g = torch.Generator().manual_seed(2)
        act = clamped_swiglu(1.702, 0.5)
        b13, b2 = torch.randn(8, 2 * i, generator=g), torch.randn(8, h, generator=g)
    else:
        act, b13, b2 = mk.swiglu, None, None
    ref = mk.reference(x, d13, d2, weights, chosen, act, b13, b2)
    tiles = mk.Tiles(16, 32, block_k)
    got = mk.fused_experts(x, q13, q2, weights, chosen, (tiles, tiles), None,
                           ExpertScales(s13, s2, mxfp4.GROUP), act=act, b13=b13, b2=b2)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_mxfp4_experts_refuse_scales_that_do_not_pair():
    x, w13, _, weights, chosen = _experts(3, 4, 2, 64, 32)
    q13, s13, _ = packed(w13)
    slots, experts = mk.align_reference(chosen, 4, 16)
    with pytest.raises(ValueError, match="one per 32 columns"):
        mk.grouped_gemm(x, q13, x.new_empty(6, 64), slots, experts, 6, mk.Tiles(16, 32, 32),
                        2, gated=True, w_scale=s13[..., :1], group_k=32)
