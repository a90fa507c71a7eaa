"""Tensor parallelism's small all-reduces as one push kernel, optionally fused with the
residual add and RMSNorm after it (issues 36, 62).

Each rank *writes* its partial sums into every peer's symmetric-memory buffer (one-way NVLink
stores, no round trip) and then reads the peers' partials out of its own buffer, which only
it reads: a slot whose elements are all "empty" (-0.0, a value the partials never carry: their
zeros are written as +0.0) until the peer's stores land, so each element says by itself whether
it has arrived and no flag or barrier is needed. The reader puts every element back to empty
once read. Three slots turn by a step counter in device memory (so CUDA graphs replay it):
a peer can be at most one call ahead, so the slot it writes is never the one being read or
cleared. The partials are added in rank order in float32 (every rank computes the same bits),
rounded to the activation dtype as an all-reduce returns them; with a norm, the residual is
added and the row normalized in the same pass.

The kernel's arithmetic and its slot bookkeeping are tested on the CPU in Triton's interpreter,
with local tensors for the peers' buffers and the peers' pushes written beforehand.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedgen import envs

try:
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False

MAX_RANKS = 8
SLOTS = 3
MAX_PROGRAMS = 128
PUSH_MAX_BYTES = 2 << 20  # the most a rank pushes in one call (a decode step's rows, or more)
_EMPTY_BITS = {2: -(1 << 15), 4: -(1 << 31)}  # -0.0 as int16 / int32


def fused() -> bool:
    """Whether the norm after a deferred all-reduce runs in the push kernel (the default)."""
    return envs.FUSED_ALL_REDUCE.get() != "0"


@dataclass
class PushBuffer:
    """One dtype's push buffers, each ``SLOTS`` x ranks x ``cap`` elements: this rank's own
    (``mine``), every rank's address in rank order (``peers``, int64 on the device: the
    kernel turns them into pointers, as Triton refuses tensors of a peer's memory), and this
    rank's step counter (int32: the step, then the programs done with it)."""

    mine: torch.Tensor
    peers: torch.Tensor
    rank: int
    counter: torch.Tensor
    cap: int
    owner: object = None  # what keeps the peers' memory mapped (the symmetric-memory handle)

    @staticmethod
    def cap_for(dtype: torch.dtype) -> int:
        return PUSH_MAX_BYTES // dtype.itemsize

    @staticmethod
    def empty_(buf: torch.Tensor) -> torch.Tensor:
        """Fill ``buf`` with the empty value, in place."""
        bits = {2: torch.int16, 4: torch.int32}[buf.element_size()]
        buf.view(bits).fill_(_EMPTY_BITS[buf.element_size()])
        return buf

    def fits(self, x: torch.Tensor) -> bool:
        return (x.dtype == self.mine.dtype and x.is_contiguous() and x.dim() >= 1
                and x.numel() <= self.cap and x.shape[-1] <= 1 << 16)


if HAVE_TRITON:
    @triton.jit
    def _pending(v, WIDE: tl.constexpr):
        """How many of ``v``'s elements are still empty (-0.0)."""
        if WIDE:
            empty = v.to(tl.int32, bitcast=True) == -2147483648
        else:
            empty = v.to(tl.int16, bitcast=True) == -32768
        return tl.sum(empty.to(tl.int32), axis=0)

    @triton.jit
    def push_all_reduce_kernel(
            X, Peers, Mine, Ctr, R, W, Out, ROut, rows, N, cap, eps,
            rank, WORLD: tl.constexpr, SLOT_COUNT: tl.constexpr, NORM: tl.constexpr,
            WIDE: tl.constexpr, BLOCK: tl.constexpr):
        """Rows ``pid, pid + programs, ...`` of X (this rank's partial sums): pushed into each
        peer's slot, then the sum in rank order (+ residual R and RMSNorm with weight W when
        NORM: Out the normed rows, ROut the new residual; else Out the sum)."""
        pid = tl.program_id(0)
        programs = tl.num_programs(0)
        step = tl.load(Ctr, volatile=True)
        slot = step % SLOT_COUNT
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        dtype = X.dtype.element_ty
        if WIDE:
            empty = tl.full((BLOCK,), -2147483648, tl.int32).to(dtype, bitcast=True)
        else:
            empty = tl.full((BLOCK,), -32768, tl.int16).to(dtype, bitcast=True)
        base = slot.to(tl.int64) * WORLD * cap
        for row in range(pid, rows, programs):
            x = tl.load(X + row * N + cols, mask=mask, other=0.0)
            x = tl.where(x == 0, tl.zeros_like(x), x)  # +0.0 for -0.0: never "empty"
            for p in tl.static_range(WORLD):
                if p != rank:
                    peer = tl.load(Peers + p).to(tl.pointer_type(dtype))
                    tl.store(peer + base + rank * cap + row * N + cols, x, mask=mask)
        for row in range(pid, rows, programs):
            acc = tl.zeros((BLOCK,), dtype=tl.float32)
            for p in tl.static_range(WORLD):
                if p == rank:
                    v = tl.load(X + row * N + cols, mask=mask, other=0.0)
                    v = tl.where(v == 0, tl.zeros_like(v), v)
                else:
                    src = Mine + base + p * cap + row * N + cols
                    v = tl.load(src, mask=mask, other=0.0, volatile=True)
                    while _pending(v, WIDE) > 0:
                        v = tl.load(src, mask=mask, other=0.0, volatile=True)
                    tl.store(src, empty, mask=mask)  # ready for the slot's next turn
                acc += v.to(tl.float32)
            total = acc.to(dtype)
            if NORM:
                r = tl.load(R + row * N + cols, mask=mask, other=0.0)
                x = (total.to(tl.float32) + r.to(tl.float32)).to(dtype)
                tl.store(ROut + row * N + cols, x, mask=mask)
                xf = x.to(tl.float32)
                rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
                w = tl.load(W + cols, mask=mask, other=0.0)
                tl.store(Out + row * N + cols, w * (xf * rstd).to(dtype), mask=mask)
            else:
                tl.store(Out + row * N + cols, total, mask=mask)
        # the last program to finish (so every program has read the step) turns the slot
        done = tl.atomic_add(Ctr + 1, 1, sem="acq_rel", scope="gpu")
        if done == programs - 1:
            tl.store(Ctr + 1, 0)
            tl.store(Ctr, step + 1)


def push_all_reduce(buf: PushBuffer, x: torch.Tensor, out: torch.Tensor | None = None,
                    residual: torch.Tensor | None = None, weight: torch.Tensor | None = None,
                    eps: float = 0.0):
    """``x`` ([..., N]) summed over the ranks into ``out`` (may be ``x``: in place; a new
    tensor when None); given ``residual`` and ``weight``: (RMSNorm(sum + residual) * weight,
    sum + residual) instead. Every rank calls it with the same shape."""
    world = buf.peers.numel()
    if not 1 <= world <= MAX_RANKS:
        raise ValueError(f"the push all-reduce takes 1 to {MAX_RANKS} ranks, not {world}")
    if not buf.fits(x):
        raise ValueError(f"{tuple(x.shape)} {x.dtype} does not fit the push buffer "
                         f"({buf.cap} elements of {buf.mine.dtype})")
    n = x.shape[-1]
    rows = x.numel() // n
    norm = residual is not None
    out = torch.empty_like(x) if out is None else out
    res_out = torch.empty_like(residual) if norm else out
    if rows == 0:
        return (out, res_out) if norm else out
    block = triton.next_power_of_2(n)
    push_all_reduce_kernel[(min(rows, MAX_PROGRAMS),)](
        x, buf.peers, buf.mine, buf.counter, residual if norm else x,
        weight if norm else x, out, res_out, rows, n, buf.cap, eps, buf.rank, WORLD=world,
        SLOT_COUNT=SLOTS, NORM=norm, WIDE=x.element_size() == 4, BLOCK=block,
        num_warps=min(8, max(1, block // 512)))
    return (out, res_out) if norm else out


def add_rms_norm_reference(partials: list[torch.Tensor], residual: torch.Tensor,
                           weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused chain: the all-reduced sum (float32, in the activation dtype), then the
    residual add and RMSNorm as ``fused_ops.rms_norm_ref`` computes them."""
    total = torch.stack([p.float() for p in partials]).sum(0).to(residual.dtype)
    x = total + residual
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype), x
