"""Paged decode through our Triton kernel (``triton_kernels.decode_kernel``): the triton
backend's decode, and the flash-attn backend's cascade decode of each sequence's own pages.

One program per (sequence, KV head, split): the G query heads of a KV head are the rows of a
[G, D] x [D, BLOCK_N] product over K/V read through the block table. On short contexts it beats
FA4's paged decode: 256 sequences of 1-256 tokens (Llama-3-8B's heads, page 128) in 53.5 against
66.3 µs on an H200 (benchmarks/results/LOG.md); FA4 gives each (sequence, KV head) a 64-row
tile for 4 rows.
"""

from __future__ import annotations

import math
import os
from functools import cache

import torch

from pagedgen.attention.backend import LayerSpec

MAX_SPLITS = 32


def interpreting() -> bool:
    """Triton runs in its CPU interpreter (how CI tests the kernels)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors (on CPU, the interpreter: 64, so tests exercise split-KV)."""
    if device.type != "cuda":
        return 64
    return torch.cuda.get_device_properties(device).multi_processor_count


def block_n(head_size: int) -> int:
    """Keys a program takes per step."""
    if interpreting():
        return 16
    return 32 if head_size > 256 else 64 if head_size > 128 else 128


def num_splits(batch: int, spec: LayerSpec, device: torch.device,
               max_seq_len: int | None = None) -> int:
    """KV splits per (sequence, KV head): enough programs to fill the GPU twice over (from the
    batch alone, so a CUDA graph's count holds for every step it replays); eager steps
    (``max_seq_len`` known) no more splits than tiles."""
    programs = batch * spec.num_kv_heads
    splits = max(1, min(MAX_SPLITS, math.ceil(2 * num_sms(device) / programs)))
    if max_seq_len is not None:
        splits = max(1, min(splits, math.ceil(max_seq_len / (2 * block_n(spec.head_size)))))
    return splits


def partials(splits: int, b: int, spec: LayerSpec, device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 partial outputs [splits, b, H, D] and their log-sum-exps [splits, b, H]."""
    h, d = spec.num_heads, spec.head_size
    return (torch.empty((splits, b, h, d), dtype=torch.float32, device=device),
            torch.empty((splits, b, h), dtype=torch.float32, device=device))


def decode(q: torch.Tensor, kv_blocks: torch.Tensor, out: torch.Tensor, part: torch.Tensor,
           lse: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
           spec: LayerSpec, splits: int, sinks: torch.Tensor | None = None,
           k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Attention of each sequence's one query ``q`` [B, H, D] over its first ``seq_lens``
    cached tokens: straight into ``out`` when ``part is out`` (one split), else ``splits``
    partials into ``part`` / ``lse`` (:func:`partials`). ``kv_blocks``: [pages, 2 (K, V), page,
    KV heads, D], any strides (the flash-attn cache's ``transpose(0, 1)`` view too);
    ``sinks`` [H]: each head's sink logit, counted once (in split 0); an FP8 cache holds
    K / ``k_scale`` and V / ``v_scale``."""
    from pagedgen.attention.ops import triton_kernels as tk

    cs = kv_blocks.stride()
    cap = spec.logits_soft_cap or 0.0
    window = spec.sliding_window or 0
    group = spec.num_heads // spec.num_kv_heads
    tk.decode_kernel[(q.shape[0], spec.num_kv_heads, splits)](
        q, kv_blocks, out, part, lse, block_tables, seq_lens,
        sinks if sinks is not None else seq_lens,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        cs[0], cs[1], cs[2], cs[3], block_tables.stride(0),
        part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        spec.scale * k_scale, v_scale, cap, window, splits, group, kv_blocks.shape[2],
        GP=max(16, _pow2(group)), D=spec.head_size, BLOCK_N=block_n(spec.head_size),
        USE_WINDOW=window > 0, USE_SOFTCAP=cap > 0, DIRECT=part is out,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", USE_SINKS=sinks is not None,
        **({} if interpreting() else {"num_warps": 8 if spec.head_size > 256 else 4,
                                      "num_stages": 2}))


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
