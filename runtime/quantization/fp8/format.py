"""The FP8 weight format (``WeightFormat``): what it reads from a checkpoint and what it
gives a layer. Checkpoint formats read (anything else is a one-line error naming the field):

* Hugging Face ``{"quant_method": "fp8", "weight_block_size": [128, 128],
  "activation_scheme": "dynamic", "modules_to_not_convert": [...]}``: e4m3 ``weight`` and
  ``weight_scale_inv`` per block (no ``weight_block_size``: one ``weight_scale`` per tensor, as
  vLLM reads such files; ``activation_scheme: static``: an ``input_scale`` per tensor too).
* compressed-tensors ``{"quant_method": "compressed-tensors", "format": "float-quantized",
  "config_groups": {...: {"targets": ["Linear"], "weights": {"type": "float", "num_bits": 8,
  "strategy": "channel" | "tensor" | "block", ...}, "input_activations": {"dynamic": true |
  false, ...}}}, "ignore": [...]}``.

``--quantization fp8`` quantizes a dense checkpoint's linear layers (not the LM head) and MoE
experts per output channel as they load.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from pagedgen.errors import PagedgenError
from pagedgen.runtime.quantization.base import MoeMethod, QuantizationMethod, WeightFormat
from pagedgen.runtime.quantization.fp8.moe import Fp8Moe
from pagedgen.runtime.quantization.fp8.scheme import ONLINE, Fp8, Fp8Scheme


class Fp8Format(WeightFormat):
    name: ClassVar[str] = "fp8"
    checkpoint_methods: ClassVar[tuple[str, ...]] = ("fp8", "compressed-tensors")
    online: ClassVar[bool] = True

    def from_checkpoint(self, fields: dict[str, Any], where: str
                        ) -> tuple[Fp8Scheme, tuple[str, ...]]:
        if fields.get("quant_method") == "fp8":
            return _hf_fp8(fields, where)
        return _compressed_tensors(fields, where)

    def at_load(self) -> tuple[Fp8Scheme, tuple[str, ...]]:
        return ONLINE, ("lm_head",)

    def linear_method(self, scheme: Fp8Scheme) -> QuantizationMethod:
        return Fp8(scheme)

    def moe_method(self, scheme: Fp8Scheme) -> MoeMethod:
        return Fp8Moe(scheme)

    def describe(self, scheme: Fp8Scheme) -> str:
        return scheme.describe()

    def check_device(self, device: torch.device) -> None:
        """FP8 GEMMs need FP8 tensor cores (compute capability 8.9: Ada, Hopper and later)."""
        if device.type != "cuda":
            return
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            raise PagedgenError(f"FP8 weights need a GPU with FP8 tensor cores (compute "
                                f"capability 8.9 or later: Ada, Hopper); "
                                f"{torch.cuda.get_device_name(device)} is {cap[0]}.{cap[1]}")


def _hf_fp8(f: dict[str, Any], where: str) -> tuple[Fp8Scheme, tuple[str, ...]]:
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
    return scheme, _names(ignore, "modules_to_not_convert", where)


def _compressed_tensors(f: dict[str, Any], where: str) -> tuple[Fp8Scheme, tuple[str, ...]]:
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
    return scheme, _names(f.get("ignore") or [], f"{key}.ignore", where)


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
