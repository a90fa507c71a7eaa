"""Backend registry: select a backend by name, or ``auto`` for the best one that runs here."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from pagedgen.attention.backend import AttentionBackend
from pagedgen.errors import BackendCannotRun, PagedgenError

# name -> "module:Class"; modules are imported lazily so a missing optional package only
# makes its own backend unavailable.
_BACKENDS: dict[str, str] = {
    "flashinfer": "pagedgen.attention.flashinfer:FlashInferBackend",
    "flash-attn": "pagedgen.attention.flash_attn.backend:FlashAttnBackend",
    "triton": "pagedgen.attention.triton_attn:TritonBackend",
    "sdpa": "pagedgen.attention.sdpa:SdpaBackend",
    "eager": "pagedgen.attention.eager:EagerBackend",
}
# `auto` takes the first available backend in this order (measured on the H100: README,
# "Backends"). flash-attn leads only with FA4 or FA3, whose page sizes are free; FA2's paged
# kernels need pages of 256 tokens, where flashinfer is the better default.
_AUTO_ORDER = {"cuda": ["flash-attn", "flashinfer", "triton", "sdpa", "eager"],
               "cpu": ["sdpa", "eager"]}
_AUTO_FLAVOURS = {"flash-attn": ("fa4", "fa3")}


def register_backend(name: str, target: str) -> None:
    """Add a backend ("module:Class"); used by plugins and tests."""
    _BACKENDS[name] = target


def backend_names() -> list[str]:
    return list(_BACKENDS)


def _load(name: str) -> type[AttentionBackend]:
    module, cls = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


@dataclass
class BackendStatus:
    name: str
    available: bool
    reason: str  # why not, or a short description of what runs
    lacks: str = ""  # the layer features it cannot run (``auto`` passes over such models)


def backend_status(device: torch.device) -> list[BackendStatus]:
    """Every registered backend with whether it runs on ``device`` and why not."""
    rows = []
    for name in _BACKENDS:
        lacks = ""
        try:
            cls = _load(name)
            why = cls.unavailable_reason(device)
            what = cls.describe(device) if why is None else ""
            lacks = ", ".join(cls.lacks())
        except Exception as e:  # a broken optional install must not break the listing
            why = f"failed to load: {type(e).__name__}: {e}"
        rows.append(BackendStatus(name, why is None, why or what, lacks))
    return rows


def unavailable_reason(name: str, device: torch.device) -> str | None:
    """Why backend ``name`` (a registered one, not ``auto``) cannot run on ``device``, or None;
    loads only that backend."""
    try:
        return _load(name).unavailable_reason(device)
    except Exception as e:
        return f"failed to load: {type(e).__name__}: {e}"


def _auto_flavour_ok(name: str, device: torch.device) -> bool:
    """Whether ``auto`` may take backend ``name`` for the flavour it would run here."""
    flavours = _AUTO_FLAVOURS.get(name)
    return flavours is None or _load(name).flavour(device).name in flavours


def _why_not(cls: type[AttentionBackend], device: torch.device, specs: list,
             dtype: torch.dtype, kv_dtype: torch.dtype) -> str | None:
    """Why ``cls`` cannot run these layers (a soft cap, a window, a head size, the dtype, an
    FP8 KV cache), or None."""
    for spec in specs:
        why = cls.check_layer(spec, dtype)
        if why:
            return why
    return cls.fp8_kv_reason(device) if kv_dtype.itemsize == 1 else None


def _auto_candidates(device: torch.device) -> Iterator[type[AttentionBackend]]:
    """The backends ``auto`` may take here, best first (never the eager reference on a GPU),
    each loaded only when asked for."""
    for cand in _AUTO_ORDER.get(device.type, ["eager"]):
        if cand == "eager" and device.type == "cuda":  # the reference is for checks only
            break
        if cand in _BACKENDS and unavailable_reason(cand, device) is None \
                and _auto_flavour_ok(cand, device):
            yield _load(cand)


def backends_for_groups(name: str, device: torch.device, groups: list[list],
                        dtype: torch.dtype, kv_dtype: torch.dtype, model: str,
                        whole: list[bool] | None = None
                        ) -> tuple[type[AttentionBackend], list[type[AttentionBackend]]]:
    """The backend whose layout the KV slabs take, and each KV group's (``groups``: each
    group's layer specs; ``whole``: whether its layers fill their slabs' pages). A named
    backend runs every group (``backend_for_model``). ``auto`` gives each group the best
    backend that runs its layers (Gemma 4: FA4 on the 256-wide window layers, triton on the
    512-wide global ones) where the mix shares one pool: every backend but one reads a cache
    of any strides and page size (``reads_any_strides``: it attends through a view of the
    other's slabs), and that one runs only groups whose layers fill their pages (its caches
    are then its own layout, unstrided); otherwise one backend runs the model."""
    chosen: list[type[AttentionBackend] | None] = [None] * len(groups)
    if name == "auto":
        for cls in _auto_candidates(device):  # best first, until every group has one
            chosen = [c or (cls if _why_not(cls, device, g, dtype, kv_dtype) is None
                            and (cls.reads_any_strides or fills) else None)
                      for c, g, fills in zip(chosen, groups, whole or [True] * len(groups))]
            if None not in chosen:
                break
    fixed = {c for c in chosen if c is not None and not c.reads_any_strides}
    if None in chosen or len(fixed) > 1 or len(set(chosen)) == 1:  # one backend: as named
        one = backend_for_model(name, device, [s for g in groups for s in g], dtype, kv_dtype,
                                model)
        return one, [one] * len(groups)
    return (fixed.pop() if fixed else chosen[0]), chosen


def backend_for_model(name: str, device: torch.device, specs: list, dtype: torch.dtype,
                      kv_dtype: torch.dtype, model: str) -> type[AttentionBackend]:
    """``get_backend`` for a model of these layer ``specs``: ``auto`` passes over backends
    that cannot run one of its layers (a soft cap, a window, a head size, the dtype, an FP8
    KV cache) for the next that can, and on a GPU never takes the eager reference (it says
    why none can); a named one that cannot is a one-line error."""
    if name != "auto":
        cls = get_backend(name, device)
        why = _why_not(cls, device, specs, dtype, kv_dtype)
        if why:
            raise BackendCannotRun(f"backend '{cls.name}' cannot run {model}: {why}")
        return cls
    reasons = []
    for cls in _auto_candidates(device):
        why = _why_not(cls, device, specs, dtype, kv_dtype)
        if why is None:
            return cls
        reasons.append(f"{cls.name}: {why}")
    hint = (": the eager reference (float32, every page dense) is for checks, not runs; "
            "--backend eager runs it anyway" if device.type == "cuda" else "")
    if kv_dtype.itemsize == 1 and device.type == "cuda":
        hint += "; --kv-cache-dtype auto keeps the model's dtype"
    raise PagedgenError(f"no attention backend here runs {model} on {device} "
                        f"({'; '.join(reasons) or 'none is available'}){hint}")


def get_backend(name: str, device: torch.device) -> type[AttentionBackend]:
    """The backend called ``name`` (or the best for ``device`` when ``auto``). Loads only the
    backends it considers (a named one; for ``auto``, candidates up to the first that runs),
    so choosing one never pays for importing the others' libraries.

    Raises PagedgenError with a one-line reason when it is unknown or cannot run here.
    """
    if name == "auto":
        for cand in _AUTO_ORDER.get(device.type, ["eager"]):
            if cand in _BACKENDS and unavailable_reason(cand, device) is None \
                    and _auto_flavour_ok(cand, device):
                return _load(cand)
        raise PagedgenError(f"no attention backend runs on {device}")
    why = unavailable_reason(name, device) if name in _BACKENDS else "unknown"
    if why is None:
        return _load(name)
    available = ", ".join(s.name for s in backend_status(device) if s.available)
    if name not in _BACKENDS:
        raise PagedgenError(f"unknown backend '{name}'; available here: {available}")
    raise PagedgenError(f"backend '{name}' is unavailable on {device}: {why}; "
                        f"available here: {available}")
