"""Dense weights in the model's dtype: a plain GEMM; experts stacked as they load."""

from __future__ import annotations

import torch
from torch import nn

from pagedgen.runtime.quantization.base import MoeMethod, QuantizationMethod
from pagedgen.runtime.quantization.dense_gemm import linear
from pagedgen.runtime.quantization.invariant_gemm import invariant_linear


class Unquantized(QuantizationMethod):
    name = "none"
    batch_invariant = False  # the GEMM in invariant tiles (invariant_gemm.py)
    k_parts = 1  # ... K in two halves summed after (a row-parallel layer's, in the mode)

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int,
                       bias: bool) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features))
        layer.register_parameter("bias", nn.Parameter(torch.empty(out_features))
                                 if bias else None)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
              out: torch.Tensor | None = None) -> torch.Tensor:
        if self.batch_invariant:
            return invariant_linear(x, layer.weight, bias, out, k_parts=self.k_parts)
        if out is None:
            return linear(x, layer.weight, bias)
        return torch.mm(x, layer.weight.t(), out=out)


class UnquantizedMoe(MoeMethod):
    name = "none"

    def create_weights(self, layer: nn.Module, num_experts: int, hidden: int,
                       width: int) -> None:
        layer.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * width, hidden),
                                        requires_grad=False)
        layer.w2_weight = nn.Parameter(torch.empty(num_experts, hidden, width),
                                       requires_grad=False)
