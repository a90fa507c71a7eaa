"""FP8 experts (``MoeMethod``): e4m3 stacked weights with float32 scales whose rows follow the
weights' (``w13_weight_scale`` [E, 2I, K groups], ``w2_weight_scale`` [E, H, K groups]: one group
per row, or per block of the checkpoint's ``weight_block_size``), loaded or quantized per expert
tensor as an FP8 linear layer's are (``fp8.load_weight``, ``fp8.load_scale``). The grouped GEMMs
multiply them without dequantizing (``ExpertScales``); on the CPU they are dequantized for the
loop. A checkpoint's static ``input_scale`` of an expert is read and not used (activations are
quantized dynamically, per token)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from pagedgen.runtime.quantization.base import MoeMethod
from pagedgen.runtime.quantization.fp8.kernels import E4M3, dequantize, quantize_weight
from pagedgen.runtime.quantization.fp8.scheme import ONLINE, Fp8Scheme, load_scale, load_weight


@dataclass(frozen=True)
class ExpertScales:
    """FP8 experts' float32 weight scales, rows as their weights' (``w13`` [E, 2I, G(H)],
    ``w2`` [E, H, G(I)]), over K groups of ``group_k`` columns (None: one scale per row); or
    MXFP4 experts' e8m0 exponents (uint8, ``group_k`` 32: ``mxfp4/moe.py``; ``small_exponents``:
    each at most ``mxfp4.FOLD_MAX_EXPONENT``, which the GPU converts with one multiply fewer)."""

    w13: torch.Tensor
    w2: torch.Tensor
    group_k: int | None = None
    small_exponents: bool = False

    @classmethod
    def quantize(cls, w13: torch.Tensor, w2: torch.Tensor, group_k: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, ExpertScales]:
        """e4m3 copies of both stacked weights and their scales (per row, or per row and K
        group of ``group_k`` columns): experts whole on one device (tests, benchmarks)."""
        out = []
        for w in (w13, w2):
            q, s = quantize_weight(w.reshape(-1, w.shape[2]), group_k)
            out.append((q.view(w.shape), s.view(w.shape[0], w.shape[1], -1)))
        return out[0][0], out[1][0], cls(out[0][1], out[1][1], group_k)

    def dequantize(self, w13: torch.Tensor, w2: torch.Tensor, dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Both weights as ``dtype`` tensors (the per-expert loop's input on the CPU)."""
        return tuple(
            dequantize(w.reshape(-1, w.shape[2]), s.reshape(-1, s.shape[2]), dtype,
                       self.group_k).view(w.shape)
            for w, s in ((w13, self.w13), (w2, self.w2)))


class Fp8Moe(MoeMethod):
    name: ClassVar[str] = "fp8"
    quantized: ClassVar[bool] = True

    def __init__(self, scheme: Fp8Scheme = ONLINE) -> None:
        self.scheme = scheme
        self.group_k: int | None = scheme.block[1] if scheme.block else None

    def create_weights(self, layer: nn.Module, num_experts: int, hidden: int,
                       width: int) -> None:
        layer.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * width, hidden, dtype=E4M3),
                                        requires_grad=False)
        layer.w2_weight = nn.Parameter(torch.empty(num_experts, hidden, width, dtype=E4M3),
                                       requires_grad=False)

        def groups(k: int) -> int:
            return 1 if self.group_k is None else -(-k // self.group_k)

        layer.w13_weight_scale = nn.Parameter(torch.empty(
            num_experts, 2 * width, groups(hidden), dtype=torch.float32), requires_grad=False)
        layer.w2_weight_scale = nn.Parameter(torch.empty(
            num_experts, hidden, groups(width), dtype=torch.float32), requires_grad=False)

    def extra_kinds(self) -> tuple[str, ...]:
        return (self.scheme.scale_name,) if self.scheme.serialized else ()

    def skipped_kinds(self) -> tuple[str, ...]:
        return ("input_scale",) if self.scheme.static_input else ()

    def load(self, layer: nn.Module, e: int, part: str, kind: str, tensor: Any, shard,
             key: Any) -> None:
        name = "w2_weight" if part == "down" else "w13_weight"
        expert = getattr(layer, name).data[e]
        scales = getattr(layer, f"{name}_scale").data[e]
        if kind == "weight":
            load_weight(self.scheme, expert, scales, shard, key, tensor)
        else:
            load_scale(self.scheme, scales, tuple(expert.shape), shard, key, tensor)

    def scales(self, layer: nn.Module) -> ExpertScales:
        return ExpertScales(layer.w13_weight_scale, layer.w2_weight_scale, self.group_k)

    def dense(self, layer: nn.Module, dtype: torch.dtype
              ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.scales(layer).dequantize(layer.w13_weight, layer.w2_weight, dtype)
