"""The slot sort before a MoE layer's grouped GEMMs: a token's ``top_k`` choices are its slots
(slot ``t * top_k + j``); ``align`` groups them by expert into blocks of ``block_m`` rows, each
expert's last block padded with the sentinel slot ``num_slots``, and names each block's expert,
so that a GEMM program multiplies one block of rows by one expert's weights. Sized by the
token count alone (no host sync): it runs inside CUDA graphs.

Up to ``TRITON_SLOTS`` slots a Triton program per expert counts every slot's expert, then
writes its own run in slot order (a running count: no atomics, the whole GPU busy); torch's
sort and scatters above that (``align_reference``, also the CPU path and the tests' oracle).
``benchmarks/moe_kernels.py --align`` times both, and timed the one-program kernel with an
atomic cursor per expert that this replaced: slower at every count measured on an H200.
"""

from __future__ import annotations

import torch

from pagedgen.runtime.quantization.fp8_kernels import INTERPRETED

try:
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except ImportError:  # CPU-only installs: torch's ops
    HAVE_TRITON = False

TRITON_SLOTS = 32768  # the Triton sort up to this many slots (4,096 tokens of eight experts)


def max_blocks(num_slots: int, num_experts: int, block_m: int) -> int:
    """An upper bound on the blocks ``align`` makes: every expert with tokens pads at most one
    block."""
    return -(-num_slots // block_m) + min(num_experts, num_slots)


def align(ids: torch.Tensor, num_experts: int, block_m: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots [blocks * block_m] int32: the slots grouped by expert, each expert's run padded
    to whole blocks with ``num_slots``; block_experts [blocks] int32: each block's expert, -1
    past the last), ``blocks = max_blocks(...)``; no host sync. Each run in slot order."""
    if HAVE_TRITON and (ids.is_cuda or INTERPRETED) and ids.numel() <= TRITON_SLOTS:
        return align_by_expert(ids, num_experts, block_m)
    return align_reference(ids, num_experts, block_m)


def align_reference(ids: torch.Tensor, num_experts: int, block_m: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``align`` by torch's ops, each run in slot order."""
    flat = ids.reshape(-1).long()
    n, dev = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(
        0, flat, torch.ones_like(flat))
    blocks = (counts + block_m - 1) // block_m
    block_end = blocks.cumsum(0)
    nb = max_blocks(n, num_experts, block_m)
    block_experts = torch.searchsorted(block_end, torch.arange(nb, device=dev), right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1).int()
    order = torch.sort(flat, stable=True).indices
    expert = flat[order]
    first_slot = counts.cumsum(0) - counts  # each expert's first position among sorted slots
    pos = (block_end - blocks)[expert] * block_m + torch.arange(n, device=dev) \
        - first_slot[expert]
    slots = torch.full((nb * block_m,), n, dtype=torch.int32, device=dev)
    slots.index_copy_(0, pos, order.int())
    return slots, block_experts


if HAVE_TRITON:
    @triton.jit(do_not_specialize=["n", "num_blocks"])
    def _align_kernel(ids_ptr, slots_ptr, block_experts_ptr, n, num_experts, num_blocks,
                      E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
                      B_CHUNK: tl.constexpr, PAD: tl.constexpr):
        """Every program counts each expert's slots (a histogram) and lays the runs out. Then
        program ``e`` < experts writes expert e's run: its slots in slot order (each one's
        rank a running count of e's slots before it), the sentinel in the rows past them, e
        in its blocks; program ``experts`` the sentinel and expert -1 past the last run."""
        e = tl.program_id(0)
        experts = tl.arange(0, E_PAD)
        counts = tl.zeros((E_PAD,), dtype=tl.int32)
        for start in range(0, n, CHUNK):
            offs = start + tl.arange(0, CHUNK)
            ids = tl.load(ids_ptr + offs, mask=offs < n, other=E_PAD - 1)
            counts += tl.histogram(ids, E_PAD)
        counts = tl.where(experts < num_experts, counts, 0)  # the last bin held the padding
        blocks = (counts + BLOCK_M - 1) // BLOCK_M
        block_end = tl.cumsum(blocks, 0)
        if e < num_experts:
            mine = experts == e
            count = tl.sum(tl.where(mine, counts, 0), 0)
            first = tl.sum(tl.where(mine, block_end - blocks, 0), 0)
            run_end = (first + (count + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
            seen = tl.full((), 0, tl.int32)
            for start in range(0, n, CHUNK):
                offs = start + tl.arange(0, CHUNK)
                hit = (tl.load(ids_ptr + offs, mask=offs < n, other=-1) == e).to(tl.int32)
                rank = seen + tl.cumsum(hit, 0) - 1
                tl.store(slots_ptr + first * BLOCK_M + rank, offs, mask=hit != 0)
                seen += tl.sum(hit, 0)
            for j0 in tl.static_range(0, BLOCK_M, PAD):
                row = first * BLOCK_M + count + j0 + tl.arange(0, PAD)
                tl.store(slots_ptr + row, tl.zeros((PAD,), dtype=tl.int32) + n,
                         mask=row < run_end)
            for j0 in range(first, run_end // BLOCK_M, B_CHUNK):
                b = j0 + tl.arange(0, B_CHUNK)
                tl.store(block_experts_ptr + b, tl.zeros((B_CHUNK,), dtype=tl.int32) + e,
                         mask=b < run_end // BLOCK_M)
        else:
            used = tl.max(block_end, 0)
            for start in range(used * BLOCK_M, num_blocks * BLOCK_M, CHUNK):
                offs = start + tl.arange(0, CHUNK)
                tl.store(slots_ptr + offs, tl.zeros((CHUNK,), dtype=tl.int32) + n,
                         mask=offs < num_blocks * BLOCK_M)
            for start in range(used, num_blocks, B_CHUNK):
                b = start + tl.arange(0, B_CHUNK)
                tl.store(block_experts_ptr + b, tl.zeros((B_CHUNK,), dtype=tl.int32) - 1,
                         mask=b < num_blocks)


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int, num_warps: int = 4
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``align`` by a Triton program per expert (and one for the rows past the last run)."""
    flat = ids.reshape(-1)
    n = flat.numel()
    nb = max_blocks(n, num_experts, block_m)
    slots = torch.empty(nb * block_m, dtype=torch.int32, device=flat.device)
    block_experts = torch.empty(nb, dtype=torch.int32, device=flat.device)
    _align_kernel[(num_experts + 1,)](
        flat.int() if flat.dtype != torch.int32 else flat, slots, block_experts, n,
        num_experts, nb, E_PAD=triton.next_power_of_2(num_experts + 1), BLOCK_M=block_m,
        CHUNK=1024, B_CHUNK=64, PAD=min(block_m, 16), num_warps=num_warps)
    return slots, block_experts
