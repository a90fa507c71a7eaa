"""The model's attention layer over the paged KV cache: the selected backend's AttentionImpl
(bound by the model runner once the backend's state exists), under the profiler's scope; or,
while piecewise CUDA graphs hold the model (runtime/worker/piecewise_graphs.py), their
``split`` in its place. It attends with its KV group's metadata (``kv_group``: a window
layer's own pages, ``AttentionMetadata.group``). A layer with sinks (``LayerSpec.sinks``)
holds them as a parameter [num_heads] in float32 and hands them to the impl it is bound to."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pagedgen.attention.backend import AttentionImpl, LayerSpec
from pagedgen.attention.metadata import AttentionMetadata
from pagedgen.profiling import scope


class PagedAttention(nn.Module):
    """q [T, Hq, D], k/v [T, Hkv, D] of the step's new tokens → output [T, Hq, D]."""

    def __init__(self, spec: LayerSpec) -> None:
        super().__init__()
        self.spec = spec
        self.sinks = nn.Parameter(torch.zeros(spec.num_heads, dtype=torch.float32),
                                  requires_grad=False) if spec.sinks else None
        self._impl: AttentionImpl | None = None
        self.kv_group = 0  # its KV group (runtime/engine/kv_groups.py), set by the runner
        # set by piecewise CUDA graphs while they run or capture the model: (q, k, v) → output
        self.split: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None \
            = None

    @property
    def impl(self) -> AttentionImpl | None:
        """The backend's implementation, bound by the model runner (with the layer's sinks)."""
        return self._impl

    @impl.setter
    def impl(self, impl: AttentionImpl | None) -> None:
        self._impl = impl
        if impl is not None:
            impl.sinks = self.sinks

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        if self.split is not None:
            return self.split(q, k, v)
        with scope("attention"):
            return self.impl.forward(q, k, v, kv_cache, metadata.group(self.kv_group))
