"""The all-reduce that ends a tensor-parallel block, fused with the residual add and RMSNorm
that follow it (issue 36): one Triton kernel reads every rank's partial sums straight from
their symmetric-memory buffers (peer-to-peer over NVLink), adds them in rank order (so every
rank computes the same bits), adds the residual, writes the new residual and the normed rows.
Two barriers over the ranks' signal pads frame it: the partials are all written before any is
read, and all are read before any rank's next GEMM overwrites its buffer.

Where it is not used, the same chain runs as the all-reduce (one-shot or NCCL/gloo) and then
the fused add + RMSNorm kernel: ``TensorParallel.all_reduce_add_rms_norm`` picks. The kernel's
arithmetic is tested on the CPU in Triton's interpreter with local tensors for peers and no
barrier; the kernel with barriers needs two GPUs, which the machines lent so far did not
have, so it runs only when ``PAGEDGEN_FUSED_ALL_REDUCE=1`` asks for it.
"""

from __future__ import annotations


import torch

from pagedgen import envs

try:
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False

ENV = envs.FUSED_ALL_REDUCE.name
MAX_RANKS = 8
MAX_PROGRAMS = 128  # each program's barrier takes 2 x ranks signal slots


def requested() -> bool:
    """Whether the fused kernel may run (not yet measured on two GPUs: opt-in)."""
    return envs.FUSED_ALL_REDUCE.get() == "1" and HAVE_TRITON


def signal_slots(ranks: int) -> int:
    """Signal-pad words (int32) the kernel's barriers use on each rank."""
    return 2 * MAX_PROGRAMS * ranks


if HAVE_TRITON:
    @triton.jit
    def _pick(i: tl.constexpr, A0, A1, A2, A3, A4, A5, A6, A7):
        if i == 0:
            return A0
        elif i == 1:
            return A1
        elif i == 2:
            return A2
        elif i == 3:
            return A3
        elif i == 4:
            return A4
        elif i == 5:
            return A5
        elif i == 6:
            return A6
        else:
            return A7

    @triton.jit
    def _barrier(S0, S1, S2, S3, S4, S5, S6, S7, mine, slot, rank, WORLD: tl.constexpr):
        """Every rank's program ``slot`` meets here: set our flag in each peer's pad, then take
        each peer's flag from ours (system-scope release/acquire)."""
        for p in tl.static_range(WORLD):
            pad = _pick(p, S0, S1, S2, S3, S4, S5, S6, S7) + slot * WORLD + rank
            while tl.atomic_cas(pad, 0, 1, sem="release", scope="sys") != 0:
                pass
        for p in tl.static_range(WORLD):
            while tl.atomic_cas(mine + slot * WORLD + p, 1, 0, sem="acquire", scope="sys") != 1:
                pass

    @triton.jit
    def one_shot_add_rms_norm_kernel(
            P0, P1, P2, P3, P4, P5, P6, P7, S0, S1, S2, S3, S4, S5, S6, S7, mine, R, W, Out,
            ROut, rows, N, eps, rank, WORLD: tl.constexpr, BARRIER: tl.constexpr,
            BLOCK: tl.constexpr, PROGRAMS: tl.constexpr):
        """Rows ``pid, pid + programs, ...``: x = sum of the ranks' partials (rank order,
        float32, rounded to the activation dtype as an all-reduce returns it) + residual; the
        new residual x; out = RMSNorm(x) * weight."""
        pid = tl.program_id(0)
        if BARRIER:
            _barrier(S0, S1, S2, S3, S4, S5, S6, S7, mine, pid, rank, WORLD)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        w = tl.load(W + cols, mask=mask, other=0.0)
        for row in range(pid, rows, tl.num_programs(0)):
            acc = tl.zeros((BLOCK,), dtype=tl.float32)
            for p in tl.static_range(WORLD):
                src = _pick(p, P0, P1, P2, P3, P4, P5, P6, P7)
                acc += tl.load(src + row * N + cols, mask=mask, other=0.0).to(tl.float32)
            r = tl.load(R + row * N + cols, mask=mask, other=0.0)
            x = (acc.to(R.dtype.element_ty).to(tl.float32) + r.to(tl.float32)).to(
                R.dtype.element_ty)
            tl.store(ROut + row * N + cols, x, mask=mask)
            xf = x.to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
            tl.store(Out + row * N + cols, w * (xf * rstd).to(R.dtype.element_ty), mask=mask)
        if BARRIER:
            _barrier(S0, S1, S2, S3, S4, S5, S6, S7, mine, PROGRAMS + pid, rank, WORLD)


def one_shot_add_rms_norm(peers: list[torch.Tensor], residual: torch.Tensor,
                          weight: torch.Tensor, eps: float, rank: int,
                          pads: list[torch.Tensor] | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, new residual) of ``residual + sum(peers)`` ([rows, N] each: every rank's
    partial sums, rank order); ``pads``: every rank's signal pad (int32, ``signal_slots``
    words), for the barriers (None: no barrier, the partials are all written already)."""
    if not 1 <= len(peers) <= MAX_RANKS:
        raise ValueError(f"the fused all-reduce takes 1 to {MAX_RANKS} ranks, not {len(peers)}")
    rows, n = residual.shape
    out = torch.empty_like(residual)
    res_out = torch.empty_like(residual)
    if rows == 0:
        return out, res_out
    fill = peers + [peers[0]] * (MAX_RANKS - len(peers))
    sigs = (pads + [pads[0]] * (MAX_RANKS - len(pads))) if pads else [out] * MAX_RANKS
    block = triton.next_power_of_2(n)
    grid = (min(rows, MAX_PROGRAMS),)
    one_shot_add_rms_norm_kernel[grid](
        *fill, *sigs, pads[rank] if pads else out, residual, weight, out, res_out, rows, n, eps,
        rank, WORLD=len(peers), BARRIER=pads is not None, BLOCK=block, PROGRAMS=MAX_PROGRAMS,
        num_warps=min(16, max(1, block // 256)))
    return out, res_out


def add_rms_norm_reference(partials: list[torch.Tensor], residual: torch.Tensor,
                           weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused chain: the all-reduced sum (float32, in the activation dtype), then the
    residual add and RMSNorm as ``fused_ops.rms_norm_ref`` computes them."""
    total = torch.stack([p.float() for p in partials]).sum(0).to(residual.dtype)
    x = total + residual
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype), x
