"""Megatron-style sharded layers for tensor parallelism, and how each parameter's shard is cut
from the full (checkpoint or dummy) tensors.

- ``ColumnParallelLinear``: each rank holds some output features (rows of the weight); fused
  projections (q/k/v, gate/up) take their rows from each part separately.
- ``RowParallelLinear``: each rank holds some input features; partial sums are all-reduced and
  the bias is added once after.
- ``VocabParallelEmbedding``: each rank holds a slice of the vocabulary (padded to a multiple of
  the ranks); lookups outside it give zeros, then an all-reduce. As the LM head, each rank's
  logits for its slice are all-gathered.

A sharded layer's ``shards`` name, per parameter, the dimension it is split along and its
segments: for each checkpoint tensor it is made of, which rows (or columns) of that tensor this
rank holds and where they go (on the module, since moving a model off the meta device makes new
parameters). With one rank the
layers are plain ``nn.Linear`` / ``nn.Embedding`` maths and every segment is the whole tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedgen.runtime.parallel import TensorParallel


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


class ColumnParallelLinear(nn.Linear):
    """``y = x W^T + b`` for this rank's output features: ``parts`` are the (key, rows of the
    full tensor, this rank's segment) of each fused checkpoint tensor, in order."""

    def __init__(self, in_features: int, parts: list[tuple[Any, Segment]], bias: bool) -> None:
        segs, offset = [], 0
        for key, s in parts:
            segs.append(Segment(key, s.full, s.start, s.size, offset))
            offset += s.size
        super().__init__(in_features, offset, bias=bias)
        self.shards = {"weight": (0, segs), **({"bias": (0, segs)} if bias else {})}


class RowParallelLinear(nn.Linear):
    """``y = all_reduce(x_rank W_rank^T) + b`` over this rank's input features."""

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 tp: TensorParallel) -> None:
        seg = split(in_features, tp, "a row-parallel layer's input features")
        super().__init__(seg.size, out_features, bias=bias)
        self.tp = tp
        self.shards = {"weight": (1, [seg])}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.linear_all_reduce(x, self.weight)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """An embedding table of which this rank holds rows ``[lo, lo + rows)``; padded rows of the
    last rank stay zero. ``logits`` uses it as the LM head."""

    def __init__(self, vocab_size: int, dim: int, tp: TensorParallel) -> None:
        super().__init__()
        self.vocab_size, self.tp = vocab_size, tp
        self.rows = -(-vocab_size // tp.size)
        self.lo = tp.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, dim))
        have = max(0, min(self.rows, vocab_size - self.lo))
        self.shards = {"weight": (0, [Segment(None, vocab_size, self.lo, have, 0)])}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.lo
        inside = (local >= 0) & (local < self.rows)
        x = F.embedding(local.clamp(0, self.rows - 1), self.weight) * inside.unsqueeze(-1)
        return self.tp.all_reduce(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits over the whole vocabulary: this rank's slice computed here, the
        others gathered."""
        local = F.linear(hidden, self.weight).float()
        return self.tp.all_gather(local)[..., :self.vocab_size]


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
        param.copy_(tensor[:])
        return
    dim, segs = shard
    seg = next(s for s in segs if s.key == key)
    if seg.size:
        rows = (slice(None),) * dim + (slice(seg.start, seg.start + seg.size),)
        param.narrow(dim, seg.offset, seg.size).copy_(tensor[rows])
    _zero_padding(param, shard)


def _zero_padding(param: torch.Tensor, shard: Shard) -> None:
    """Zero the rows after the last segment (the last rank's vocabulary padding)."""
    dim, segs = shard
    end = segs[-1].offset + segs[-1].size
    if end < param.shape[dim]:
        param.narrow(dim, end, param.shape[dim] - end).zero_()
