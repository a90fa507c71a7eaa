"""Gated activations: SwiGLU's SiLU of the gate times the up projection (one fused Triton
kernel on CUDA), and GeGLU's tanh-approximated GELU (Gemma; torch ops)."""

from __future__ import annotations

import torch
from torch import nn

from pagedgen.profiling import scope
from pagedgen.runtime.layers import fused_ops


class SiluAndMul(nn.Module):
    """``[gate | up]`` [T, 2I] → ``silu(gate) * up`` [T, I]."""

    def __init__(self) -> None:
        super().__init__()
        self.fused = False  # ``use_fused_kernels``

    def forward(self, gate_up: torch.Tensor, quantize: bool = False):
        """``quantize``: quantized to FP8 per token in the same kernel
        (``QuantizedActivations``)."""
        op = fused_ops.silu_and_mul_fused if self.fused else fused_ops.silu_and_mul_ref
        with scope("activation"):
            return op(gate_up, quantize)


class GeluTanhAndMul(nn.Module):
    """``[gate | up]`` [T, 2I] → ``gelu_tanh(gate) * up`` [T, I] (Gemma's ``gelu_pytorch_tanh``)."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        with scope("activation"):
            return torch.nn.functional.gelu(gate, approximate="tanh") * up
