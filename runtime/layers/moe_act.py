"""The experts' activations between their two GEMMs: the usual SwiGLU (``silu(gate) * up``,
fused into the first GEMM's epilogue by ``moe_kernels``), and gpt-oss's clamped SwiGLU after
per-expert biases, which the first GEMM leaves to ``bias_and_act``: one Triton kernel (a
program per slot) that adds each slot's expert's gate and up biases, clamps and activates in
float32, where torch would run six kernels (a gather, an add, two clamps, a sigmoid, the
products)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedgen.runtime.quantization.fp8_kernels import INTERPRETED

try:
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The experts' usual activation: ``silu(gate) * up``."""
    return F.silu(gate) * up


@dataclass(frozen=True)
class ClampedSwiglu:
    """gpt-oss's: gate clamped above at ``limit``, up to ``±limit``, then
    ``(up + 1) * gate * sigmoid(alpha * gate)``."""

    alpha: float
    limit: float

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return (up + 1) * gate * torch.sigmoid(gate * self.alpha)


def clamped_swiglu(alpha: float, limit: float) -> ClampedSwiglu:
    return ClampedSwiglu(alpha, limit)


if HAVE_TRITON:
    @triton.jit
    def _bias_and_act_kernel(GU, B, Expert, Out, width, stride_gu, stride_out, alpha, limit,
                             HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        """Slot ``pid``: its gate and up columns (+ its expert's biases), clamped SwiGLU."""
        slot = tl.program_id(0).to(tl.int64)
        for start in range(0, width, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            ok = cols < width
            gate = tl.load(GU + slot * stride_gu + cols, mask=ok, other=0.0).to(tl.float32)
            up = tl.load(GU + slot * stride_gu + width + cols, mask=ok, other=0.0).to(
                tl.float32)
            if HAS_BIAS:
                row = B + tl.load(Expert + slot).to(tl.int64) * 2 * width
                gate += tl.load(row + cols, mask=ok, other=0.0).to(tl.float32)
                up += tl.load(row + width + cols, mask=ok, other=0.0).to(tl.float32)
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
            out = (up + 1.0) * gate * tl.sigmoid(alpha * gate)
            tl.store(Out + slot * stride_out + cols, out.to(Out.dtype.element_ty), mask=ok)


def bias_and_act(gate_up: torch.Tensor, act, bias: torch.Tensor | None,
                 expert: torch.Tensor) -> torch.Tensor:
    """``act(gate + bias_e, up + bias_e)`` of each slot's [gate | up] row (``expert``: each
    slot's expert, for its bias [E, 2I]): one kernel for the clamped SwiGLU where Triton runs
    these tensors, torch ops otherwise (and for any other activation)."""
    kernel = HAVE_TRITON and isinstance(act, ClampedSwiglu) and (gate_up.is_cuda or INTERPRETED)
    if not kernel:
        if bias is not None:
            gate_up = gate_up + bias[expert].to(gate_up.dtype)
        return act(*gate_up.chunk(2, dim=-1))
    slots, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(slots, width)
    if slots:
        _bias_and_act_kernel[(slots,)](
            gate_up, bias if bias is not None else gate_up, expert, out, width,
            gate_up.stride(0), out.stride(0), float(act.alpha), float(act.limit),
            HAS_BIAS=bias is not None, BLOCK=min(1024, triton.next_power_of_2(width)))
    return out
