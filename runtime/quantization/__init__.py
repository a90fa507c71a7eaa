"""Quantization methods for linear layers (``base.QuantizationMethod``), by name; which one a
model's layers get is ``config.quant_config``'s answer."""

from __future__ import annotations

from pagedgen.errors import PagedgenError
from pagedgen.runtime.quantization.base import QuantizationMethod
from pagedgen.runtime.quantization.fp8 import Fp8
from pagedgen.runtime.quantization.unquantized import Unquantized

METHODS: dict[str, type[QuantizationMethod]] = {Unquantized.name: Unquantized, Fp8.name: Fp8}


def get_method(name: str | None) -> QuantizationMethod:
    """A fresh method called ``name`` (None: dense weights)."""
    cls = METHODS.get(name or Unquantized.name)
    if cls is None:
        raise PagedgenError(f"unknown quantization '{name}'; known: {', '.join(METHODS)}")
    return cls()


__all__ = ["METHODS", "QuantizationMethod", "get_method"]
