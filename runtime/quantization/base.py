"""The quantization-method interface a linear layer plugs in (after vLLM's
``LinearMethodBase``, simpler): the method decides how the weight is stored and multiplied."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
from torch import nn


class QuantizationMethod(ABC):
    """How a linear layer keeps its weight and computes ``x W^T`` with it."""

    name: ClassVar[str]

    @abstractmethod
    def create_weights(self, layer: nn.Module, in_features: int, out_features: int,
                       bias: bool) -> None:
        """Register the layer's parameters: ``weight`` ([out, in] as the checkpoint names it,
        which the loader fills), ``bias`` (or None) and whatever else the method keeps."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
              out: torch.Tensor | None = None) -> torch.Tensor:
        """``x W^T (+ bias)`` in ``x``'s dtype; with ``out`` (2-D ``x``, no bias), written
        into it (a row-parallel layer's symmetric-memory buffer) and returned."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Turn loaded checkpoint weights into the method's form (e.g. quantize them)."""
