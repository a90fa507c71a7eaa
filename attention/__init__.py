"""Attention backends over a paged KV cache (see backend.py for the interface)."""

from pagedgen.attention.backend import (
                                        AttentionBackend,
                                        AttentionImpl,
                                        AttentionState,
                                        AttentionType,
                                        LayerSpec,
)
from pagedgen.attention.metadata import AttentionMetadata, AttentionMetadataBuilder, ScheduledSeq
from pagedgen.attention.registry import backend_names, backend_status, get_backend

__all__ = ["AttentionBackend", "AttentionImpl", "AttentionMetadata", "AttentionMetadataBuilder",
           "AttentionState", "AttentionType", "LayerSpec", "ScheduledSeq", "backend_names",
           "backend_status", "get_backend"]
