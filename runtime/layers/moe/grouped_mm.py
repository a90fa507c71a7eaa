"""The experts by torch's grouped GEMM (``torch._grouped_mm``: CUTLASS's grouped kernel on
Hopper) for the token counts where it beats our Triton tiles, which ``moe.plan`` measures:
prefill chunks, where each expert gets hundreds of rows.

The slots (``moe.kernels``: slot ``t * top_k + j``) are sorted by expert into one contiguous
block per expert (no padding: the GEMM takes each expert's row count), the two GEMMs run with
SiLU-and-mul between them, and ``moe.combine`` adds each token's slot rows where they lie, scaled
by their routing weights (in the order ``fused_experts`` sums in). gpt-oss's experts (biases,
clamped SwiGLU) take ``moe_act.bias_and_act`` between the GEMMs and their down bias in the
sum; MXFP4 experts come here written out dense (``moe.dequantized``). Nothing
waits on the host, so it runs while the host prepares the next step. FP8 experts with one scale
per output row go through ``torch._scaled_grouped_mm`` (CUTLASS's FP8 grouped kernel), each
GEMM's input quantized per row (the SiLU-and-mul kernel quantizes the second's as it writes it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedgen.runtime.hardware import hopper_or_later
from pagedgen.runtime.layers.moe.act import bias_and_act, swiglu
from pagedgen.runtime.layers.moe.combine import slot_sum
from pagedgen.runtime.quantization.fp8.kernels import E4M3, quantize_activations


def available(w13: torch.Tensor, scales=None, dense: torch.Size | None = None) -> bool:
    """Whether torch's grouped GEMM can run these experts here: bf16 (or FP8 with ``scales``
    per output row: ``moe_kernels.ExpertScales``) on Hopper or later, every width a multiple
    of 16 bytes (``w13`` [E, 2I, H]; ``dense``: the bf16 shape MXFP4 experts are written out
    to, ``moe.dequantized``)."""
    if not hopper_or_later(w13.device):
        return False
    if scales is not None:
        return (hasattr(torch, "_scaled_grouped_mm") and w13.dtype == E4M3
                and scales.group_k is None and w13.shape[1] % 32 == 0
                and w13.shape[2] % 16 == 0)
    shape = w13.shape if dense is None else dense
    return (hasattr(torch, "_grouped_mm") and (w13.dtype == torch.bfloat16 or dense is not None)
            and shape[1] % 16 == 0 and shape[2] % 8 == 0)


def experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
            ids: torch.Tensor, out: torch.Tensor | None = None,
            silu_and_mul=None, scales=None, act=swiglu, b13: torch.Tensor | None = None,
            b2: torch.Tensor | None = None, dropped: bool = False,
            gated: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``moe_kernels.reference``'s result: ``w13`` [E, 2I, H] (gate rows, then up),
    ``w2`` [E, H, I], ``weights`` / ``ids`` [T, top_k]; summed into ``out`` [T, H] when
    given. ``silu_and_mul``: the activation kernel (default: torch's ops; with ``scales``,
    one that takes ``quantize=True``). ``scales``: FP8 experts' per-row scales. ``act``
    (another activation, bf16 experts) with biases ``b13`` [E, 2I] and ``b2`` [E, H].
    ``dropped``: id E marks slots of experts elsewhere (weight 0), sorted last and skipped.
    ``gated``: a shared expert's output and gate logit, added in the sum (``slot_sum``)."""
    top_k, num = ids.shape[1], w13.shape[0]
    flat = ids.reshape(-1).long()  # the router's ids may be int32
    order = torch.argsort(flat, stable=True)  # slots by expert
    counts = torch.zeros(num + dropped, dtype=torch.int64, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    offs = counts[:num].cumsum(0).to(torch.int32)  # each expert's end among the sorted slots
    sorted_ids = flat[order]
    rows = x.index_select(0, order // top_k)
    if scales is not None:
        q, s = quantize_activations(rows)
        gate_up = torch._scaled_grouped_mm(q, w13.transpose(1, 2), s.view(-1),
                                           scales.w13.view(w13.shape[0], -1), offs=offs,
                                           out_dtype=x.dtype)
        q, s = silu_and_mul(gate_up, quantize=True)
        y = torch._scaled_grouped_mm(q, w2.transpose(1, 2), s.view(-1),
                                     scales.w2.view(w2.shape[0], -1), offs=offs,
                                     out_dtype=x.dtype)
    else:
        gate_up = torch._grouped_mm(rows, w13.transpose(1, 2), offs=offs)
        if act is not swiglu or b13 is not None:
            # a dropped slot's row takes any expert's bias: its output is zeroed below
            inter = bias_and_act(gate_up, act, b13, sorted_ids.clamp(max=num - 1))
        elif silu_and_mul is None:
            gate, up = gate_up.chunk(2, dim=-1)
            inter = F.silu(gate) * up
        else:
            inter = silu_and_mul(gate_up)
        y = torch._grouped_mm(inter, w2.transpose(1, 2), offs=offs)
    if dropped:  # rows past the last expert's: never written by the GEMMs
        y.masked_fill_((sorted_ids == num)[:, None], 0)
    rows = torch.empty_like(order).scatter_(  # each slot's row among the sorted ones
        0, order, torch.arange(order.numel(), device=order.device))
    experts = ids.clamp(max=num - 1) if dropped else ids  # a dropped slot's: any (weight 0)
    return slot_sum(y, top_k, out, rows=rows, weights=weights, bias=b2, experts=experts,
                    gated=gated)
