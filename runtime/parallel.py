"""Tensor parallelism's process group: this process's rank in it, and the few collectives the
sharded model needs (all-reduce of partial sums, all-gather of vocabulary shards, broadcast of
sampled tokens, the minimum of the ranks' KV-cache sizes).

Over ``torch.distributed``: NCCL between GPUs and gloo on the CPU, so the same code runs in CI.
Small all-reduces (decode steps) take one peer-to-peer kernel over PyTorch's symmetric memory
instead (``enable_one_shot``); CUDA graphs capture both kinds. Every rank runs the same engine on
the same requests (SPMD): the scheduler is deterministic, the logits are gathered in full on
every rank and rank 0's sampled tokens are broadcast, so the ranks' schedules never diverge.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pagedgen.runtime.profiling import scope

# All-reduces up to this size (every decode step's; prefill chunks of up to a few hundred
# tokens) run as one peer-to-peer kernel over symmetric memory instead of NCCL's ring;
# PAGEDGEN_ALL_REDUCE=nccl sends them all to NCCL.
ONE_SHOT_MAX_BYTES = 8 << 20
ENV_ALL_REDUCE = "PAGEDGEN_ALL_REDUCE"


@dataclass
class TensorParallel:
    """This process's place in its tensor-parallel group (rank 0 of 1 when there is none)."""

    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup when size > 1
    one_shot: torch.Tensor | None = None  # the symmetric-memory buffer, once enabled
    all_reduce_kind: str = "nccl"
    # buffers by dtype: one per process, kept alive (captured CUDA graphs point into them)
    _buffers: dict = field(default_factory=dict, repr=False)

    def enable_one_shot(self, dtype: torch.dtype, device: torch.device) -> None:
        """Small all-reduces of ``dtype`` through PyTorch's symmetric memory (each GPU reads
        its peers' buffers over NVLink: one kernel, no ring), where it works; NCCL otherwise
        (and always on the CPU). A collective: every rank calls it."""
        if self.size == 1 or device.type != "cuda":
            return
        if os.environ.get(ENV_ALL_REDUCE, "auto") == "nccl":
            self.all_reduce_kind = f"nccl ({ENV_ALL_REDUCE}=nccl)"
            return
        if dtype in self._buffers:  # another engine in this process: same buffer
            self.one_shot = self._buffers[dtype]
            return
        try:
            import torch.distributed._symmetric_memory as symm_mem

            buf = symm_mem.empty(ONE_SHOT_MAX_BYTES // dtype.itemsize, dtype=dtype,
                                 device=device)
            symm_mem.rendezvous(buf, self.group.group_name)
            torch.ops.symm_mem.one_shot_all_reduce_out  # noqa: B018 - present in this build
        except Exception as e:  # noqa: BLE001 - no peer access, an older torch: keep NCCL
            self.all_reduce_kind = f"nccl (symmetric memory unavailable: {type(e).__name__})"
            return
        self.one_shot = self._buffers[dtype] = buf
        self.all_reduce_kind = "one-shot (symmetric memory)"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place."""
        if self.size == 1:
            return x
        with scope("all_reduce"):
            buf = self.one_shot
            if buf is not None and x.dtype == buf.dtype and x.numel() <= buf.numel() \
                    and x.is_contiguous():
                part = buf[:x.numel()]
                part.copy_(x.view(-1))
                torch.ops.symm_mem.one_shot_all_reduce_out(part, "sum", self.group.group_name,
                                                          x.view(-1))
            else:
                dist.all_reduce(x, group=self.group)
        return x

    def linear_all_reduce(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T`` summed over the ranks: with symmetric memory, the GEMM writes
        straight into the buffer the peers read (no copy kernel)."""
        buf = self.one_shot
        rows, cols = x.shape[0], weight.shape[0]
        if buf is None or x.dim() != 2 or x.dtype != buf.dtype or rows * cols > buf.numel():
            return self.all_reduce(F.linear(x, weight))
        part = buf[:rows * cols].view(rows, cols)
        torch.mm(x, weight.t(), out=part)
        out = torch.empty_like(part)
        with scope("all_reduce"):
            torch.ops.symm_mem.one_shot_all_reduce_out(part, "sum", self.group.group_name, out)
        return out

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
        if device_index is not None:
            torch.cuda.set_device(device_index)
        else:  # ranks on one CPU: share its cores instead of each taking all of them
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
        dist.init_process_group("nccl" if device_index is not None else "gloo",
                                init_method=init_method, rank=rank, world_size=size)
        _CURRENT = TensorParallel(rank, size, dist.group.WORLD)
    return _CURRENT


def init_from_env(on_gpu: bool) -> TensorParallel | None:
    """Join the group ``torchrun`` describes (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and the
    rendezvous in ``MASTER_ADDR``/``MASTER_PORT``; GPU ``LOCAL_RANK`` when ``on_gpu``), or None
    when not started by it."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1 or "RANK" not in os.environ:
        return None
    device = int(os.environ.get("LOCAL_RANK", "0")) if on_gpu else None
    return init(int(os.environ["RANK"]), size, "env://", device)


def shutdown() -> None:
    global _CURRENT
    if dist.is_initialized():
        dist.destroy_process_group()
    _CURRENT = TensorParallel()
