"""Weight formats: ``base`` (the interfaces: a linear layer's ``QuantizationMethod``, a MoE
layer's ``MoeMethod``, a format's ``WeightFormat``), ``unquantized`` (dense weights), one package
per format (``fp8/``, ``mxfp4/``), ``registry`` (the formats by name), ``config`` (a model's
``QuantConfig``)."""

from __future__ import annotations

from pagedgen.errors import PagedgenError
from pagedgen.runtime.quantization.base import QuantizationMethod
from pagedgen.runtime.quantization.unquantized import Unquantized

METHODS: dict[str, type[QuantizationMethod]] = {Unquantized.name: Unquantized}


def get_method(name: str | None) -> QuantizationMethod:
    """A fresh method called ``name`` (None: dense weights)."""
    cls = METHODS.get(name or Unquantized.name)
    if cls is None:
        raise PagedgenError(f"unknown quantization '{name}'; known: {', '.join(METHODS)}")
    return cls()


__all__ = ["METHODS", "QuantizationMethod", "get_method"]
