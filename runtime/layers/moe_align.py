"""The slot sort before a MoE layer's grouped GEMMs: a token's ``top_k`` choices are its slots
(slot ``t * top_k + j``); ``align`` groups them by expert into blocks of ``block_m`` rows, each
expert's last block padded with the sentinel slot ``num_slots``, and names each block's expert,
so that a GEMM program multiplies one block of rows by one expert's weights. Sized by the
token count alone (no host sync): it runs inside CUDA graphs.

Three ways, by the step's slot count (``benchmarks/moe_kernels.py --align`` times them):
a Triton program per expert for decode-sized steps (each counts every slot's expert, then
writes its own run: no atomics, the whole GPU busy), one Triton program up to
``ONE_PROGRAM_SLOTS`` (an atomic cursor per expert), and torch's sort and scatters above that
(``align_reference``, also the CPU path and the tests' oracle).
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

BY_EXPERT_SLOTS = 4096  # a program per expert up to this many slots (decodes of 512 x 8)
ONE_PROGRAM_SLOTS = 32768  # one Triton program up to this many slots


def max_blocks(num_slots: int, num_experts: int, block_m: int) -> int:
    """An upper bound on the blocks ``align`` makes: every expert with tokens pads at most one
    block."""
    return -(-num_slots // block_m) + min(num_experts, num_slots)


def align(ids: torch.Tensor, num_experts: int, block_m: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots [blocks * block_m] int32: the slots grouped by expert, each expert's run padded
    to whole blocks with ``num_slots``; block_experts [blocks] int32: each block's expert, -1
    past the last), ``blocks = max_blocks(...)``; no host sync. Slots in an expert's run in
    any order (each output row depends on its own input row only)."""
    if HAVE_TRITON and (ids.is_cuda or INTERPRETED):
        if ids.numel() <= BY_EXPERT_SLOTS:
            return align_by_expert(ids, num_experts, block_m)
        if ids.numel() <= ONE_PROGRAM_SLOTS:
            return align_triton(ids, num_experts, block_m)
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
    @triton.jit
    def _expert_blocks(ids_ptr, n, num_experts, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                       CHUNK: tl.constexpr):
        """(each expert's slot count, its blocks, the end of its run in blocks) [E_PAD]."""
        experts = tl.arange(0, E_PAD)
        counts = tl.zeros((E_PAD,), dtype=tl.int32)
        for start in range(0, n, CHUNK):
            offs = start + tl.arange(0, CHUNK)
            ids = tl.load(ids_ptr + offs, mask=offs < n, other=E_PAD - 1)
            counts += tl.histogram(ids, E_PAD)
        counts = tl.where(experts < num_experts, counts, 0)  # the last bin held the padding
        blocks = (counts + BLOCK_M - 1) // BLOCK_M
        return counts, blocks, tl.cumsum(blocks, 0)

    @triton.jit
    def _past_last_run(slots_ptr, block_experts_ptr, n, used, num_blocks,
                       BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, B_CHUNK: tl.constexpr):
        """The sentinel slot in every row, and expert -1 in every block, past the last run."""
        for start in range(used * BLOCK_M, num_blocks * BLOCK_M, CHUNK):
            offs = start + tl.arange(0, CHUNK)
            tl.store(slots_ptr + offs, tl.zeros((CHUNK,), dtype=tl.int32) + n,
                     mask=offs < num_blocks * BLOCK_M)
        for start in range(used, num_blocks, B_CHUNK):
            b = start + tl.arange(0, B_CHUNK)
            tl.store(block_experts_ptr + b, tl.zeros((B_CHUNK,), dtype=tl.int32) - 1,
                     mask=b < num_blocks)

    @triton.jit(do_not_specialize=["n", "num_blocks"])
    def _align_by_expert_kernel(ids_ptr, slots_ptr, block_experts_ptr, n, num_experts,
                                num_blocks, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                                CHUNK: tl.constexpr, B_CHUNK: tl.constexpr,
                                PAD: tl.constexpr):
        """Program ``e`` < experts: expert e's run, its slots in slot order (each one's rank: a
        running count of e's slots before it), the sentinel in the rows past them, e in its
        blocks. Program ``experts``: the rows and blocks past the last run."""
        e = tl.program_id(0)
        counts, blocks, block_end = _expert_blocks(ids_ptr, n, num_experts, E_PAD, BLOCK_M,
                                                   CHUNK)
        if e < num_experts:
            mine = tl.arange(0, E_PAD) == e
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
            _past_last_run(slots_ptr, block_experts_ptr, n, tl.max(block_end, 0), num_blocks,
                           BLOCK_M, CHUNK, B_CHUNK)

    @triton.jit(do_not_specialize=["n", "num_blocks"])
    def _align_kernel(ids_ptr, slots_ptr, block_experts_ptr, cursor_ptr, n, num_experts,
                      num_blocks, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                      CHUNK: tl.constexpr, B_CHUNK: tl.constexpr, PAD: tl.constexpr):
        """One program: count each expert's slots, lay its blocks out (each expert names its
        own: as many rounds as the busiest has blocks), write the sentinel where no slot goes
        (runs' padding, rows past the last run), then scatter every slot to the next free row
        of its expert's run (an atomic cursor per expert)."""
        experts = tl.arange(0, E_PAD)
        counts, blocks, block_end = _expert_blocks(ids_ptr, n, num_experts, E_PAD, BLOCK_M,
                                                   CHUNK)
        first_block, used = block_end - blocks, tl.max(block_end, 0)
        tl.store(cursor_ptr + experts, first_block * BLOCK_M)  # each run's first row
        sentinel = tl.zeros((E_PAD, PAD), dtype=tl.int32) + n
        for j0 in tl.static_range(0, BLOCK_M, PAD):  # each run's rows past its slots
            row = (first_block * BLOCK_M + counts)[:, None] + j0 + tl.arange(0, PAD)[None, :]
            tl.store(slots_ptr + row, sentinel, mask=row < (block_end * BLOCK_M)[:, None])
        for j in range(0, tl.max(blocks, 0)):
            tl.store(block_experts_ptr + first_block + j, experts, mask=j < blocks)
        _past_last_run(slots_ptr, block_experts_ptr, n, used, num_blocks, BLOCK_M, CHUNK,
                       B_CHUNK)
        tl.debug_barrier()  # the cursors stored before any thread adds to them
        for start in range(0, n, CHUNK):
            offs = start + tl.arange(0, CHUNK)
            ok = offs < n
            ids = tl.load(ids_ptr + offs, mask=ok, other=0)
            pos = tl.atomic_add(cursor_ptr + ids, 1, mask=ok)
            tl.store(slots_ptr + pos, offs, mask=ok)


def _outputs(ids: torch.Tensor, num_experts: int, block_m: int):
    flat = ids.reshape(-1)
    n = flat.numel()
    nb = max_blocks(n, num_experts, block_m)
    slots = torch.empty(nb * block_m, dtype=torch.int32, device=flat.device)
    block_experts = torch.empty(nb, dtype=torch.int32, device=flat.device)
    flat = flat.int() if flat.dtype != torch.int32 else flat
    return flat, n, nb, slots, block_experts, triton.next_power_of_2(num_experts + 1)


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int, num_warps: int = 4
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``align`` by a Triton program per expert (and one for the rows past the last run)."""
    flat, n, nb, slots, block_experts, e_pad = _outputs(ids, num_experts, block_m)
    _align_by_expert_kernel[(num_experts + 1,)](
        flat, slots, block_experts, n, num_experts, nb, E_PAD=e_pad, BLOCK_M=block_m,
        CHUNK=1024, B_CHUNK=64, PAD=min(block_m, 16), num_warps=num_warps)
    return slots, block_experts


def align_triton(ids: torch.Tensor, num_experts: int, block_m: int, num_warps: int = 8
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``align`` by one Triton program."""
    flat, n, nb, slots, block_experts, e_pad = _outputs(ids, num_experts, block_m)
    cursor = torch.empty(e_pad, dtype=torch.int32, device=flat.device)
    _align_kernel[(1,)](flat, slots, block_experts, cursor, n, num_experts, nb, E_PAD=e_pad,
                        BLOCK_M=block_m, CHUNK=1024, B_CHUNK=256, PAD=min(block_m, 16),
                        num_warps=num_warps)
    return slots, block_experts
