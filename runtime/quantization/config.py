"""Which weight format a model's layers run with (``QuantConfig``, made by
``registry.quant_config`` from the checkpoint's ``quantization_config`` or ``--quantization``),
and for each linear layer the method it gets (``method_for``; a MoE layer's experts:
``moe_method_for``). Format-neutral: each format is a package (``fp8/``, ``mxfp4/``) whose
``WeightFormat`` says what its scheme gives a layer."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from pagedgen.errors import PagedgenError
from pagedgen.runtime.quantization.base import MoeMethod, QuantizationMethod, WeightFormat


@dataclass(frozen=True)
class QuantConfig:
    """``name`` (the format's), its ``scheme`` every quantized layer follows, the checkpoint's
    module names (or ``re:`` patterns) left in the model's dtype, and ``experts``: a
    checkpoint's experts-only format kept under a format applied at load (gpt-oss's MXFP4
    experts under ``--quantization fp8``)."""

    name: str
    fmt: WeightFormat
    scheme: Any = None
    ignore: tuple[str, ...] = field(default=())
    experts: QuantConfig | None = None

    def method_for(self, names: list[str]) -> QuantizationMethod | None:
        """The method of a linear layer made of the checkpoint modules ``names`` (fused
        projections have several); None: dense. PagedgenError when the checkpoint left only
        some of a fused layer's parts dense."""
        return None if self._dense(names) else self.fmt.linear_method(self.scheme)

    def moe_method_for(self, names: list[str]) -> MoeMethod | None:
        """The method of a MoE layer's experts, whose checkpoint tensors are ``names``
        (every expert's projections); None: dense, as the checkpoint leaves them."""
        own = self.experts or self
        return None if own._dense(names) else own.fmt.moe_method(own.scheme)

    def formats(self) -> list[WeightFormat]:
        return [self.fmt] + ([self.experts.fmt] if self.experts else [])

    def _dense(self, names: list[str]) -> bool:
        skipped = [self._ignored(n) for n in names]
        if any(skipped) and not all(skipped):
            raise PagedgenError(f"the checkpoint quantizes only some of {', '.join(names)}; "
                                "fused projections must be quantized alike")
        return all(skipped)

    def _ignored(self, name: str) -> bool:
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.fullmatch(pattern[3:], name):
                    return True
            elif name == pattern or name.endswith("." + pattern) or name.startswith(
                    pattern + "."):
                return True
        return False

    def describe(self) -> str:
        return f"{self.name}: {self.describe_scheme()}"

    def describe_scheme(self) -> str:
        own = self.fmt.describe(self.scheme)
        return own + (f"; experts {self.experts.describe()}" if self.experts else "")


def linear_method(quant: QuantConfig | None, prefix: str, parts: list[str]
                  ) -> QuantizationMethod | None:
    """The method of the linear layer made of checkpoint modules ``parts`` under ``prefix``
    (None: dense)."""
    return quant.method_for([f"{prefix}.{p}" for p in parts]) if quant else None
