"""Paged KV-cache operations in plain torch, for the layout [num_blocks, 2, block_size, H, D].

``write_kv`` is vLLM's reshape_and_cache; ``swap_blocks`` moves blocks between device and host
caches; ``copy_blocks`` duplicates blocks inside every layer's cache (used to fork a sequence).
"""

from __future__ import annotations

import importlib.util

import torch

from pagedgen.profiling import scope

HAVE_TRITON = importlib.util.find_spec("triton") is not None


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Store new tokens' k/v [T, H, D] in their slots: on CUDA one Triton kernel
    (``write_kv_triton``), elsewhere two index_copy kernels.

    FP8 caches store ``x / scale`` (copied as bytes, since index_copy has no FP8 kernels).
    """
    if triton_writes(kv_cache, k):
        write_kv_triton(kv_cache[:, 0], kv_cache[:, 1], k, v, slot_mapping, k_scale, v_scale)
        return
    with scope("kv_cache_write"):
        _write_kv(kv_cache, k, v, slot_mapping, k_scale, v_scale)


def triton_writes(cache: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether ``write_kv_triton`` stores into ``cache``: CUDA, a power-of-two head size, and
    for an FP8 cache a GPU whose Triton converts to FP8 (compute capability 8.9+)."""
    d = k.shape[-1]
    return HAVE_TRITON and cache.is_cuda and d & (d - 1) == 0 and (
        cache.dtype.itemsize > 1 or fp8_converts(cache.device))


def fp8_converts(device: torch.device) -> bool:
    """Whether Triton kernels convert to and from FP8 (e4m3) on ``device``: a GPU of compute
    capability 8.9+, or the CPU interpreter."""
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) >= (8, 9)


def write_kv_triton(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0,
                    v_scale: float = 1.0) -> None:
    """Store k/v [T, H, D] (any strides) at their slots in page views ``k_cache``, ``v_cache``
    [num_blocks, block_size, H, D] of equal strides, in one kernel: a program per token (FP8
    caches: ``x / scale``, rounded to nearest)."""
    import triton

    from pagedgen.attention.ops import triton_kernels as tk

    if not k.shape[0]:
        return
    h, d = k.shape[1:]
    cs = k_cache.stride()
    with scope("kv_cache_write"):
        tk.write_kv_kernel[(k.shape[0],)](
            k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0),
            v.stride(1), cs[0], cs[1], cs[2], h, k_cache.shape[1], k_scale, v_scale,
            HP=triton.next_power_of_2(h), D=d)


def write_kv_split(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store new tokens' k/v [T, H, D] at their slots in separate [pages, page, H, D] caches."""
    if triton_writes(k_cache, k):
        write_kv_triton(k_cache, v_cache, k, v, slot_mapping)
        return
    with scope("kv_cache_write"):
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def _write_kv(kv_cache, k, v, slot_mapping, k_scale, v_scale) -> None:
    num_blocks, _, block_size, h, d = kv_cache.shape
    if kv_cache.dtype.itemsize == 1 and kv_cache.dtype.is_floating_point:
        k = (k.float() / k_scale).to(kv_cache.dtype).view(torch.uint8)
        v = (v.float() / v_scale).to(kv_cache.dtype).view(torch.uint8)
        kv_cache = kv_cache.view(torch.uint8)
    if not kv_cache.is_contiguous():  # a layer's share of a slab's pages (kv_memory.py)
        blk, off = slot_mapping // block_size, slot_mapping % block_size
        kv_cache[blk, 0, off] = k.to(kv_cache.dtype)
        kv_cache[blk, 1, off] = v.to(kv_cache.dtype)
        return
    rows = slot_mapping // block_size * (2 * block_size) + slot_mapping % block_size
    flat = kv_cache.view(num_blocks * 2 * block_size, h, d)
    flat.index_copy_(0, rows, k.to(flat.dtype))
    flat.index_copy_(0, rows + block_size, v.to(flat.dtype))


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``seq_len`` cached tokens of one sequence: k, v [seq_len, H, D]."""
    n = -(-seq_len // kv_cache.shape[2])
    k, v = gather_kv_batch(kv_cache, block_table[None, :n])
    return k[0, :seq_len], v[0, :seq_len]


def gather_kv_batch(kv_cache: torch.Tensor, block_tables: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sequence's blocks, padded: k, v [B, max_blocks * block_size, H, D] (each gathered
    from its half of the cache straight into its own contiguous tensor: one copy, not two)."""
    b, tables = block_tables.shape[0], block_tables.long()
    k = kv_cache[:, 0][tables].view(b, -1, *kv_cache.shape[-2:])
    v = kv_cache[:, 1][tables].view(b, -1, *kv_cache.shape[-2:])
    return k, v


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, mapping: torch.Tensor) -> None:
    """Copy ``src[mapping[i, 0]]`` into ``dst[mapping[i, 1]]``; src and dst may be on any
    devices."""
    if mapping.numel() == 0:
        return
    mapping = mapping.to("cpu", torch.int64)
    src_idx, dst_idx = mapping[:, 0], mapping[:, 1]
    moved = src[src_idx.to(src.device)].to(dst.device, non_blocking=True)
    dst[dst_idx.to(dst.device)] = moved


def copy_blocks(kv_caches: list[torch.Tensor], mapping: torch.Tensor) -> None:
    """For every layer cache, copy block ``mapping[i, 0]`` to block ``mapping[i, 1]``."""
    if mapping.numel() == 0:
        return
    for cache in kv_caches:
        m = mapping.to(cache.device, torch.int64)
        cache[m[:, 1]] = cache[m[:, 0]]
