"""The model's attention layer over the paged KV cache: the selected backend's AttentionImpl
(bound by the model runner once the backend's state exists), under the profiler's scope."""

from __future__ import annotations

import torch
from torch import nn

from pagedgen.attention.backend import AttentionImpl, LayerSpec
from pagedgen.attention.metadata import AttentionMetadata
from pagedgen.attention.ops.profiling import scope


class PagedAttention(nn.Module):
    """q [T, Hq, D], k/v [T, Hkv, D] of the step's new tokens → output [T, Hq, D]."""

    def __init__(self, spec: LayerSpec) -> None:
        super().__init__()
        self.spec = spec
        self.impl: AttentionImpl | None = None  # bound by the model runner

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        with scope("attention"):
            return self.impl.forward(q, k, v, kv_cache, metadata)
