"""Which quantization a model runs with: the checkpoint's own (its config's
``quantization_config``) or the one asked for (``--quantization``), and for each linear layer
the method it gets (``QuantConfig.method_for``; a MoE layer's experts: ``moe_method_for``).

Checkpoint formats read (FP8 only; anything else is a one-line error naming the field):
* Hugging Face ``{"quant_method": "fp8", "weight_block_size": [128, 128],
  "activation_scheme": "dynamic", "modules_to_not_convert": [...]}``: e4m3 ``weight`` and
  ``weight_scale_inv`` per block (no ``weight_block_size``: one ``weight_scale`` per tensor, as
  vLLM reads such files;
  ``activation_scheme: static``: an ``input_scale`` per tensor too).
* compressed-tensors ``{"quant_method": "compressed-tensors", "format": "float-quantized",
  "config_groups": {...: {"targets": ["Linear"], "weights": {"type": "float", "num_bits": 8,
  "strategy": "channel" | "tensor" | "block", ...}, "input_activations": {"dynamic": true |
  false, ...}}}, "ignore": [...]}``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedgen.errors import PagedgenError
from pagedgen.runtime.quantization.base import MoeMethod, QuantizationMethod
from pagedgen.runtime.quantization.fp8 import ONLINE, Fp8, Fp8Scheme
from pagedgen.runtime.quantization.fp8_moe import Fp8Moe

QUANTIZATIONS = ("fp8",)  # what --quantization accepts
CHECKPOINT_METHODS = ("fp8", "compressed-tensors")


@dataclass(frozen=True)
class QuantConfig:
    """``name`` ("fp8"), the ``scheme`` every quantized layer follows, and the checkpoint's
    module names (or ``re:`` patterns) left in the model's dtype."""

    name: str
    scheme: Fp8Scheme
    ignore: tuple[str, ...] = field(default=())

    def method_for(self, names: list[str]) -> QuantizationMethod | None:
        """The method of a linear layer made of the checkpoint modules ``names`` (fused
        projections have several); None: dense. PagedgenError when the checkpoint left only
        some of a fused layer's parts dense."""
        skipped = [self._ignored(n) for n in names]
        if all(skipped):
            return None
        if any(skipped):
            raise PagedgenError(f"the checkpoint quantizes only some of {', '.join(names)}; "
                                "fused projections must be quantized alike")
        return Fp8(self.scheme)

    def moe_method_for(self, names: list[str]) -> MoeMethod | None:
        """The method of a MoE layer's experts, whose checkpoint tensors are ``names``
        (every expert's projections); None: dense, as the checkpoint leaves them."""
        return Fp8Moe(self.scheme) if self.method_for(names) is not None else None

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
        return f"{self.name}: {self.scheme.describe()}"


def linear_method(quant: QuantConfig | None, prefix: str, parts: list[str]
                  ) -> QuantizationMethod | None:
    """The method of the linear layer made of checkpoint modules ``parts`` under ``prefix``
    (None: dense)."""
    return quant.method_for([f"{prefix}.{p}" for p in parts]) if quant else None


def quant_config(hf_config: Any, requested: str | None, where: str) -> QuantConfig | None:
    """The model's quantization: the checkpoint's ``quantization_config`` if it has one (then
    ``requested`` must be None or the same), else ``requested`` applied at load (None: none)."""
    if requested is not None and requested not in QUANTIZATIONS:
        raise PagedgenError(f"unknown quantization '{requested}'; use "
                            f"{', '.join(QUANTIZATIONS)}")
    fields = getattr(hf_config, "quantization_config", None)
    if fields is None:
        return QuantConfig(requested, ONLINE, ("lm_head",)) if requested else None
    if not isinstance(fields, dict):
        raise PagedgenError(f"{where}: quantization_config must be a mapping")
    method = fields.get("quant_method")
    if method == "fp8":
        cfg = _hf_fp8(fields, where)
    elif method == "compressed-tensors":
        cfg = _compressed_tensors(fields, where)
    else:
        raise PagedgenError(f"{where}: quantization_config.quant_method {method!r} is not "
                            f"supported (supported: {', '.join(CHECKPOINT_METHODS)} with FP8 "
                            "weights)")
    if requested not in (None, cfg.name):
        raise PagedgenError(f"{where}: the checkpoint is quantized ({cfg.name}); it runs with "
                            f"its own quantization, not --quantization {requested}")
    return cfg


def check_device(cfg: QuantConfig | None, device: torch.device) -> None:
    """FP8 GEMMs need FP8 tensor cores (compute capability 8.9: Ada, Hopper and later)."""
    if cfg is None or device.type != "cuda":
        return
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        raise PagedgenError(f"FP8 weights need a GPU with FP8 tensor cores (compute capability "
                            f"8.9 or later: Ada, Hopper); {torch.cuda.get_device_name(device)} "
                            f"is {cap[0]}.{cap[1]}")


def _hf_fp8(f: dict[str, Any], where: str) -> QuantConfig:
    act = f.get("activation_scheme", "dynamic")
    if act not in ("dynamic", "static"):
        raise PagedgenError(f"{where}: quantization_config.activation_scheme {act!r} is not "
                            "dynamic or static")
    block = f.get("weight_block_size")
    if block is not None:
        block = _block(block, "quantization_config.weight_block_size", where)
        if act == "static":
            raise PagedgenError(f"{where}: block-quantized weights with static activation "
                                "scales are not supported (activation_scheme: static)")
        scheme = Fp8Scheme(serialized=True, block=block, scale_name="weight_scale_inv")
    else:
        scheme = Fp8Scheme(serialized=True, per_tensor=True, static_input=act == "static")
    ignore = f.get("modules_to_not_convert") or []
    return QuantConfig("fp8", scheme, _names(ignore, "modules_to_not_convert", where))


def _compressed_tensors(f: dict[str, Any], where: str) -> QuantConfig:
    key = "quantization_config"
    if f.get("format") not in ("float-quantized", None):
        raise PagedgenError(f"{where}: {key}.format {f.get('format')!r} is not supported "
                            "(float-quantized FP8 only)")
    groups = f.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise PagedgenError(f"{where}: {key}.config_groups must hold exactly one group "
                            "(one scheme for every linear layer)")
    name, group = next(iter(groups.items()))
    at = f"{key}.config_groups.{name}"
    if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
        raise PagedgenError(f"{where}: {at}.weights must be a mapping")
    targets = group.get("targets", ["Linear"])
    if targets != ["Linear"]:
        raise PagedgenError(f"{where}: {at}.targets {targets!r} is not supported (['Linear'])")
    w = group["weights"]
    if w.get("type") != "float" or w.get("num_bits") != 8:
        raise PagedgenError(f"{where}: {at}.weights must be type float, num_bits 8 (FP8), not "
                            f"{w.get('type')!r}, {w.get('num_bits')!r}")
    if w.get("symmetric", True) is not True or w.get("dynamic", False):
        raise PagedgenError(f"{where}: {at}.weights must be symmetric and static")
    strategy = w.get("strategy")
    act = group.get("input_activations")
    static = False
    if act is not None:
        if not isinstance(act, dict) or act.get("type", "float") != "float" \
                or act.get("num_bits", 8) != 8:
            raise PagedgenError(f"{where}: {at}.input_activations must be FP8 (type float, "
                                "num_bits 8)")
        static = not act.get("dynamic", True)
        if static and act.get("strategy", "tensor") != "tensor":
            raise PagedgenError(f"{where}: {at}.input_activations: static scales must be "
                                f"per tensor, not {act.get('strategy')!r}")
    if strategy == "block":
        block = _block(w.get("block_structure"), f"{at}.weights.block_structure", where)
        if static:
            raise PagedgenError(f"{where}: {at}: block weights with static activation scales "
                                "are not supported")
        scheme = Fp8Scheme(serialized=True, block=block)
    elif strategy in ("channel", "tensor"):
        scheme = Fp8Scheme(serialized=True, per_tensor=strategy == "tensor",
                           static_input=static)
    else:
        raise PagedgenError(f"{where}: {at}.weights.strategy {strategy!r} is not supported "
                            "(channel, tensor or block)")
    return QuantConfig("fp8", scheme, _names(f.get("ignore") or [], f"{key}.ignore", where))


def _block(value: Any, key: str, where: str) -> tuple[int, int]:
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or any(isinstance(v, bool) or not isinstance(v, int) or v < 16 or v & (v - 1)
                   for v in value)):
        raise PagedgenError(f"{where}: {key} must be two powers of two >= 16, not {value!r}")
    return int(value[0]), int(value[1])


def _names(value: Any, key: str, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise PagedgenError(f"{where}: quantization_config's {key} must be a list of names")
    return tuple(value)
