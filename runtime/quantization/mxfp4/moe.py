"""MXFP4 experts (``MoeMethod``) kept 4-bit: ``w13_weight`` [E, 2I, H / 2] and ``w2_weight``
[E, H, I / 2] hold two e2m1 codes a byte, ``w13_weight_scale`` [E, H / 32, 2I] and
``w2_weight_scale`` [E, I / 32, H] their e8m0 exponents, in the grouped GEMM's layout
(``mxfp4.to_kernel_layout``: each group's bytes reordered, the exponents group-major), into
which gpt-oss's checkpoint tensors (``*_blocks``, ``*_scales``) are loaded. The kernels convert
them in registers (``moe.kernels``: the bf16 weights never exist in memory); the CPU's
per-expert loop dequantizes them each call. Dense tensors (dummy weights) are quantized at
load. Under -tp each rank holds its rows of gate/up and its columns of down, in whole scale
groups."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from pagedgen.runtime.collectives.sharding import Segment, check_shape, load_segment
from pagedgen.runtime.quantization.base import MoeMethod
from pagedgen.runtime.quantization.fp8.moe import ExpertScales
from pagedgen.runtime.quantization.mxfp4 import codes as mxfp4

PER_BYTE = 2


class Mxfp4Moe(MoeMethod):
    name: ClassVar[str] = "mxfp4"
    quantized: ClassVar[bool] = True

    def create_weights(self, layer: nn.Module, num_experts: int, hidden: int,
                       width: int) -> None:
        for name, rows, k in (("w13_weight", 2 * width, hidden), ("w2_weight", hidden, width)):
            if k % mxfp4.GROUP:
                raise ValueError(f"MXFP4 experts need input widths that are multiples of "
                                 f"{mxfp4.GROUP} (this one: {k})")
            setattr(layer, name, nn.Parameter(torch.empty(
                num_experts, rows, k // PER_BYTE, dtype=torch.uint8), requires_grad=False))
            setattr(layer, f"{name}_scale", nn.Parameter(torch.empty(
                num_experts, k // mxfp4.GROUP, rows, dtype=torch.uint8), requires_grad=False))

    def extra_kinds(self) -> tuple[str, ...]:
        return ("scales",)

    def load(self, layer: nn.Module, e: int, part: str, kind: str, tensor: Any, shard,
             key: Any) -> None:
        """The codes (``weight``: [rows, K / 2] uint8; or a dense [rows, K] tensor, quantized
        here) or the exponents (``scales``: [rows, K / 32]) of expert ``e``'s projection
        ``part``, into the kernel layout (the exponents through a transposed view)."""
        name = "w2_weight" if part == "down" else "w13_weight"
        layer.mxfp4_small_exponents = None  # asked again of the weights as loaded
        codes, exps = getattr(layer, name).data[e], getattr(layer, f"{name}_scale").data[e].T
        tensor = tensor[:]
        pairs = [(codes if kind == "weight" else exps, tensor)]
        if kind == "weight" and tensor.dtype != torch.uint8:  # dense: quantized as stored
            blocks, scales = mxfp4.quantize(tensor)
            pairs = [(codes, blocks.flatten(-2)), (exps, scales)]
        for param, t in pairs:
            if param is codes:
                t = mxfp4.kernel_codes(t)
            # down's shard runs along K: in bytes of codes or in scale groups there
            per = (PER_BYTE if param is codes else mxfp4.GROUP) if part == "down" else 1
            part_shard = _in_units(shard, per)
            check_shape(param, part_shard, key, t)
            load_segment(param, part_shard, key, t)

    def scales(self, layer: nn.Module) -> ExpertScales:
        """The exponents, and whether all are small (asked once after loading, a host sync:
        the layer's kernel plan asks first, before any graph is captured)."""
        small = getattr(layer, "mxfp4_small_exponents", None)
        if small is None:
            small = layer.mxfp4_small_exponents = mxfp4.small_exponents(
                layer.w13_weight_scale, layer.w2_weight_scale)
        return ExpertScales(layer.w13_weight_scale, layer.w2_weight_scale, mxfp4.GROUP, small)

    def dense(self, layer: nn.Module, dtype: torch.dtype
              ) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(mxfp4.dequantize(*mxfp4.from_kernel_layout(w, s), dtype)
                     for w, s in ((layer.w13_weight, layer.w13_weight_scale),
                                  (layer.w2_weight, layer.w2_weight_scale)))


def _in_units(shard, per: int):
    """``shard`` (rows of values) in units of ``per`` values (a byte of codes, a scale
    group); ValueError where a rank's share would split one."""
    dim, segs = shard
    if any(v % (mxfp4.GROUP if per > 1 else 1) for s in segs for v in (s.start, s.size)):
        raise ValueError(f"MXFP4 experts shard in whole groups of {mxfp4.GROUP}: each rank's "
                         "intermediate width must be a multiple of it")
    return dim, [Segment(s.key, s.full // per, s.start // per, s.size // per, s.offset // per)
                 for s in segs]
