"""The slot sort before a MoE layer's grouped GEMMs: a token's ``top_k`` choices are its slots
(slot ``t * top_k + j``); ``align`` groups them by expert into blocks of ``block_m`` rows, each
expert's last block padded with the sentinel slot ``num_slots``, and names each block's expert,
so that a GEMM program multiplies one block of rows by one expert's weights. Sized by the
token count alone (no host sync): it runs inside CUDA graphs.

Up to ``BY_EXPERT_SLOTS`` slots a Triton program per expert counts every slot's expert, then
writes its own run in slot order (a running count: one launch, the whole GPU busy). Each of
those programs reads every slot, so above that the work goes by chunks of ``CHUNK`` slots
(``align_by_chunks``): a program per chunk counts its experts, a program per expert places
each chunk's share within its run, and a program per chunk sorts its slots by expert
(``tl.sort`` of expert and position) and writes each where its run and chunk say: every slot
read twice, three launches whatever the count, each run still in slot order. Torch's sort
and scatters (``align_reference``) are the CPU path and the tests' oracle.
``benchmarks/moe_kernels.py --align`` times the three ways, and timed the one-program kernel
with an atomic cursor per expert that the program per expert replaced: slower at every count
measured on an H200.
"""

from __future__ import annotations

import torch

from pagedgen.runtime.quantization.fp8.kernels import INTERPRETED

try:
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except ImportError:  # CPU-only installs: torch's ops
    HAVE_TRITON = False

BY_EXPERT_SLOTS = 4096  # the program per expert up to this many slots (512 tokens of eight)
CHUNK = 1024  # slots a program of the chunked sort counts and places


def max_blocks(num_slots: int, num_experts: int, block_m: int) -> int:
    """An upper bound on the blocks ``align`` makes: every expert with tokens pads at most one
    block."""
    return -(-num_slots // block_m) + min(num_experts, num_slots)


def align(ids: torch.Tensor, num_experts: int, block_m: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots [blocks * block_m] int32: the slots grouped by expert, each expert's run padded
    to whole blocks with ``num_slots``; block_experts [blocks] int32: each block's expert, -1
    past the last), ``blocks = max_blocks(...)``; no host sync. Each run in slot order."""
    if not HAVE_TRITON or not (ids.is_cuda or INTERPRETED):
        return align_reference(ids, num_experts, block_m)
    if ids.numel() <= BY_EXPERT_SLOTS:
        return align_by_expert(ids, num_experts, block_m)
    return align_by_chunks(ids, num_experts, block_m)


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
    def _runs(counts, e, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr):
        """From every expert's slot count: expert e's count, its run's first block, and the
        blocks all runs use."""
        blocks = (counts + BLOCK_M - 1) // BLOCK_M
        block_end = tl.cumsum(blocks, 0)
        mine = tl.arange(0, E_PAD) == e
        return (tl.sum(tl.where(mine, counts, 0), 0),
                tl.sum(tl.where(mine, block_end - blocks, 0), 0), tl.max(block_end, 0))

    @triton.jit
    def _lay_out_run(slots_ptr, block_experts_ptr, e, first, count, n, BLOCK_M: tl.constexpr,
                     B_CHUNK: tl.constexpr, PAD: tl.constexpr):
        """Expert ``e``'s run (``count`` slots from block ``first``): the sentinel ``n`` in
        the rows past its slots, ``e`` in its blocks."""
        run_end = (first + (count + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
        for j0 in tl.static_range(0, BLOCK_M, PAD):
            row = first * BLOCK_M + count + j0 + tl.arange(0, PAD)
            tl.store(slots_ptr + row, tl.zeros((PAD,), dtype=tl.int32) + n, mask=row < run_end)
        for j0 in range(first, run_end // BLOCK_M, B_CHUNK):
            b = j0 + tl.arange(0, B_CHUNK)
            tl.store(block_experts_ptr + b, tl.zeros((B_CHUNK,), dtype=tl.int32) + e,
                     mask=b < run_end // BLOCK_M)

    @triton.jit
    def _past_the_runs(slots_ptr, block_experts_ptr, used, n, num_blocks, BLOCK_M: tl.constexpr,
                       CHUNK: tl.constexpr, B_CHUNK: tl.constexpr):
        """The blocks past the ``used`` ones: the sentinel in their rows, expert -1."""
        for start in range(used * BLOCK_M, num_blocks * BLOCK_M, CHUNK):
            offs = start + tl.arange(0, CHUNK)
            tl.store(slots_ptr + offs, tl.zeros((CHUNK,), dtype=tl.int32) + n,
                     mask=offs < num_blocks * BLOCK_M)
        for start in range(used, num_blocks, B_CHUNK):
            b = start + tl.arange(0, B_CHUNK)
            tl.store(block_experts_ptr + b, tl.zeros((B_CHUNK,), dtype=tl.int32) - 1,
                     mask=b < num_blocks)

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
        count, first, used = _runs(counts, e, BLOCK_M, E_PAD)
        if e < num_experts:
            seen = tl.full((), 0, tl.int32)
            for start in range(0, n, CHUNK):
                offs = start + tl.arange(0, CHUNK)
                hit = (tl.load(ids_ptr + offs, mask=offs < n, other=-1) == e).to(tl.int32)
                rank = seen + tl.cumsum(hit, 0) - 1
                tl.store(slots_ptr + first * BLOCK_M + rank, offs, mask=hit != 0)
                seen += tl.sum(hit, 0)
            _lay_out_run(slots_ptr, block_experts_ptr, e, first, count, n, BLOCK_M, B_CHUNK,
                         PAD)
        else:
            _past_the_runs(slots_ptr, block_experts_ptr, used, n, num_blocks, BLOCK_M, CHUNK,
                           B_CHUNK)


def _outputs(ids: torch.Tensor, num_experts: int, block_m: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Triton ways' shared start: the slots' experts flat in int32, and the (slots,
    block_experts) pair ``align`` returns, unfilled, at ``max_blocks``."""
    flat = ids.reshape(-1)
    flat = flat.int() if flat.dtype != torch.int32 else flat
    nb = max_blocks(flat.numel(), num_experts, block_m)
    return (flat, torch.empty(nb * block_m, dtype=torch.int32, device=flat.device),
            torch.empty(nb, dtype=torch.int32, device=flat.device))


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int, num_warps: int = 4
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``align`` by a Triton program per expert (and one for the rows past the last run)."""
    flat, slots, block_experts = _outputs(ids, num_experts, block_m)
    _align_kernel[(num_experts + 1,)](
        flat, slots, block_experts, flat.numel(), num_experts, block_experts.numel(),
        E_PAD=triton.next_power_of_2(num_experts + 1), BLOCK_M=block_m, CHUNK=1024,
        B_CHUNK=64, PAD=min(block_m, 16), num_warps=num_warps)
    return slots, block_experts


if HAVE_TRITON:
    @triton.jit(do_not_specialize=["n"])
    def _chunk_counts_kernel(ids_ptr, counts_ptr, offsets_ptr, totals_ptr, n, num_experts,
                             E_PAD: tl.constexpr, CHUNK: tl.constexpr):
        """Chunk c's slots by expert: counts[c], where each expert's slots start among the
        chunk's sorted ones (offsets[c], for ``_chunk_runs_kernel`` to complete), and the
        counts added to each expert's total."""
        c = tl.program_id(0)
        offs = c * CHUNK + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < n, other=E_PAD - 1)
        experts = tl.arange(0, E_PAD)
        counts = tl.where(experts < num_experts, tl.histogram(ids, E_PAD), 0)
        tl.store(counts_ptr + c * E_PAD + experts, counts)
        tl.store(offsets_ptr + c * E_PAD + experts, tl.cumsum(counts, 0) - counts)
        tl.atomic_add(totals_ptr + experts, counts, mask=experts < num_experts)

    @triton.jit(do_not_specialize=["n", "num_chunks", "num_blocks"])
    def _chunk_runs_kernel(counts_ptr, offsets_ptr, totals_ptr, slots_ptr, block_experts_ptr,
                           n, num_chunks, num_experts, num_blocks, E_PAD: tl.constexpr,
                           BLOCK_M: tl.constexpr, CB: tl.constexpr, CHUNK: tl.constexpr,
                           B_CHUNK: tl.constexpr, PAD: tl.constexpr):
        """Program e < experts: expert e's run from the totals; each chunk's first row in it
        (the chunks before it, in order) less where the chunk's sorted slots of e start, into
        offsets[:, e]; its padding and blocks. Program ``experts``: the rows past the runs."""
        e = tl.program_id(0)
        experts = tl.arange(0, E_PAD)
        totals = tl.load(totals_ptr + experts, mask=experts < num_experts, other=0)
        count, first, used = _runs(totals, e, BLOCK_M, E_PAD)
        if e < num_experts:
            before = tl.full((), 0, tl.int32)  # e's slots in the chunks so far
            for c0 in range(0, num_chunks, CB):
                chunks = c0 + tl.arange(0, CB)
                at = chunks * E_PAD + e
                here = tl.load(counts_ptr + at, mask=chunks < num_chunks, other=0)
                start = tl.load(offsets_ptr + at, mask=chunks < num_chunks, other=0)
                rows = first * BLOCK_M + before + tl.cumsum(here, 0) - here
                tl.store(offsets_ptr + at, rows - start, mask=chunks < num_chunks)
                before += tl.sum(here, 0)
            _lay_out_run(slots_ptr, block_experts_ptr, e, first, count, n, BLOCK_M, B_CHUNK,
                         PAD)
        else:
            _past_the_runs(slots_ptr, block_experts_ptr, used, n, num_blocks, BLOCK_M, CHUNK,
                           B_CHUNK)

    @triton.jit(do_not_specialize=["n"])
    def _chunk_place_kernel(ids_ptr, offsets_ptr, slots_ptr, n, E_PAD: tl.constexpr,
                            CHUNK: tl.constexpr):
        """Chunk c's slots sorted by (expert, slot): the i-th of them goes to its expert's
        offset for the chunk plus i."""
        c = tl.program_id(0)
        local = tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + c * CHUNK + local, mask=c * CHUNK + local < n, other=E_PAD - 1)
        keys = tl.sort(ids * CHUNK + local)
        expert, slot = keys // CHUNK, c * CHUNK + keys % CHUNK
        row = tl.load(offsets_ptr + c * E_PAD + expert) + local
        tl.store(slots_ptr + row, slot, mask=slot < n)


def align_by_chunks(ids: torch.Tensor, num_experts: int, block_m: int, num_warps: int = 4,
                    chunk_step: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """``align`` by chunks of ``CHUNK`` slots: counted, laid out per expert (its share of
    ``chunk_step`` chunks at a time), then placed."""
    flat, slots, block_experts = _outputs(ids, num_experts, block_m)
    n, dev, nb = flat.numel(), flat.device, block_experts.numel()
    chunks = -(-n // CHUNK)
    e_pad = triton.next_power_of_2(num_experts + 1)  # the last bin holds the padding
    counts = torch.empty(chunks, e_pad, dtype=torch.int32, device=dev)
    offsets = torch.empty_like(counts)
    totals = torch.zeros(e_pad, dtype=torch.int32, device=dev)
    if n:
        _chunk_counts_kernel[(chunks,)](flat, counts, offsets, totals, n, num_experts,
                                        E_PAD=e_pad, CHUNK=CHUNK, num_warps=num_warps)
    _chunk_runs_kernel[(num_experts + 1,)](
        counts, offsets, totals, slots, block_experts, n, chunks, num_experts, nb, E_PAD=e_pad,
        BLOCK_M=block_m, CB=chunk_step, CHUNK=CHUNK, B_CHUNK=64, PAD=min(block_m, 16),
        num_warps=num_warps)
    if n:
        _chunk_place_kernel[(chunks,)](flat, offsets, slots, n, E_PAD=e_pad, CHUNK=CHUNK,
                                       num_warps=num_warps)
    return slots, block_experts
