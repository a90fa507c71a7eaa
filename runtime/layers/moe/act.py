"""The experts' activations between their two GEMMs: the usual SwiGLU (``silu(gate) * up``,
fused into the first GEMM's epilogue by ``moe.kernels``), gpt-oss's clamped SwiGLU after
per-expert biases and Gemma 4's GeGLU (``gelu_tanh(gate) * up``), which the first GEMM leaves
to ``bias_and_act``: one Triton kernel (a program per slot) that adds each slot's expert's
gate and up biases (where there are any), clamps and activates in float32, where torch would
run up to six kernels (a gather, an add, two clamps, the activation, the product)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedgen.runtime.quantization.fp8.kernels import INTERPRETED

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


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Gemma 4's experts' activation: ``gelu_tanh(gate) * up``."""
    return F.gelu(gate, approximate="tanh") * up




if HAVE_TRITON:
    @triton.jit
    def _bias_and_act_kernel(GU, B, Expert, Out, width, stride_gu, stride_out, alpha, limit,
                             HAS_BIAS: tl.constexpr, ACT: tl.constexpr, BLOCK: tl.constexpr):
        """Slot ``pid``: its gate and up columns (+ its expert's biases), then ACT 0: the
        clamped SwiGLU, 1: GeGLU (``0.5 (1 + tanh(z)) = sigmoid(2 z)``)."""
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
            if ACT == 0:
                gate = tl.minimum(gate, limit)
                up = tl.minimum(tl.maximum(up, -limit), limit)
                out = (up + 1.0) * gate * tl.sigmoid(alpha * gate)
            else:
                z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
                out = gate * tl.sigmoid(2.0 * z) * up
            tl.store(Out + slot * stride_out + cols, out.to(Out.dtype.element_ty), mask=ok)


def bias_and_act(gate_up: torch.Tensor, act, bias: torch.Tensor | None,
                 expert: torch.Tensor) -> torch.Tensor:
    """``act(gate + bias_e, up + bias_e)`` of each slot's [gate | up] row (``expert``: each
    slot's expert, for its bias [E, 2I]): one kernel for the clamped SwiGLU and GeGLU where
    Triton runs these tensors, torch ops otherwise (and for any other activation)."""
    which = 1 if act is geglu else 0 if isinstance(act, ClampedSwiglu) else None
    kernel = HAVE_TRITON and which is not None and (gate_up.is_cuda or INTERPRETED)
    if not kernel:
        if bias is not None:
            gate_up = gate_up + bias[expert].to(gate_up.dtype)
        return act(*gate_up.chunk(2, dim=-1))
    slots, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(slots, width)
    if slots:
        _bias_and_act_kernel[(slots,)](
            gate_up, bias if bias is not None else gate_up, expert, out, width,
            gate_up.stride(0), out.stride(0), float(getattr(act, "alpha", 0.0)),
            float(getattr(act, "limit", 0.0)), HAS_BIAS=bias is not None, ACT=which,
            BLOCK=min(1024, triton.next_power_of_2(width)))
    return out
