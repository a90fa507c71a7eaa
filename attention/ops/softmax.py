"""The eager oracle's softmax over attention scores, and its reading of an FP8 cache: shared by
``attention/eager.py`` and the image blocks' second pass (``attention/image_blocks.py``), which
must round as the oracle does."""

from __future__ import annotations

import torch


def dequantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Cache entries → float32 (FP8 caches hold value / scale)."""
    if x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return x.float() * scale
    return x.float()


def attention_probs(scores: torch.Tensor, soft_cap: float | None, sinks: torch.Tensor | None,
                    masked: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax over the keys (last dim) of ``scores`` (float32, heads first): soft-capped,
    ``masked`` pairs left out, each head's sink logit (``sinks`` [heads]) as one more column,
    of value zero."""
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    if masked is not None:
        scores = scores.masked_fill(masked, float("-inf"))
    keys = scores.shape[-1]
    if sinks is not None:
        sink = sinks.float().view(-1, *[1] * (scores.dim() - 1))
        scores = torch.cat([scores, sink.expand(*scores.shape[:-1], 1)], -1)
    return torch.softmax(scores, dim=-1)[..., :keys]
