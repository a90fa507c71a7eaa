"""Tensor parallelism's process group: this process's rank in it, and the few collectives the
sharded model needs (all-reduce of partial sums, all-gather of vocabulary shards, broadcast of
sampled tokens, the minimum of the ranks' KV-cache sizes).

Over ``torch.distributed``: NCCL between GPUs and gloo on the CPU, so the same code runs in CI.
Small all-reduces (decode steps) take one kernel over PyTorch's symmetric memory instead
(``enable_one_shot``): ours, which pushes each rank's partials into its peers' buffers
(``fused_all_reduce``; with the RMSNorm after it fused in), up to 2 MiB a rank, and PyTorch's
one-shot kernel, which reads the peers' buffers, up to 8 MiB; CUDA graphs capture every kind.
Every rank runs the same engine on the same requests (SPMD): the scheduler is deterministic,
the logits are gathered in full on every rank and rank 0's sampled tokens are broadcast, so
the ranks' schedules never diverge (and their collectives come in the same order).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pagedgen import envs
from pagedgen.errors import PagedgenError
from pagedgen.profiling import scope
from pagedgen.runtime.collectives import fused_all_reduce

# All-reduces up to this size (every decode step's; prefill chunks of up to a few hundred
# tokens) run as one peer-to-peer kernel over symmetric memory instead of NCCL's ring;
# PAGEDGEN_ALL_REDUCE=nccl sends them all to NCCL, =one-shot skips the push kernel.
ONE_SHOT_MAX_BYTES = 8 << 20
ALL_REDUCE_KINDS = ("push", "one-shot", "nccl")
ENV_ALL_REDUCE = envs.ALL_REDUCE.name
# NVLink multicast (NVLS) stays off in every rank: NCCL's NVLS algorithms, symmetric memory's
# multicast objects and NVSHMEM's are set up per process and fail on the lent multi-GPU hosts
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass
class TensorParallel:
    """This process's place in its tensor-parallel group (rank 0 of 1 when there is none)."""

    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup when size > 1
    one_shot: torch.Tensor | None = None  # the symmetric-memory buffer, once enabled
    push: fused_all_reduce.PushBuffer | None = None  # the push kernel's, once enabled
    all_reduce_kind: str = "nccl"
    expert_parallel: bool = False  # MoE layers: whole experts, a share a rank (else widths)
    # buffers by dtype: one per process, kept alive (captured CUDA graphs point into them)
    _buffers: dict = field(default_factory=dict, repr=False)
    _handles: dict = field(default_factory=dict, repr=False)  # their symmetric-memory handles
    _pushes: dict = field(default_factory=dict, repr=False)  # push buffers by dtype

    def enable_one_shot(self, dtype: torch.dtype, device: torch.device) -> None:
        """Small all-reduces of ``dtype`` through PyTorch's symmetric memory (one kernel over
        NVLink, no ring: the push kernel, then PyTorch's one-shot for larger ones), where it
        works; NCCL otherwise (and always on the CPU). A collective: every rank calls it."""
        kind = envs.ALL_REDUCE.get() or "push"
        if kind not in ALL_REDUCE_KINDS:
            raise PagedgenError(f"{ENV_ALL_REDUCE}={kind}: expected one of "
                                f"{', '.join(ALL_REDUCE_KINDS)}")
        if self.size == 1 or device.type != "cuda":
            return
        if kind == "nccl":
            self.all_reduce_kind = f"nccl ({ENV_ALL_REDUCE}=nccl)"
            return
        if dtype in self._buffers:  # another engine in this process: same buffers
            self.one_shot, self.push = self._buffers[dtype], self._pushes.get(dtype)
            return
        try:
            import torch.distributed._symmetric_memory as symm_mem

            buf = symm_mem.empty(ONE_SHOT_MAX_BYTES // dtype.itemsize, dtype=dtype,
                                 device=device)
            handle = symm_mem.rendezvous(buf, self.group.group_name)
            torch.ops.symm_mem.one_shot_all_reduce_out  # noqa: B018 - present in this build
            push = self._push_buffer(symm_mem, dtype, device) \
                if kind == "push" and fused_all_reduce.HAVE_TRITON else None
        except Exception as e:  # noqa: BLE001 - no peer access, an older torch: keep NCCL
            self.all_reduce_kind = f"nccl (symmetric memory unavailable: {type(e).__name__})"
            return
        self.one_shot = self._buffers[dtype] = buf
        self._handles[dtype] = handle
        self.push = self._pushes[dtype] = push
        if push is None:
            self.all_reduce_kind = "one-shot (symmetric memory)"
        else:
            self.all_reduce_kind = "push (symmetric memory), one-shot past 2 MiB"
            if fused_all_reduce.fused():
                self.all_reduce_kind += ", fused with the next RMSNorm"

    def _push_buffer(self, symm_mem, dtype: torch.dtype,
                     device: torch.device) -> fused_all_reduce.PushBuffer:
        """This rank's push buffer, emptied before any peer may write into it, and the
        peers' (a collective)."""
        cap = fused_all_reduce.PushBuffer.cap_for(dtype)
        mine = fused_all_reduce.PushBuffer.empty_(symm_mem.empty(
            fused_all_reduce.SLOTS * self.size * cap, dtype=dtype, device=device))
        handle = symm_mem.rendezvous(mine, self.group.group_name)
        torch.cuda.synchronize(device)
        dist.barrier(group=self.group)  # every rank's buffer empty before the first push
        offset = mine.data_ptr() - handle.buffer_ptrs[self.rank]  # within the allocation
        peers = torch.tensor([p + offset for p in handle.buffer_ptrs], dtype=torch.int64,
                             device=device)
        return fused_all_reduce.PushBuffer(mine, peers, self.rank,
                                           torch.zeros(2, dtype=torch.int32, device=device), cap,
                                           owner=handle)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place."""
        if self.size == 1:
            return x
        with scope("all_reduce"):
            if self.push is not None and self.push.fits(x):
                return fused_all_reduce.push_all_reduce(self.push, x, out=x)
            part = self._one_shot_part(x.numel(), x.dtype) if x.is_contiguous() else None
            if part is None:
                dist.all_reduce(x, group=self.group)
            else:
                part.copy_(x.view(-1))
                self._one_shot_into(part, x.view(-1))
        return x

    def partial_output(self, rows: int, cols: int, dtype: torch.dtype,
                       compute: Callable[[torch.Tensor | None], torch.Tensor]) -> torch.Tensor:
        """A GEMM's [rows, cols] partial sums in ``dtype``, for ``reduce_partial`` (or
        ``all_reduce_add_rms_norm``): ``compute(out)`` writes them into the symmetric buffer
        where a one-shot all-reduce can take them (``out`` a view of it: no copy kernel), or,
        given None, returns its own tensor."""
        part = self._one_shot_part(rows * cols, dtype) if self.size > 1 else None
        return compute(None if part is None else part.view(rows, cols))

    def reduce_partial(self, partial: torch.Tensor) -> torch.Tensor:
        """``partial`` (from ``partial_output``) summed over the ranks: by the push kernel,
        read out of the symmetric buffer by the one-shot all-reduce, or all-reduced in
        place."""
        if self.push is not None and self.push.fits(partial):
            with scope("all_reduce"):
                return fused_all_reduce.push_all_reduce(self.push, partial)
        if not self._in_buffer(partial):
            return self.all_reduce(partial)
        out = torch.empty_like(partial)
        with scope("all_reduce"):
            self._one_shot_into(partial.view(-1), out.view(-1))
        return out

    def all_reduce_add_rms_norm(self, partial: torch.Tensor, residual: torch.Tensor | None,
                                weight: torch.Tensor, eps: float, norm: Callable, **kw):
        """``norm(x, weight, eps, residual, **kw)`` of x = ``partial`` summed over the ranks:
        one push kernel that sums, adds and normalizes, where it takes ``partial`` (and the
        norm has a residual and no FP8 output); otherwise the all-reduce, then ``norm``."""
        if self.push is not None and self.push.fits(partial) and residual is not None \
                and not kw.get("quantize") and fused_all_reduce.fused():
            with scope("all_reduce"):
                return fused_all_reduce.push_all_reduce(
                    self.push, partial, residual=residual, weight=weight, eps=eps)
        return norm(self.reduce_partial(partial), weight, eps, residual, **kw)

    def _in_buffer(self, partial: torch.Tensor) -> bool:
        """Whether ``partial`` sits in the symmetric buffer (``partial_output`` put it there)."""
        return self.one_shot is not None and partial.data_ptr() == self.one_shot.data_ptr()

    def _one_shot_part(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """The first ``numel`` elements of the symmetric buffer, when a one-shot all-reduce
        can take a tensor of that size and dtype."""
        buf = self.one_shot
        if buf is None or dtype != buf.dtype or numel > buf.numel():
            return None
        return buf[:numel]

    def _one_shot_into(self, part: torch.Tensor, out: torch.Tensor) -> None:
        torch.ops.symm_mem.one_shot_all_reduce_out(part, "sum", self.group.group_name, out)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' ``x`` side by side along the last dimension, in rank order."""
        if self.size == 1:
            return x
        with scope("all_reduce"):
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` on every rank, in place."""
        if self.size > 1:
            with scope("all_reduce"):
                dist.broadcast(x, src=dist.get_global_rank(self.group, 0), group=self.group)
        return x

    def min(self, value: int, device: torch.device) -> int:
        """The smallest of the ranks' ``value``."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())


_CURRENT = TensorParallel()


def current() -> TensorParallel:
    """The group this process joined with ``init`` (a group of one otherwise)."""
    return _CURRENT


def init(rank: int, size: int, init_method: str, device_index: int | None) -> TensorParallel:
    """Join a tensor-parallel group of ``size`` ranks: NCCL on GPU ``device_index`` (made the
    current device), gloo on the CPU (``device_index`` None)."""
    global _CURRENT
    if size > 1:
        os.environ.update(NO_MULTICAST)  # before NCCL or symmetric memory start
        if device_index is not None:
            torch.cuda.set_device(device_index)
        else:  # ranks on one CPU: share its cores instead of each taking all of them
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
        dist.init_process_group("nccl" if device_index is not None else "gloo",
                                init_method=init_method, rank=rank, world_size=size)
        _CURRENT = TensorParallel(rank, size, dist.group.WORLD)
    return _CURRENT


def torchrun_size() -> int:
    """How many processes ``torchrun`` started with this one (1 when it did not start it)."""
    return int(os.environ.get("WORLD_SIZE", "1")) if "RANK" in os.environ else 1


def init_from_env(on_gpu: bool) -> TensorParallel | None:
    """Join the group ``torchrun`` describes (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and the
    rendezvous in ``MASTER_ADDR``/``MASTER_PORT``; GPU ``LOCAL_RANK`` when ``on_gpu``), or None
    when not started by it."""
    size = torchrun_size()
    if size == 1:
        return None
    device = int(os.environ.get("LOCAL_RANK", "0")) if on_gpu else None
    return init(int(os.environ["RANK"]), size, "env://", device)


def shutdown() -> None:
    global _CURRENT
    if dist.is_initialized():
        dist.destroy_process_group()
    _CURRENT = TensorParallel()
