"""MXFP4 experts in prefill chunks: a run of experts at a time written out dense (bf16, into a
scratch of at most ``SCRATCH_BYTES``: ``mxfp4.kernels.dequantize``), then grouped GEMMs on
those weights (``moe_kernels.fused_experts``' tiles, or torch's, ``moe.grouped_mm``: the way
``GROUPED_MM``), the other experts' slots skipped as expert parallelism skips another rank's.

Where each expert gets hundreds of rows, converting each weight once a step costs less than
converting it in registers in every block of rows that reads it; ``moe.plan`` measures from
which token count. Prefill steps run it, outside CUDA graphs; the weights stay 4-bit in memory.
"""

from __future__ import annotations

import torch

from pagedgen.runtime.layers.moe import grouped_mm as moe_grouped_mm
from pagedgen.runtime.layers.moe import kernels as mk
from pagedgen.runtime.layers.moe.act import swiglu
from pagedgen.runtime.layers.moe.combine import add_gated
from pagedgen.runtime.quantization.fp8.moe import ExpertScales

SCRATCH_BYTES = 2 << 30  # a run of experts' dense weights (gpt-oss-20b's in one run)
GROUPED_MM = "grouped_mm"  # the way that runs torch's grouped GEMM on the dense weights


def experts_per_run(w13: torch.Tensor, w2: torch.Tensor, dtype: torch.dtype,
                    scratch_bytes: int = SCRATCH_BYTES) -> int:
    """How many experts' dense weights (gate/up and down, two values a byte) fit the scratch."""
    dense = (w13[0].numel() + w2[0].numel()) * 2 * dtype.itemsize
    return max(1, min(w13.shape[0], scratch_bytes // dense))


def experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
            ids: torch.Tensor, tiles: tuple[mk.Tiles, mk.Tiles] | str,
            out: torch.Tensor | None,
            scales: ExpertScales, act=swiglu, b13: torch.Tensor | None = None,
            b2: torch.Tensor | None = None, dropped: bool = False,
            scratch_bytes: int = SCRATCH_BYTES,
            gated: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``moe_kernels.fused_experts``' result for MXFP4 experts (``w13`` / ``w2`` packed codes,
    ``scales`` their exponents), each run of experts dequantized to ``x``'s dtype first, then
    multiplied in ``tiles`` or, given ``GROUPED_MM``, by torch's grouped GEMM; ``dropped`` as
    there (expert parallelism's marker ``E``); ``gated`` as there (a shared expert's output)."""
    def gemms(w13, w2, weights, ids, out, b13, b2, dropped, gated=None):
        if tiles == GROUPED_MM:
            return moe_grouped_mm.experts(x, w13, w2, weights, ids, out, act=act, b13=b13,
                                          b2=b2, dropped=dropped, gated=gated)
        return mk.fused_experts(x, w13, w2, weights, ids, tiles, out, act=act, b13=b13,
                                b2=b2, dropped=dropped, gated=gated)

    from pagedgen.runtime.quantization.mxfp4.kernels import dequantize

    num = w13.shape[0]
    per_run = experts_per_run(w13, w2, x.dtype, scratch_bytes)
    total = None
    for e0 in range(0, num, per_run):
        e1 = min(num, e0 + per_run)
        d13 = dequantize(w13[e0:e1], scales.w13[e0:e1],
                         x.new_empty(e1 - e0, w13.shape[1], w13.shape[2] * 2))
        d2 = dequantize(w2[e0:e1], scales.w2[e0:e1],
                        x.new_empty(e1 - e0, w2.shape[1], w2.shape[2] * 2))
        if e1 - e0 == num:  # every expert at once: no slot to skip but the marker's
            return gemms(d13, d2, weights, ids, out, b13, b2, dropped, gated)
        local = ids - e0
        mine = (local >= 0) & (local < e1 - e0)
        y = gemms(d13, d2, weights * mine, torch.where(mine, local, e1 - e0).to(ids.dtype),
                  None, None if b13 is None else b13[e0:e1],
                  None if b2 is None else b2[e0:e1], True)
        total = y if total is None else total.add_(y)
    total = total if gated is None else add_gated(total, *gated)
    return total if out is None else out.copy_(total)
