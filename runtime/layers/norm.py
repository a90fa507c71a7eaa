"""RMSNorm, with the residual add folded in, and optionally FP8 quantization of its output
(one fused Triton kernel on CUDA)."""

from __future__ import annotations

import torch
from torch import nn

from pagedgen.profiling import scope
from pagedgen.runtime.collectives.parallel import TensorParallel
from pagedgen.runtime.layers import fused_ops


class RMSNorm(nn.Module):
    """RMSNorm; with ``residual``, adds it first and returns (normed, new residual)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fused = False  # one Triton kernel instead of torch ops (``use_fused_kernels``)
        # a group: the input is a row-parallel layer's partial sums, reduced here first
        self.reduce: TensorParallel | None = None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                quantize: bool = False):
        """``quantize``: the normed rows quantized to FP8 per token in the same kernel
        (``QuantizedActivations``, for an FP8 linear layer that takes them)."""
        op = fused_ops.rms_norm_fused if self.fused else fused_ops.rms_norm_ref
        with scope("normalization"):
            if self.reduce is not None:
                return self.reduce.all_reduce_add_rms_norm(x, residual, self.weight, self.eps, op,
                                                           quantize=quantize)
            return op(x, self.weight, self.eps, residual, quantize)
