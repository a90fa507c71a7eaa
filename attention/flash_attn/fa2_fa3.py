"""FlashAttention-3's (``flash_attn_interface``; SM90) and FlashAttention-2's (``flash_attn``;
SM80+, pages of a multiple of 256 tokens) paged prefill and decode calls. They take no output
tensor: ``copied`` writes their result into the step's (as FA4 writes it)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedgen.attention.backend import LayerSpec
from pagedgen.attention.flash_attn.flavours import common
from pagedgen.attention.metadata import AttentionMetadata


def copied(call: Callable) -> Callable:
    """An FA2/FA3 call (which take no output tensor) with FA4's ``out``: copied into it."""
    return lambda *args, out=None: call(*args) if out is None else out.copy_(call(*args))


def fa3_calls(mod, split_kv: bool) -> tuple[Callable, Callable]:
    fn = mod.flash_attn_with_kvcache

    def prefill(q, k_cache, v_cache, md: AttentionMetadata, spec: LayerSpec) -> torch.Tensor:
        return fn(q, k_cache, v_cache, cache_seqlens=md.seq_lens, page_table=md.block_tables,
                  cu_seqlens_q=md.query_start_loc, max_seqlen_q=md.max_query_len,
                  **common(spec, (-1, -1)))

    def decode(q, k_cache, v_cache, md: AttentionMetadata, spec: LayerSpec) -> torch.Tensor:
        return fn(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=md.seq_lens,
                  page_table=md.block_tables, num_splits=0, **common(spec, (-1, -1))).squeeze(1)

    return copied(prefill), copied(decode), None


def fa2_calls(mod, split_kv: bool) -> tuple[Callable, Callable]:
    def prefill(q, k_cache, v_cache, md: AttentionMetadata, spec: LayerSpec) -> torch.Tensor:
        cu_seqlens_k = F.pad(md.seq_lens.cumsum(0, dtype=torch.int32), (1, 0))
        return mod.flash_attn_varlen_func(
            q, k_cache, v_cache, cu_seqlens_q=md.query_start_loc, cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=md.max_query_len, max_seqlen_k=md.max_seq_len,
            block_table=md.block_tables, **common(spec, (-1, -1)))

    def decode(q, k_cache, v_cache, md: AttentionMetadata, spec: LayerSpec) -> torch.Tensor:
        return mod.flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache,
                                           cache_seqlens=md.seq_lens, block_table=md.block_tables,
                                           num_splits=0, **common(spec, (-1, -1))).squeeze(1)

    return copied(prefill), copied(decode), None
