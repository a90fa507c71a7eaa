"""Image blocks attended both ways: Gemma 4's ``use_bidirectional_attention: "vision"``.

On such a model's window layers an image's tokens see their whole block: token ``i`` of a
block of positions [s, e) attends to keys [i - W + 1, e), the window behind it and the rest of
its block ahead, where every other token attends causally (transformers' AND(window,
OR(causal, block)); its full layers stay causal). The scheduler keeps a block in one step (a
prefill chunk never ends inside one), so when a layer attends, the cache already holds every
key a block's rows see. Each backend first attends causally as always; ``reattend`` then
computes the block's rows again over their own keys, through the backend's pages
(``blocks_view``) and in float32 as the eager oracle does, and writes them over. An image is a
few hundred rows of a step: a gather and a small product per block and layer, which lets every
backend run such a model whatever masks its kernels take.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagedgen.attention.metadata import AttentionMetadata
from pagedgen.attention.ops.kv_cache import gather_kv
from pagedgen.attention.ops.softmax import attention_probs, dequantize


@dataclass(frozen=True)
class ImageBlock:
    """One image's block in a step: sequence ``seq`` (its index in the step), whose rows
    ``row`` .. ``row + rows - 1`` of the step are the block's last ``rows`` tokens, the block
    ending at position ``end`` (exclusive) of that sequence."""

    seq: int
    row: int
    rows: int
    end: int


def reattend(impl: Any, out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor,
             metadata: AttentionMetadata) -> None:
    """Write over ``out``'s rows of each of the step's image blocks their attention over keys
    [position - window + 1, block end) (``impl``: the window layer's ``AttentionImpl``,
    whose spec, state and sinks it reads)."""
    spec, state = impl.spec, impl.state
    window, bs = spec.sliding_window, metadata.block_size
    pages = state.backend.blocks_view(kv_cache)
    group = spec.num_heads // spec.num_kv_heads
    for b in metadata.image_blocks:
        first = b.end - b.rows  # the position of the block's first row in this step
        page0 = max(0, first - window + 1) // bs  # the first page a row's window reaches
        k, v = gather_kv(pages, metadata.block_tables[b.seq][page0:], b.end - page0 * bs)
        k = dequantize(k, state.k_scale).repeat_interleave(group, dim=1)
        v = dequantize(v, state.v_scale).repeat_interleave(group, dim=1)
        q_pos = torch.arange(first, b.end, device=q.device)
        k_pos = torch.arange(page0 * bs, b.end, device=q.device)
        behind = k_pos[None, :] <= q_pos[:, None] - window  # out of the window
        scores = torch.einsum("qhd,khd->hqk", q[b.row:b.row + b.rows].float(), k) * spec.scale
        probs = attention_probs(scores, spec.logits_soft_cap, impl.sinks, behind)
        out[b.row:b.row + b.rows] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
