"""Cascade attention for decode: a KV prefix every sequence of the batch shares is attended once
for the whole batch, then each sequence attends its own suffix, and the two results are merged
by their log-sum-exp (as FlashInfer's cascade and vLLM's ``use_cascade_attention`` do).

Without it, each of B decodes re-reads the shared prefix's K/V: B x prefix tokens per layer.
With it, the prefix is read once, by a prefill-shaped kernel whose B queries form one
non-causal sequence. The shared prefix is whole pages: the leading block-table entries equal in
every row (prefix caching and parallel sampling make sequences share them), short of each
sequence's newest token.

This module holds what every cascade-capable backend shares: the prefix and suffix inputs
(:class:`CascadeInputs`, fresh per eager step or static for a CUDA graph) and the merge
(:func:`merge`). When a step cascades is the metadata builder's call
(``metadata.common_prefix_blocks``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedgen.attention.metadata import AttentionMetadata

@dataclass
class CascadeInputs:
    """The two halves of a cascade step, as device tensors.

    * ``prefix_table`` [1, >= P] int32: the shared pages; ``prefix_lens`` [1] int32: their tokens.
    * ``suffix_tables`` [B, width] int32: each sequence's pages after the shared ones;
      ``suffix_lens`` [B] int32: its tokens there (at least 1: CUDA-graph padding rows, whose
      one token is not behind the prefix, attend one scratch token).
    * ``suffix_lens_cpu``: the same lengths on the host, for backends that plan there.
    """

    prefix_table: torch.Tensor
    prefix_lens: torch.Tensor
    suffix_tables: torch.Tensor
    suffix_lens: torch.Tensor
    suffix_lens_cpu: list[int]

    @classmethod
    def for_step(cls, md: AttentionMetadata) -> CascadeInputs:
        """Fresh tensors for an eager decode step with ``md.cascade_blocks`` shared pages."""
        rows, width = md.block_tables.shape
        return cls.static(rows, width, md.block_tables.device).fill(md)

    @classmethod
    def static(cls, batch_size: int, width: int, device: torch.device) -> CascadeInputs:
        """Buffers a CUDA graph of ``batch_size`` decodes captures; :meth:`fill` each step."""
        i32 = torch.int32
        return cls(torch.zeros(1, width, dtype=i32, device=device),
                   torch.ones(1, dtype=i32, device=device),
                   torch.zeros(batch_size, width, dtype=i32, device=device),
                   torch.ones(batch_size, dtype=i32, device=device), [1] * batch_size)

    def fill(self, md: AttentionMetadata) -> CascadeInputs:
        """Copy a step's halves into these buffers (outside any graph); returns self."""
        p, width = md.cascade_blocks, md.block_tables.shape[1]
        tokens = p * md.block_size
        self.prefix_table[:, :p].copy_(md.block_tables[:1, :p])
        self.prefix_lens.fill_(tokens)
        self.suffix_tables[:, :width - p].copy_(md.block_tables[:, p:])
        torch.sub(md.seq_lens, tokens, out=self.suffix_lens).clamp_(min=1)
        self.suffix_lens_cpu = [max(1, n - tokens) for n in md.seq_lens_cpu]
        return self


class CascadeBuffers:
    """A backend state's cascade inputs: static ones per CUDA-graph batch size, fresh ones for
    eager steps."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.by_batch: dict[int, CascadeInputs] = {}

    def allocate(self, batch_size: int, max_num_pages: int) -> None:
        """For a cascade graph of ``batch_size`` decodes (``make_graph_plan``)."""
        self.by_batch[batch_size] = CascadeInputs.static(batch_size, max_num_pages // batch_size,
                                                         self.device)

    def inputs(self, md: AttentionMetadata, graph_batch_size: int | None) -> CascadeInputs:
        """The step's halves: into the graph's buffers, or fresh for an eager step."""
        if graph_batch_size is None:
            return CascadeInputs.for_step(md)
        return self.by_batch[graph_batch_size].fill(md)


def merge(a: torch.Tensor, lse_a: torch.Tensor, b: torch.Tensor, lse_b: torch.Tensor
          ) -> torch.Tensor:
    """Attention over the union of two disjoint key sets, from each part's output [T, H, D]
    and natural-log log-sum-exp [T, H] (any strides)."""
    from pagedgen.attention.ops import triton_kernels as tk

    out = torch.empty_like(a)
    t, h, d = a.shape
    tk.merge_two_kernel[(t, h)](out, a, lse_a, b, lse_b, out.stride(0), out.stride(1),
                                a.stride(0), a.stride(1), lse_a.stride(0), lse_a.stride(1),
                                b.stride(0), b.stride(1), lse_b.stride(0), lse_b.stride(1), D=d)
    return out
