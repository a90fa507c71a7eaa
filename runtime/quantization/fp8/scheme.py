"""FP8 (e4m3) linear layers: weights in e4m3 with float32 scales, activations quantized as the
GEMM needs them (``kernels.py`` holds the arithmetic).

Three ways in, one form on the layer (``weight`` [out, in] e4m3, ``weight_scale`` [out,
K_groups] float32, ``input_scale`` [1] when static):
* online (``--quantization fp8`` on a bf16/fp16/fp32 checkpoint, GGUF or dummy weights): each
  checkpoint tensor is quantized as it is read, per output channel (never the whole model in
  its dtype on the device);
* per-channel or per-tensor FP8 checkpoints (compressed-tensors ``float-quantized``; a
  per-tensor scale becomes its rows' scale, so fused q/k/v keep their own);
* block-scaled checkpoints (Hugging Face ``quant_method: fp8`` with ``weight_block_size``;
  ``weight_scale_inv`` per 128 x 128 block, its rows expanded, so partial edge blocks, fused
  parts and tensor-parallel shards need no special case beyond K blocks staying whole).

On CUDA each GEMM runs the kernel measured fastest for its M on this GPU (``gemm.py``),
without dequantizing; where that kernel quantizes activations per token, the RMSNorm or SwiGLU
kernel before it writes them quantized (``takes_quantized_input``; the same values a separate
quantization kernel would write). Elsewhere (CPU) the weight is dequantized and multiplied in
the activations' dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from pagedgen import envs
from pagedgen.profiling import scope
from pagedgen.runtime.collectives.sharding import Shard, take_segment
from pagedgen.runtime.quantization.base import QuantizationMethod
from pagedgen.runtime.quantization.fp8 import kernels as k
from pagedgen.runtime.quantization.fp8.gemm import (
    QUANTIZED_INPUT,
    plan_gemm,
    run_gemm,
    run_quantized,
)
from pagedgen.runtime.quantization.invariant_gemm import invariant_linear


@dataclass(frozen=True)
class Fp8Scheme:
    """How a layer's FP8 weights come: ``serialized`` (e4m3 in the checkpoint, with scales
    named ``scale_name``) or quantized at load; ``block`` (rows, cols) of one weight scale, or
    None for per-channel (``per_tensor``: the checkpoint gives one scale per tensor);
    ``static_input``: the checkpoint gives a per-tensor ``input_scale``."""

    serialized: bool = False
    block: tuple[int, int] | None = None
    per_tensor: bool = False
    static_input: bool = False
    scale_name: str = "weight_scale"

    def describe(self) -> str:
        w = (f"{self.block[0]}x{self.block[1]}-block" if self.block else
             "per-tensor" if self.per_tensor else "per-channel")
        a = "static per-tensor" if self.static_input else (
            f"dynamic per-token-group ({self.block[1]})" if self.block else "dynamic per-token")
        return (f"{w} weights ({'checkpoint' if self.serialized else 'quantized at load'}), "
                f"{a} activations")


ONLINE = Fp8Scheme()
ENV_FUSED_INPUT = envs.FP8_FUSED_INPUT.name


class Fp8(QuantizationMethod):
    name: ClassVar[str] = "fp8"
    # --batch-invariant: bf16 activations times the e4m3 weight in one tile for every M on a
    # GPU (``INVARIANT_TILE``: its K loop in one order whatever the rows), the weight
    # dequantized and a row at a time on a CPU (``invariant_linear``); no activation
    # quantization (a per-tensor static scale would be the batch's, and the plan's per-M
    # kernels sum K in orders of their own)
    batch_invariant = False

    def __init__(self, scheme: Fp8Scheme = ONLINE) -> None:
        self.scheme = scheme
        self.group_k: int | None = scheme.block[1] if scheme.block else None
        self._input_parts: set[Any] = set()  # fused parts whose input scale has arrived

    # ---- parameters ----

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int,
                       bias: bool) -> None:
        groups = 1 if self.group_k is None else math.ceil(in_features / self.group_k)
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=k.E4M3),
                                    requires_grad=False)
        layer.weight_scale = nn.Parameter(torch.empty(out_features, groups,
                                                      dtype=torch.float32), requires_grad=False)
        layer.register_parameter("input_scale", nn.Parameter(
            torch.empty(1, dtype=torch.float32), requires_grad=False)
            if self.scheme.static_input else None)
        layer.register_parameter("bias", nn.Parameter(torch.empty(out_features))
                                 if bias else None)
        layer.gemm_plan = None
        layer.act_dtype = torch.get_default_dtype()  # the model's dtype while it is built

    def checkpoint_tensors(self, layer: nn.Module) -> tuple[str, ...]:
        names = ["weight"] + (["bias"] if layer.bias is not None else [])
        if self.scheme.serialized:
            names.append(self.scheme.scale_name)
        if self.scheme.static_input:
            names.append("input_scale")
        return tuple(names)

    # ---- loading ----

    def load(self, layer: nn.Module, name: str, key: Any, tensor: Any) -> None:
        if name == "weight":
            self._load_weight(layer, key, tensor)
        elif name == self.scheme.scale_name and self.scheme.serialized:
            self._load_scale(layer, key, tensor)
        elif name == "input_scale" and self.scheme.static_input:
            value = _read(tensor).float()
            if value.numel() != 1:
                raise ValueError(f"has shape {list(value.shape)}; a per-tensor input scale "
                                 "has one value")
            seen = self._input_parts
            v = value.reshape(1).to(layer.input_scale.device)
            # fused parts share their input: the largest scale covers every part's range
            layer.input_scale.data.copy_(torch.maximum(layer.input_scale.data, v) if seen else v)
            seen.add(key)
        else:
            super().load(layer, name, key, tensor)

    def _load_weight(self, layer: nn.Module, key: Any, tensor: Any) -> None:
        load_weight(self.scheme, layer.weight.data, layer.weight_scale.data,
                    layer.shards["weight"], key, tensor)

    def _load_scale(self, layer: nn.Module, key: Any, tensor: Any) -> None:
        load_scale(self.scheme, layer.weight_scale.data, (layer.out_features, layer.in_features),
                   layer.shards["weight"], key, tensor)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if layer.weight.device.type == "cuda":
            layer.gemm_plan = plan_gemm(layer, self.group_k)
            layer.fused_input = envs.FP8_FUSED_INPUT.get() != "0"

    # ---- compute ----

    def output_dtype(self, layer: nn.Module) -> torch.dtype:
        return layer.act_dtype

    def takes_quantized_input(self, layer: nn.Module, m: int) -> bool:
        """Per-token dynamic activations into a kernel that quantizes them: the norm or
        activation before may deliver them quantized (saving a kernel and a pass)."""
        plan = layer.gemm_plan
        return (plan is not None and not self.batch_invariant and layer.fused_input
                and self.group_k is None and not self.scheme.static_input
                and plan.choose(m).split("/")[0] in QUANTIZED_INPUT)

    def apply(self, layer: nn.Module, x: torch.Tensor | k.QuantizedActivations,
              bias: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:
        plan = layer.gemm_plan  # None: CPU, where the weights are dequantized
        with scope("fp8_gemm"):
            if self.batch_invariant and not isinstance(x, k.QuantizedActivations):
                y = invariant_fp8(layer, x, self.group_k)
            elif isinstance(x, k.QuantizedActivations):  # quantized by the norm or SwiGLU
                y = run_quantized(plan.choose(x.q.shape[0]), layer, x)
            else:
                shape = x.shape
                x2 = x.reshape(-1, shape[-1])
                gemm = plan.choose(x2.shape[0]) if plan is not None else "dequantize"
                y = run_gemm(gemm, layer, x2.contiguous(), self.group_k)
                y = y.reshape(*shape[:-1], y.shape[-1])
        if bias is not None:
            y = y + bias
        return out.copy_(y) if out is not None else y


INVARIANT_TILE = "64x64x128"  # --batch-invariant's tile for every M (kernels.TILES)


def invariant_fp8(layer: nn.Module, x: torch.Tensor, group_k: int | None) -> torch.Tensor:
    """``x W^T`` for --batch-invariant: each row's bits its own whatever the other rows
    (``Fp8.batch_invariant``)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x.is_cuda and k.HAVE_TRITON:
        y = k.scaled_gemm(x2.contiguous(), None, layer.weight, layer.weight_scale, x.dtype,
                          group_k, INVARIANT_TILE)
    else:
        y = invariant_linear(x2, k.dequantize(layer.weight, layer.weight_scale, x.dtype,
                                              group_k))
    return y.reshape(*shape[:-1], y.shape[-1])


def load_weight(scheme: Fp8Scheme, weight: torch.Tensor, scales: torch.Tensor, shard: Shard,
                key: Any, tensor: Any) -> None:
    """Checkpoint weight ``tensor`` (part ``key``) into this rank's rows or columns of the e4m3
    ``weight`` [out, in]: copied when it is e4m3 already (its scales come apart), else quantized
    per output row (per row and K group with ``scheme.block``) with its scales into ``scales``
    [out, K_groups]. ValueError when it does not fit."""
    dim, _ = shard
    seg, part = take_segment(weight, shard, key, tensor)
    dest = weight.narrow(dim, seg.offset, seg.size)
    if part.dtype == k.E4M3:
        if not scheme.serialized:
            raise ValueError("is FP8 but the checkpoint's config names no FP8 quantization")
        dest.copy_(part)
        return
    q, scale = k.quantize_weight(part.to(dest.device), scheme.block[1] if scheme.block else None)
    dest.copy_(q)
    if dim == 0:
        scales[seg.offset:seg.offset + seg.size].copy_(scale)
    else:
        scales.copy_(scale)


def load_scale(scheme: Fp8Scheme, scales: torch.Tensor, weight_shape: tuple[int, int],
               shard: Shard, key: Any, tensor: Any) -> None:
    """A checkpoint scale (per tensor, per channel or per block) of part ``key`` of a weight of
    this rank's ``weight_shape`` [out, in] into this rank's rows of ``scales``, rows expanded.
    ValueError when its shape does not fit."""
    dim, segs = shard
    seg = next(s for s in segs if s.key == key)
    rows = seg.full if dim == 0 else weight_shape[0]
    cols = weight_shape[1] if dim == 0 else seg.full
    s = _read(tensor).float()
    block = scheme.block
    if block is None:
        want = "one value" if scheme.per_tensor else f"[{rows}] or [{rows}, 1]"
        ok = s.numel() == 1 if scheme.per_tensor else tuple(s.shape) in ((rows,), (rows, 1))
        if not ok:
            kind = "per-tensor" if scheme.per_tensor else "per-channel"
            raise ValueError(f"has shape {list(s.shape)}; a {kind} scale of a [{rows}, {cols}] "
                             f"weight has {want}")
        full = s.reshape(-1, 1).expand(rows, 1)
    else:
        br, bc = block
        shape = (math.ceil(rows / br), math.ceil(cols / bc))
        if tuple(s.shape) != shape:
            raise ValueError(f"has shape {list(s.shape)}; {br}x{bc} blocks of a "
                             f"[{rows}, {cols}] weight make it {list(shape)}")
        full = s.repeat_interleave(br, dim=0)[:rows]
        if dim == 1:  # this rank's K blocks
            if seg.start % bc:
                raise ValueError(f"cannot be split over tensor-parallel ranks: a rank's input "
                                 f"features start at {seg.start}, inside a block of {bc}")
            full = full[:, seg.start // bc: math.ceil((seg.start + seg.size) / bc)]
    if dim == 0:
        scales[seg.offset:seg.offset + seg.size].copy_(full[seg.start:seg.start + seg.size])
    else:
        scales.copy_(full)


def _read(tensor: Any) -> torch.Tensor:
    return tensor if isinstance(tensor, torch.Tensor) else tensor[:]
