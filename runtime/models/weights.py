"""Checkpoint tensors into a model's (partly fused, maybe sharded, maybe quantized) parameters:
the loading every family shares.

A checkpoint name maps to a module and a parameter of ours (fused projections through the
family's ``stacked`` table: ``q_proj`` → ``qkv_proj``, part ``"q"``). A linear layer's tensors go
to its quantization method (``load``: the dense copy, or FP8 weights and scales), every other
parameter is copied as it is. A module that loads its own tensors (a MoE layer's experts,
named one by one or stacked) takes every name under its prefix: ``load_checkpoint_tensor(rest,
tensor)`` returns the units it filled, ``checkpoint_units()`` names those it needs. Each
tensor's shape is checked first, and every tensor the model needs must come: a misshapen,
unexpected or missing one is a ValueError naming it (the caller names the file). So is an FP8
tensor bound for a layer the model holds dense (its config does not quantize that layer): copied,
it would lose its scale and load silently wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from pagedgen.runtime.collectives.sharding import check_shape, load_segment, shard_map

Stacked = dict[str, tuple[str, Any]]  # checkpoint module name → (our fused module, part key)


def load_checkpoint(model: nn.Module, weights: Iterable[tuple[str, Any]], stacked: Stacked,
                    skip: Callable[[str], bool] = lambda name: False) -> None:
    """Copy ``weights`` ((name, tensor or lazy slice)) into ``model``; ``skip(name)``: tensors
    the model does not use (rotary caches, a tied LM head)."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    shards = shard_map(model)
    owners = _self_loading(model)
    loaded: set[tuple[str, Any]] = set()

    def load(name: str, tensor) -> list[tuple[str, Any]]:
        """Load one checkpoint tensor; the (parameter or module, part) units it filled.
        KeyError: the model has no place for it."""
        owner = _owner(name, owners)
        dtype = tensor_dtype(tensor)
        fp8 = dtype in FP8_DTYPES
        if owner is not None:
            method = getattr(owners[owner], "method", None)
            if fp8 and (method is None or method.name != "fp8"):
                raise ValueError(DENSE_FP8)
            units = owners[owner].load_checkpoint_tensor(name[len(owner) + 1:], tensor)
            return [(owner, u) for u in units]
        target, key = name, None
        for ckpt, (fused, part) in stacked.items():  # where the model fused that module
            fused_name = name.replace(f".{ckpt}.", f".{fused}.")
            if f".{ckpt}." in name and fused_name.rpartition(".")[0] in modules:
                target, key = fused_name, part
                break
        prefix, _, attr = target.rpartition(".")
        method = getattr(modules.get(prefix), "quant_method", None)
        if method is not None and attr in method.checkpoint_tensors(modules[prefix]):
            if fp8 and method.name != "fp8":
                raise ValueError(DENSE_FP8)
            method.load(modules[prefix], attr, key, tensor)
        elif target in params and key is None:
            if fp8 and params[target].dtype != dtype:
                raise ValueError(DENSE_FP8)
            check_shape(params[target], shards.get(target), None, tensor)
            load_segment(params[target].data, shards.get(target), None, tensor)
        else:
            raise KeyError(name)
        return [(target, key)]

    for name, tensor in weights:
        if skip(name):
            continue
        try:
            with torch.no_grad():
                loaded.update(load(name, tensor))
        except KeyError:
            raise ValueError(f"unexpected tensor '{name}' (not in a "
                             f"{getattr(model.config, 'model_type', '')} model of this config)"
                             ) from None
        except ValueError as e:
            raise ValueError(f"tensor '{name}' {e}") from None
    missing = _missing(model, stacked, loaded)
    if missing:
        raise ValueError(f"missing {len(missing)} tensor(s), e.g. '{missing[0]}'")


DENSE_FP8 = ("is FP8, but this model holds its layer dense: the checkpoint's "
             "quantization_config does not quantize it (or is missing)")
FP8_DTYPES = {torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


class FiniteChecked:
    """A checkpoint tensor (a lazy safetensors slice, a GGUF tensor) whose every read
    (``[:]``, ``[rows]``) is checked for NaN and infinities as it loads: damaged bytes would
    otherwise run as a model that answers nothing (a ValueError names the first bad element;
    the loader names the file and the tensor)."""

    def __init__(self, tensor) -> None:
        self._tensor = tensor

    def __getitem__(self, index):
        out = self._tensor[index]
        bad = first_nonfinite(out)
        if bad is not None:
            raise ValueError(f"holds a non-finite value ({bad[1]}) at {list(bad[0])}: the "
                             "file is damaged")
        return out

    def __getattr__(self, name: str):
        return getattr(self._tensor, name)


def first_nonfinite(t: torch.Tensor) -> tuple[tuple[int, ...], str] | None:
    """(index, "nan"/"inf") of a tensor's first non-finite element, or None; one cheap pass
    (``aminmax`` propagates NaN) in the common case of none."""
    if t.numel() == 0 or not (t.is_floating_point()):
        return None
    if t.element_size() == 1:  # FP8: NaN bit patterns (e4m3fn has no infinity)
        bits = t.view(torch.uint8)
        mask = 0x7C if t.dtype == torch.float8_e5m2 else 0x7F
        bad = (bits & mask) == mask
        if not bool(bad.any()):
            return None
        return tuple(bad.nonzero()[0].tolist()), "nan or inf"
    lo, hi = torch.aminmax(t)
    if bool(torch.isfinite(lo)) and bool(torch.isfinite(hi)):
        return None
    at = (~torch.isfinite(t)).nonzero()[0]
    return tuple(at.tolist()), "nan" if bool(t[tuple(at.tolist())].isnan()) else "inf"


def tensor_dtype(tensor) -> torch.dtype | str | None:
    """A torch tensor's dtype, or a lazy safetensors slice's (as torch's where it is FP8);
    None for a source that dequantizes as it reads (GGUF)."""
    if isinstance(tensor, torch.Tensor):
        return tensor.dtype
    if not hasattr(tensor, "get_dtype"):
        return None
    name = tensor.get_dtype()
    return next((d for d, n in FP8_DTYPES.items() if n == name), name)


def _self_loading(model: nn.Module) -> dict[str, nn.Module]:
    return {prefix: m for prefix, m in model.named_modules()
            if hasattr(m, "load_checkpoint_tensor")}


def _owner(name: str, owners: dict[str, nn.Module]) -> str | None:
    """The prefix of the self-loading module ``name`` falls under, if any."""
    if not owners:
        return None
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in owners:
            return prefix
    return None


def expected_tensors(model: nn.Module, stacked: Stacked) -> dict[tuple[str, Any], str]:
    """(our parameter or self-loading module, part key) → the checkpoint name, for every
    tensor the model needs."""
    unfuse = {(fused, part): ckpt for ckpt, (fused, part) in stacked.items()}
    out: dict[tuple[str, Any], str] = {}
    covered: set[str] = set()
    for prefix, module in _self_loading(model).items():
        out |= {(prefix, unit): f"{prefix}.{rest}"
                for unit, rest in module.checkpoint_units().items()}
        covered |= {f"{prefix}.{n}" for n, _ in module.named_parameters()}
    for prefix, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is None:
            continue
        dim, segs = module.shards["weight"]
        keys = [s.key for s in segs] if dim == 0 else [None]
        owner, _, leaf = prefix.rpartition(".")
        for attr in method.checkpoint_tensors(module):
            covered.add(f"{prefix}.{attr}")
            for key in keys:
                ckpt = unfuse.get((leaf, key), leaf) if key is not None else leaf
                out[(f"{prefix}.{attr}", key)] = f"{owner}.{ckpt}.{attr}".lstrip(".")
        covered |= {f"{prefix}.{n}" for n, _ in module.named_parameters(recurse=False)}
    for name, _ in model.named_parameters():
        if name not in covered:
            out[(name, None)] = name
    return out


def _missing(model: nn.Module, stacked: Stacked, loaded: set[tuple[str, Any]]) -> list[str]:
    need = expected_tensors(model, stacked)
    return [need[k] for k in sorted(set(need) - loaded, key=str)]
