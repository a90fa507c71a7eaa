"""The MXFP4 weight format (``WeightFormat``; ``quant_method: mxfp4``, as gpt-oss ships): the
experts 4-bit (``moe.Mxfp4Moe``), every linear layer dense. The checkpoint holds each expert
tensor as a pair, ``X_blocks`` [E, rows, groups, 16] and ``X_scales`` [E, rows, groups]
(``checkpoint_tensors`` checks each pair whole and hands it on as ``X`` [E, rows, groups * 16]
and ``X_scales``); under -tp each rank's share of the experts' width is whole scale groups."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

from pagedgen.runtime.quantization.base import MoeMethod, WeightFormat
from pagedgen.runtime.quantization.mxfp4 import codes
from pagedgen.runtime.quantization.mxfp4.moe import Mxfp4Moe


class Mxfp4Format(WeightFormat):
    name: ClassVar[str] = "mxfp4"
    checkpoint_methods: ClassVar[tuple[str, ...]] = ("mxfp4",)

    def from_checkpoint(self, fields: dict[str, Any], where: str) -> tuple[None, tuple[()]]:
        return None, ()  # one layout; the linear layers it names dense are all of them

    def linear_method(self, scheme: None) -> None:
        return None

    def moe_method(self, scheme: None) -> MoeMethod:
        return Mxfp4Moe()

    def describe(self, scheme: None) -> str:
        return "e2m1 experts with e8m0 scales per 32, linear layers dense"

    def checkpoint_tensors(self, weights: Iterable[tuple[str, Any]]
                           ) -> Iterable[tuple[str, Any]]:
        pending: dict[str, Any] = {}
        for name, tensor in weights:
            base, _, kind = name.rpartition("_")
            if kind not in ("blocks", "scales"):
                yield name, tensor
                continue
            other = pending.pop(f"{base}_{'scales' if kind == 'blocks' else 'blocks'}", None)
            if other is None:
                pending[name] = tensor
                continue
            blocks, scales = (tensor, other) if kind == "blocks" else (other, tensor)
            blocks, scales = blocks[:], scales[:]
            try:
                codes.check_pair(blocks, scales)
            except ValueError as e:
                raise ValueError(f"'{base}': {e}") from None
            yield base, blocks.flatten(-2)
            yield f"{base}_scales", scales
        if pending:
            raise ValueError(f"'{next(iter(pending))}' has no MXFP4 partner (blocks and scales "
                             "come in pairs)")

    def experts_split_error(self, width: int, tp_size: int) -> str | None:
        if width % (tp_size * codes.GROUP):
            return (f"intermediate_size {width} cannot be split over {tp_size} tensor-parallel "
                    f"ranks in whole MXFP4 groups of {codes.GROUP}")
        return None
