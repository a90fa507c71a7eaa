"""The weight-format interfaces the layers plug in (after vLLM's ``LinearMethodBase`` and
``FusedMoEMethodBase``, simpler): a linear layer's ``QuantizationMethod`` decides how its
weight is stored, loaded and multiplied; a MoE layer's ``MoeMethod`` how its experts' stacked
weights are stored and loaded, and what the grouped GEMMs read beside them (``scales``). A
weight format is one module with one of each."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from pagedgen.runtime.collectives.sharding import check_shape, load_segment


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

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027 (a hook)
        """Turn loaded checkpoint weights into the method's form, pick kernels."""


class MoeMethod(ABC):
    """How a MoE layer keeps its experts: ``w13_weight`` [E, 2I, H] (gate rows, then up rows)
    and ``w2_weight`` [E, H, I] in the method's dtype, and whatever else it needs."""

    name: ClassVar[str]
    quantized: ClassVar[bool] = False  # stored in another form than the model's dtype

    @abstractmethod
    def create_weights(self, layer: nn.Module, num_experts: int, hidden: int,
                       width: int) -> None:
        """Register ``w13_weight``, ``w2_weight`` (this rank's ``width`` of each expert's
        intermediate features) and the method's other parameters."""

    def extra_kinds(self) -> tuple[str, ...]:
        """Checkpoint tensors an expert's projection holds beside ``weight`` (after its name,
        ``experts.{e}.gate_proj.``), each loaded by ``load``; every one must be there."""
        return ()

    def skipped_kinds(self) -> tuple[str, ...]:
        """Checkpoint tensors read and not used (a static input scale, say)."""
        return ()

    def load(self, layer: nn.Module, e: int, part: str, kind: str, tensor: Any, shard,
             key: Any) -> None:
        """Expert ``e``'s checkpoint tensor ``kind`` ("weight" or an extra kind) of projection
        ``part`` into our stacked parameter (this rank's rows or columns: ``shard``, part
        ``key``). ValueError when it does not fit."""
        param = (layer.w2_weight if part == "down" else layer.w13_weight).data[e]
        check_shape(param, shard, key, tensor)
        load_segment(param, shard, key, tensor)

    def scales(self, layer: nn.Module) -> Any:
        """What the grouped GEMMs read beside the weights (None: weights in the model's
        dtype)."""
        return None

    def dense(self, layer: nn.Module, dtype: torch.dtype
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Both stacked weights as ``dtype`` tensors (the CPU's per-expert loop)."""
        return layer.w13_weight, layer.w2_weight


class WeightFormat(ABC):
    """A weight format (one package under ``runtime/quantization/``, one line in
    ``registry.FORMATS``): the checkpoint ``quant_method`` values it reads, whether
    ``--quantization NAME`` applies it at load, and the methods a layer gets under it.
    ``scheme``: the format's own description of one checkpoint's choices (scales, blocks)."""

    name: ClassVar[str]
    checkpoint_methods: ClassVar[tuple[str, ...]] = ()
    online: ClassVar[bool] = False  # --quantization NAME quantizes dense weights at load

    @abstractmethod
    def from_checkpoint(self, fields: dict[str, Any], where: str) -> tuple[Any, tuple[str, ...]]:
        """The scheme of a checkpoint's ``quantization_config`` ``fields`` and the modules it
        leaves dense; a PagedgenError naming the field it cannot run."""

    def at_load(self) -> tuple[Any, tuple[str, ...]]:
        """The scheme ``--quantization NAME`` applies and the modules it leaves dense."""
        raise NotImplementedError(f"{self.name} is read from checkpoints only")

    @abstractmethod
    def linear_method(self, scheme: Any) -> QuantizationMethod | None:
        """A quantized linear layer's method (None: the format leaves linear layers dense)."""

    @abstractmethod
    def moe_method(self, scheme: Any) -> MoeMethod | None:
        """A MoE layer's experts' method (None: dense)."""

    def describe(self, scheme: Any) -> str:
        return self.name

    def check_device(self, device: torch.device) -> None:  # noqa: B027 (a hook)
        """A PagedgenError where ``device`` cannot run the format's kernels."""

    def checkpoint_tensors(self, weights: Iterable[tuple[str, Any]]
                           ) -> Iterable[tuple[str, Any]]:
        """A checkpoint's (name, tensor) pairs as the methods' ``load`` takes them."""
        return weights

    def experts_split_error(self, width: int, tp_size: int) -> str | None:
        """Why experts of ``width`` intermediate features cannot be split over ``tp_size``
        tensor-parallel ranks in this format (None: they can)."""
        return None
