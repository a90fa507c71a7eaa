"""The weight formats this build runs, by the checkpoint's ``quant_method`` and by
``--quantization``: one line each in ``FORMATS`` (a new format is a package beside ``fp8/``
and ``mxfp4/`` plus its line here), and the model's ``QuantConfig`` made from them."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch

from pagedgen.errors import PagedgenError
from pagedgen.runtime.quantization import fp8, mxfp4
from pagedgen.runtime.quantization.base import WeightFormat
from pagedgen.runtime.quantization.config import QuantConfig

FORMATS: tuple[WeightFormat, ...] = (
    fp8.FORMAT,
    mxfp4.FORMAT,
)


def online_names() -> list[str]:
    """What ``--quantization`` accepts."""
    return [f.name for f in FORMATS if f.online]


def checkpoint_format(fields: Any) -> WeightFormat | None:
    """The format of a checkpoint's ``quantization_config`` ``fields`` (None: none known)."""
    method = fields.get("quant_method") if isinstance(fields, dict) else None
    return next((f for f in FORMATS if method in f.checkpoint_methods), None)


def quant_config(hf_config: Any, requested: str | None, where: str) -> QuantConfig | None:
    """The model's quantization: the checkpoint's ``quantization_config`` if it has one (then
    ``requested`` must be None or the same; an experts-only format keeps its experts under
    ``requested``), else ``requested`` applied at load (None: none)."""
    online = next((f for f in FORMATS if f.online and f.name == requested), None)
    if requested is not None and online is None:
        raise PagedgenError(f"unknown quantization '{requested}'; use "
                            f"{', '.join(online_names())}")
    at_load = QuantConfig(online.name, online, *online.at_load()) if online else None
    fields = getattr(hf_config, "quantization_config", None)
    if fields is None:
        return at_load
    if not isinstance(fields, dict):
        raise PagedgenError(f"{where}: quantization_config must be a mapping")
    fmt = checkpoint_format(fields)
    if fmt is None:
        known = ", ".join(m for f in FORMATS for m in f.checkpoint_methods)
        raise PagedgenError(f"{where}: quantization_config.quant_method "
                            f"{fields.get('quant_method')!r} is not supported (supported: "
                            f"{known})")
    own = QuantConfig(fmt.name, fmt, *fmt.from_checkpoint(fields, where))
    if at_load is None or requested == fmt.name:
        return own
    if fmt.linear_method(own.scheme) is None:  # experts only (MXFP4): kept, linears at load
        return dataclasses.replace(at_load, experts=own)
    raise PagedgenError(f"{where}: the checkpoint is quantized ({fmt.name}); it runs with its "
                        f"own quantization, not --quantization {requested}")


def check_device(cfg: QuantConfig | None, device: torch.device) -> None:
    """A PagedgenError where ``device`` cannot run a format of ``cfg``."""
    for fmt in cfg.formats() if cfg else ():
        fmt.check_device(device)


def checkpoint_tensors(cfg: QuantConfig | None, weights: Iterable[tuple[str, Any]]
                       ) -> Iterable[tuple[str, Any]]:
    """A checkpoint's tensors as ``cfg``'s formats' methods load them."""
    for fmt in cfg.formats() if cfg else ():
        weights = fmt.checkpoint_tensors(weights)
    return weights


def experts_split_error(hf_config: Any, width: int, tp_size: int) -> str | None:
    """Why the checkpoint's format cannot split experts of ``width`` over ``tp_size`` ranks."""
    fmt = checkpoint_format(getattr(hf_config, "quantization_config", None))
    return fmt.experts_split_error(width, tp_size) if fmt else None
