"""How each parameter of a tensor-parallel layer (``linear.py``, ``embedding.py``) is cut from
the full (checkpoint or dummy) tensors.

A sharded layer's ``shards`` name, per parameter, the dimension it is split along and its
segments: for each checkpoint tensor it is made of, which rows (or columns) of that tensor this
rank holds and where they go (on the module, since moving a model off the meta device makes new
parameters). With one rank every segment is the whole tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagedgen.runtime.collectives.parallel import TensorParallel


@dataclass(frozen=True)
class Segment:
    """Rows ``[start, start + size)`` (along ``tp_dim``) of the checkpoint tensor ``key`` (of
    ``full`` rows) are this rank's rows ``[offset, offset + size)`` of the parameter."""

    key: Any  # shard id of the checkpoint tensor within a fused parameter (None: unfused)
    full: int
    start: int
    size: int
    offset: int


def split(full: int, tp: TensorParallel, what: str) -> Segment:
    """This rank's even share of ``full`` rows."""
    if full % tp.size:
        raise ValueError(f"{what} ({full}) is not divisible by the tensor-parallel size "
                         f"{tp.size}")
    n = full // tp.size
    return Segment(None, full, tp.rank * n, n, 0)


Shard = tuple[int, list[Segment]]  # (split dimension, segments)


def shard_map(model: nn.Module) -> dict[str, Shard]:
    """Parameter name → how it is sharded, for every sharded parameter of ``model``."""
    return {f"{name}.{p}" if name else p: shard
            for name, m in model.named_modules() for p, shard in getattr(m, "shards", {}).items()}


def full_shape(param: torch.Tensor, shard: Shard | None) -> torch.Size:
    """The shape of the unsharded tensor (the fused parts' full tensors, stacked)."""
    if shard is None:
        return param.shape
    dim, segs = shard
    shape = list(param.shape)
    shape[dim] = sum(s.full for s in segs)
    return torch.Size(shape)


def copy_shard(param: torch.Tensor, shard: Shard, full: torch.Tensor) -> None:
    """Fill ``param`` with this rank's part of the unsharded ``full`` (``full_shape``)."""
    dim, segs = shard
    base = 0
    for s in segs:
        param.narrow(dim, s.offset, s.size).copy_(full.narrow(dim, base + s.start, s.size))
        base += s.full
    _zero_padding(param, shard)


def checkpoint_shape(param: torch.Tensor, shard: Shard | None, key: Any) -> tuple[int, ...]:
    """The shape the checkpoint tensor ``key`` of ``param`` must have (unsharded, unfused)."""
    if shard is None:
        return tuple(param.shape)
    dim, segs = shard
    shape = list(param.shape)
    shape[dim] = next(s for s in segs if s.key == key).full
    return tuple(shape)


def load_segment(param: torch.Tensor, shard: Shard | None, key: Any, tensor) -> None:
    """Copy this rank's rows of checkpoint tensor ``tensor`` (a torch tensor, or a safetensors
    slice read lazily: only those rows leave the file) into ``param``'s segment ``key``."""
    if shard is None:
        param.copy_(tensor[...])  # whole (``...``: a 0-dim tensor takes no slice)
        return
    dim, segs = shard
    seg = next(s for s in segs if s.key == key)
    if seg.size:
        rows = (slice(None),) * dim + (slice(seg.start, seg.start + seg.size),)
        param.narrow(dim, seg.offset, seg.size).copy_(tensor[rows])
    _zero_padding(param, shard)


def check_shape(param: torch.Tensor, shard: Shard | None, key: Any, tensor) -> None:
    """ValueError (``has shape ...``; the caller names the tensor) when checkpoint tensor
    ``tensor`` (a torch tensor or a lazy safetensors slice) is not the shape part ``key`` of
    ``param`` needs."""
    want = checkpoint_shape(param, shard, key)
    have = tuple(tensor.get_shape() if hasattr(tensor, "get_shape") else tensor.shape)
    if have != want:
        raise ValueError(f"has shape {list(have)}; the config makes it {list(want)}")


def take_segment(param: torch.Tensor, shard: Shard, key: Any, tensor) -> tuple[Segment,
                                                                                 torch.Tensor]:
    """The segment ``key`` of ``param`` and this rank's rows (or columns) of checkpoint tensor
    ``tensor`` for it (read from a lazy slice: only those leave the file); ValueError when the
    tensor's shape does not fit."""
    dim, segs = shard
    check_shape(param, shard, key, tensor)
    seg = next(s for s in segs if s.key == key)
    rows = (slice(None),) * dim + (slice(seg.start, seg.start + seg.size),)
    return seg, tensor[rows]


def _zero_padding(param: torch.Tensor, shard: Shard) -> None:
    """Zero the rows after the last segment (the last rank's vocabulary padding)."""
    dim, segs = shard
    end = segs[-1].offset + segs[-1].size
    if end < param.shape[dim]:
        param.narrow(dim, end, param.shape[dim] - end).zero_()
