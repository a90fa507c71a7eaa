"""The recurrent state of linear-attention layers: a slot per running sequence.

A gated-delta layer's slot holds the delta-rule matrix [value heads, value dim, key dim] (a row
of key weights per value channel, so that a kernel's block of rows is one span of memory, and
FlashInfer's chunked prefill reads it as it is; in ``ssm_dtype`` where the checkpoint's config
names one: Qwen3.5's say float32, as the serving stacks keep it) and the causal convolution's
last ``K - 1`` inputs [K - 1, conv channels] (in the model's dtype: a row per input, so a
step's kernels read and write it along the channels). Slots are handed out with the sequences (a
sequence holds one while it runs: ``runtime/engine/block_manager.py``); the last slot is the
scratch slot that CUDA-graph padding rows write. A fork (``n`` samples) copies its parent's
slot; a preempted sequence's slot is freed and rebuilt by the recompute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pagedgen import buffers


@dataclass(frozen=True)
class GatedDeltaSpec:
    """One gated-delta layer's shape (on this rank): ``num_k_heads`` query/key heads of
    ``head_k`` features, ``num_v_heads`` value heads of ``head_v``, and a causal convolution of
    ``conv_kernel`` taps over the q, k and v channels; the delta-rule matrix in ``ssm_dtype``
    (None: the model's dtype)."""

    num_k_heads: int
    num_v_heads: int
    head_k: int
    head_v: int
    conv_kernel: int
    ssm_dtype: torch.dtype | None = None

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.head_k + self.num_v_heads * self.head_v

    def shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(conv state, delta-rule state) shapes of one slot."""
        return ((self.conv_kernel - 1, self.conv_dim),
                (self.num_v_heads, self.head_v, self.head_k))

    def dtypes(self, dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
        """(conv state, delta-rule state) dtypes in a model of ``dtype``."""
        return dtype, self.ssm_dtype or dtype

    def slot_bytes(self, dtype: torch.dtype) -> int:
        return sum(math.prod(s) * d.itemsize for s, d in zip(self.shapes(), self.dtypes(dtype)))

    def state_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of state a decode token reads and writes (the whole slot, both ways)."""
        return 2 * self.slot_bytes(dtype)


@dataclass
class LayerState:
    """One layer's slots: ``conv`` [slots, K - 1, C], ``ssm`` [slots, Hv, Dv, Dk]."""

    conv: torch.Tensor
    ssm: torch.Tensor


class RecurrentStates:
    """Every linear-attention layer's ``slots`` state slots (the last: the scratch slot), zeroed,
    in a model of ``dtype`` (``GatedDeltaSpec.dtypes``)."""

    def __init__(self, specs: list[GatedDeltaSpec], slots: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.specs = specs
        self.num_slots = slots
        self.scratch_slot = slots - 1
        self.dtype = dtype
        self.layers = [LayerState(*(buffers.zeros((slots, *shape), d, device)
                                    for shape, d in zip(s.shapes(), s.dtypes(dtype))))
                       for s in specs]

    @staticmethod
    def bytes_per_slot(specs: list[GatedDeltaSpec], dtype: torch.dtype) -> int:
        return sum(s.slot_bytes(dtype) for s in specs)

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.bytes_per_slot(self.specs, self.dtype)

    def copy(self, pairs: torch.Tensor) -> None:
        """Slot ``pairs[:, 0]`` → ``pairs[:, 1]`` in every layer (forked samples)."""
        src, dst = pairs[:, 0], pairs[:, 1]
        for layer in self.layers:
            layer.conv[dst] = layer.conv[src]
            layer.ssm[dst] = layer.ssm[src]
