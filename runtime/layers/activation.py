"""Gated activations: SwiGLU's SiLU of the gate times the up projection (one fused Triton
kernel on CUDA), and GeGLU's tanh-approximated GELU (Gemma; torch ops)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedgen.profiling import scope
from pagedgen.runtime.layers import fused_ops
from pagedgen.runtime.quantization.invariant_gemm import by_rows

VECTOR_BLOCK = 64  # values: a multiple of any CPU loop's vector step (AVX-512: 16 floats, x2)


def gated_rows(op, gate_up: torch.Tensor, *args) -> torch.Tensor:
    """``op`` over ``[gate | up]`` a row at a time (``by_rows``), each half padded with zeros
    to a multiple of ``VECTOR_BLOCK`` values: torch's CPU loops take a row's last values
    (past its last whole vector step) in a tail path that rounds exp otherwise, so a value's
    bits would follow the width around it (-tp 2's ranks hold half of it)."""
    gate, up = gate_up.chunk(2, dim=-1)
    width = gate.shape[-1]
    pad = -width % VECTOR_BLOCK
    if pad:
        gate_up = torch.cat([F.pad(gate, (0, pad)), F.pad(up, (0, pad))], -1)
    return by_rows(op, gate_up, *args)[..., :width]


class SiluAndMul(nn.Module):
    """``[gate | up]`` [T, 2I] → ``silu(gate) * up`` [T, I]."""

    def __init__(self) -> None:
        super().__init__()
        self.fused = False  # ``use_fused_kernels``
        self.batch_invariant = False  # a row at a time on a CPU (``by_rows``)

    def forward(self, gate_up: torch.Tensor, quantize: bool = False):
        """``quantize``: quantized to FP8 per token in the same kernel
        (``QuantizedActivations``)."""
        op = fused_ops.silu_and_mul_fused if self.fused else fused_ops.silu_and_mul_ref
        with scope("activation"):
            if self.batch_invariant and not gate_up.is_cuda and not quantize:
                return gated_rows(op, gate_up, quantize)
            return op(gate_up, quantize)


class GeluTanhAndMul(nn.Module):
    """``[gate | up]`` [T, 2I] → ``gelu_tanh(gate) * up`` [T, I] (Gemma's ``gelu_pytorch_tanh``)."""

    def __init__(self) -> None:
        super().__init__()
        self.batch_invariant = False  # a row at a time on a CPU (``by_rows``)

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        with scope("activation"):
            if self.batch_invariant and not gate_up.is_cuda:
                return gated_rows(self._op, gate_up)
            return self._op(gate_up)

    @staticmethod
    def _op(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.gelu(gate, approximate="tanh") * up
