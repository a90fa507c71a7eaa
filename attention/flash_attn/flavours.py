"""The flash-attn family's members (``PAGEDGEN_FLASH_ATTN=fa4|fa3|fa2`` picks one, else the
first that runs here: FA4, FA3, FA2), what each accepts, and the keywords their kernel calls
share."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass
from functools import cache

import torch

from pagedgen import envs
from pagedgen.attention.backend import LayerSpec

INSTALL_HINT = "pip install 'pagedgen[flash-attn]'"
ENV_FLAVOUR = envs.FLASH_ATTN.name


@dataclass(frozen=True)
class Flavour:
    """One member of the flash-attn family: how to find it and what it accepts."""

    name: str
    module: str  # imported by the state; its presence is probed without importing it
    dists: tuple[str, ...]  # distribution names, for the version
    cc_majors: tuple[int, ...]  # compute-capability majors it runs on
    block_sizes: tuple[int, ...] | None  # page sizes its paged kernels accept (None: any)
    default_block_size: int
    probe: str | None = None  # a module whose presence proves the flavour (default: module)


FLAVOURS = (
    # Page 128 = FA4's key tile (hdim 64/128): pages load by TMA (SM90: default_page_size).
    Flavour("fa4", "flash_attn.cute", ("flash-attn-4",), (9, 10, 11), None, 128),
    Flavour("fa3", "flash_attn_interface", ("flash_attn_3", "flash-attn-3"), (9,), None, 16),
    Flavour("fa2", "flash_attn", ("flash-attn",), (8, 9, 10, 11, 12), (256, 512), 256,
            probe="flash_attn_2_cuda"),
)
BY_NAME = {f.name: f for f in FLAVOURS}


def installed(f: Flavour) -> bool:
    try:
        return importlib.util.find_spec(f.probe or f.module) is not None
    except (ImportError, ValueError):  # a parent package that is missing or broken
        return False


def version(f: Flavour) -> str:
    for dist in f.dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "version unknown"


def flavour_reason(f: Flavour, device: torch.device) -> str | None:
    """None when flavour ``f`` can run on ``device``; otherwise why not."""
    if not installed(f):
        return f"{f.module} is not installed"
    if device.type != "cuda":
        return f"needs a CUDA GPU, not {device.type}"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in f.cc_majors:
        return f"runs on SM{'/SM'.join(f'{m}x' for m in f.cc_majors)}, not SM{major}{minor}"
    return None


@cache
def select_flavour(device: torch.device) -> tuple[Flavour | None, str]:
    """The flavour to run on ``device`` (``$PAGEDGEN_FLASH_ATTN`` or the first that runs), and a
    one-line account of every flavour."""
    reasons = {f.name: flavour_reason(f, device) for f in FLAVOURS}
    notes = "; ".join(f"{n}: {r or version(BY_NAME[n])}" for n, r in reasons.items())
    want = envs.FLASH_ATTN.get()
    if want:
        if want not in BY_NAME:
            return None, f"{ENV_FLAVOUR}={want} is not one of {', '.join(BY_NAME)}"
        f = BY_NAME[want]
        return (f, notes) if reasons[want] is None else (None, f"{want}: {reasons[want]}")
    for f in FLAVOURS:
        if reasons[f.name] is None:
            return f, notes
    return None, notes


def common(spec: LayerSpec, no_window: tuple) -> dict:
    """The keywords every flavour's calls share; ``no_window``: how the flavour spells "no
    sliding window" (FA4 (None, None), FA2/FA3 (-1, -1))."""
    window = (spec.sliding_window - 1, 0) if spec.sliding_window else no_window
    return dict(softmax_scale=spec.scale, causal=True, window_size=window,
                softcap=spec.logits_soft_cap or 0.0)


def default_page_size(f: Flavour, device: torch.device) -> int:
    """The page size flavour ``f`` runs with when none is asked for; FA4 on SM90: 64, where
    decode's 64-key tile still loads whole pages by TMA. A sequence's last page, and the page
    where a shared prefix ends, are half empty on average: at 128, KV for fewer sequences at
    once (workload s on an H100: 10,946 against 12,044 tok/s at 64; benchmarks/results/LOG.md)."""
    sm90 = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
    return 64 if f.name == "fa4" and sm90 else f.default_block_size
