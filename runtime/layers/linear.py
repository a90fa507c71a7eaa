"""Linear layers, Megatron-style under tensor parallelism, with a quantization method plugged in.

The layer owns the sharding (which rows or columns of the checkpoint tensors this rank holds);
its ``quant_method`` (``runtime/quantization``) owns the weight's form and the GEMM:
``create_weights`` registers the parameters, ``apply`` computes ``x W^T``.

- ``ColumnParallelLinear``: each rank holds some output features (rows of the weight); fused
  projections (q/k/v, gate/up) take their rows from each part separately.
- ``RowParallelLinear``: each rank holds some input features; partial sums are all-reduced
  (with symmetric memory, the GEMM writes straight into the buffer the peers read) and the bias
  is added once after.
- ``MergedProjections``: after loading, several unquantized projections of one input (a MoE
  block's router beside its shared expert's gate and gate/up; Gated DeltaNet's two input
  projections) as one matrix and one GEMM.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedgen.runtime.collectives.parallel import TensorParallel
from pagedgen.runtime.collectives.sharding import Segment, split
from pagedgen.runtime.quantization import QuantizationMethod, get_method
from pagedgen.runtime.quantization.dense_gemm import linear
from pagedgen.runtime.quantization.fp8.kernels import QuantizedActivations
from pagedgen.runtime.quantization.invariant_gemm import invariant_linear
from pagedgen.runtime.quantization.unquantized import Unquantized


class LinearBase(nn.Module):
    """``in_features`` → ``out_features`` (this rank's share), parameters by ``quant_method``
    (default: dense weights in the model's dtype)."""

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 quant_method: QuantizationMethod | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.quant_method = quant_method or get_method(None)
        self.quant_method.create_weights(self, in_features, out_features, bias)


class ColumnParallelLinear(LinearBase):
    """``y = x W^T + b`` for this rank's output features: ``parts`` are the (key, this rank's
    segment of the full tensor) of each fused checkpoint tensor, in order."""

    def __init__(self, in_features: int, parts: list[tuple[Any, Segment]], bias: bool,
                 quant_method: QuantizationMethod | None = None) -> None:
        segs, offset = [], 0
        for key, s in parts:
            segs.append(Segment(key, s.full, s.start, s.size, offset))
            offset += s.size
        super().__init__(in_features, offset, bias, quant_method)
        self.shards = {"weight": (0, segs), **({"bias": (0, segs)} if bias else {})}

    def forward(self, x: torch.Tensor | QuantizedActivations) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class RowParallelLinear(LinearBase):
    """``y = all_reduce(x_rank W_rank^T) + b`` over this rank's input features."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel,
                 quant_method: QuantizationMethod | None = None) -> None:
        seg = split(in_features, tp, "a row-parallel layer's input features")
        super().__init__(seg.size, out_features, bias, quant_method)
        self.tp = tp
        self.shards = {"weight": (1, [seg])}
        # True: return this rank's partial sums; the RMSNorm that follows reduces them
        # (``TensorParallel.all_reduce_add_rms_norm``; only without a bias)
        self.defer_reduce = False

    def forward(self, x: torch.Tensor | QuantizedActivations) -> torch.Tensor:
        """``x``: this rank's input features (2-D: the output may go straight into the
        symmetric-memory buffer), or an FP8 layer's ``QuantizedActivations``."""
        if isinstance(x, QuantizedActivations):
            rows, dtype = x.q.shape[0], self.quant_method.output_dtype(self)
        else:
            rows, dtype = x.shape[0], x.dtype
        if isinstance(x, torch.Tensor) and x.dim() != 2:  # no symmetric-memory output
            partial = self.quant_method.apply(self, x, None)
        else:
            partial = self.tp.partial_output(
                rows, self.out_features, dtype,
                lambda out: self.quant_method.apply(self, x, None, out))
        if self.defer_reduce:
            return partial
        y = self.tp.reduce_partial(partial)
        return y + self.bias if self.bias is not None else y


class MergedProjections:
    """Projections of one input, bias-free and unquantized, computed by one GEMM: their
    weights' rows in one matrix (each layer's ``weight`` becomes a view of its rows, so
    nothing is held twice), each part starting at a multiple of ``ALIGN`` rows so that its
    output columns start 16-byte aligned. A decode step's small projections (a router, a
    gate of one row) each cost a launch and a wave of their own otherwise."""

    ALIGN = 8
    batch_invariant = False  # the GEMM in invariant tiles (invariant_gemm.py), as the layers'

    @classmethod
    def layout(cls, widths: Iterable[int]) -> tuple[list[int], int]:
        """Each part's first row in the merged matrix, and its rows, for parts this wide."""
        starts, rows = [], 0
        for width in widths:
            starts.append(rows)
            rows += -(-width // cls.ALIGN) * cls.ALIGN
        return starts, rows

    def __init__(self, layers: list[LinearBase]) -> None:
        first = layers[0].weight
        starts, rows = self.layout(layer.out_features for layer in layers)
        self.weight = first.new_zeros(rows, first.shape[1])
        self.parts = list(zip(starts, (layer.out_features for layer in layers)))
        for layer, (start, size) in zip(layers, self.parts):
            self.weight[start:start + size] = layer.weight.detach()
            layer.weight = nn.Parameter(self.weight[start:start + size],
                                        requires_grad=False)

    @classmethod
    def of(cls, layers: list[LinearBase]) -> MergedProjections | None:
        """The layers merged, where every one is unquantized and bias-free, with weights of
        one dtype, device and width; None otherwise."""
        if not all(type(layer.quant_method) is Unquantized and layer.bias is None
                   for layer in layers):
            return None
        if len({(layer.weight.dtype, layer.weight.device, layer.weight.shape[1])
                for layer in layers}) != 1:
            return None
        return cls(layers)

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each layer's output ([T, its features]: views of one GEMM's output)."""
        y = (invariant_linear if self.batch_invariant else linear)(x, self.weight)
        return [y[..., start:start + size] for start, size in self.parts]
