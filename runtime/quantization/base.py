"""The quantization-method interface a linear layer plugs in (after vLLM's
``LinearMethodBase``, simpler): the method decides how the weight is stored, loaded and
multiplied."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch
from torch import nn

from pagedgen.runtime.layers.sharding import check_shape, load_segment


class QuantizationMethod(ABC):
    """How a linear layer keeps its weight and computes ``x W^T`` with it."""

    name: ClassVar[str]

    @abstractmethod
    def create_weights(self, layer: nn.Module, in_features: int, out_features: int,
                       bias: bool) -> None:
        """Register the layer's parameters: ``weight`` ([out, in] as the checkpoint names it),
        ``bias`` (or None) and whatever else the method keeps."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
              out: torch.Tensor | None = None) -> torch.Tensor:
        """``x W^T (+ bias)`` in ``x``'s dtype; with ``out`` (2-D ``x``, no bias), written
        into it (a row-parallel layer's symmetric-memory buffer) and returned."""

    def checkpoint_tensors(self, layer: nn.Module) -> tuple[str, ...]:
        """The names (after the layer's prefix) of the tensors a checkpoint holds for it: each
        must be there, and ``load`` takes each."""
        return ("weight",) + (("bias",) if layer.bias is not None else ())

    def load(self, layer: nn.Module, name: str, key: Any, tensor: Any) -> None:
        """Copy checkpoint tensor ``name`` (part ``key`` of a fused layer; a torch tensor, or a
        lazy safetensors slice of which only this rank's rows are read) into the layer.
        ValueError (``has shape ...``) when it does not fit; the caller names the tensor."""
        param, shard = getattr(layer, name), layer.shards.get(name)
        check_shape(param, shard, key, tensor)
        load_segment(param.data, shard, key, tensor)

    def output_dtype(self, layer: nn.Module) -> torch.dtype:
        """The dtype ``apply`` returns (the activations')."""
        return layer.weight.dtype

    def takes_quantized_input(self, layer: nn.Module, m: int) -> bool:
        """Whether ``apply`` at ``m`` rows wants its input as FP8 ``QuantizedActivations``
        (per token, quantized by the kernel that made it) instead of a tensor."""
        return False

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Turn loaded checkpoint weights into the method's form, pick kernels."""
