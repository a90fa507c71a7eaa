"""Device limits: what memory is free, this process's share of the host's cores, and
measured rooflines (copy bandwidth and matmul throughput)."""

from __future__ import annotations

import os

import torch

from pagedgen import envs

# How many of pagedgen's processes share this host (set for the -dp / -tp workers it starts;
# torchrun's LOCAL_WORLD_SIZE says the same for the ranks it starts).
HOST_PROCESSES = envs.HOST_PROCESSES.name


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity, within its cgroup's quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:  # cgroup v2: "quota period" (or "max")
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return max(1, cores)


def host_cores() -> int:
    """This process's share of the host's cores, at least 1."""
    shares = envs.HOST_PROCESSES.get() or os.environ.get("LOCAL_WORLD_SIZE") or "1"
    return max(1, usable_cores() // max(1, int(shares) if shares.isdigit() else 1))


def _large_gpu(device: torch.device) -> bool:
    """vLLM's large class: a GPU of at least 70 GiB that is not an A100 (H100, H200, ...)."""
    props = torch.cuda.get_device_properties(device)
    return props.total_memory >= 70 * 2**30 and "a100" not in props.name.lower()


def hopper_or_later(device: torch.device) -> bool:
    """Whether ``device`` is a CUDA GPU of compute capability 9.0 or later: TMA and wgmma, and
    torch's grouped GEMMs (before it, Triton lowers a TMA descriptor's loads to plain ones)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def default_max_num_seqs(device: torch.device) -> int:
    """The most sequences a step holds when no profile or option says: vLLM's rule for its
    offline ``LLM`` class, so a batch job gets the max_num_seqs here it would get there: 1,024
    on a GPU of at least 70 GiB that is not an A100, 256 on other GPUs; 128 on a CPU."""
    if device.type != "cuda":
        return 128
    return 1024 if _large_gpu(device) else 256


def default_batched_tokens(device: torch.device) -> int:
    """The most tokens a step holds (its prefill chunk budget) when no profile or option
    says: vLLM's rule for its ``LLM`` class, 16,384 on the large GPUs (as ``default_max_num_seqs``),
    8,192 on other GPUs and on a CPU."""
    return 16384 if device.type == "cuda" and _large_gpu(device) else 8192


def available_memory(device: torch.device) -> int | None:
    """Bytes free for a new allocation on ``device``: the GPU's free memory with what torch's
    allocator holds cached and unused (a dropped engine's, say), or the host's MemAvailable
    (Linux); None where unknown."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + cached
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def time_cuda(fn, iters: int) -> float:
    """Median seconds of ``fn`` over ``iters`` runs after two warm-ups (CUDA events)."""
    times = []
    for i in range(iters + 2):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(a.elapsed_time(b) / 1000)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(nbytes: int = 2 << 30, iters: int = 10) -> float:
    """Device-to-device copy bandwidth, bytes/s counting bytes read and written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    t = time_cuda(lambda: dst.copy_(src), iters)
    src = dst = None  # freed before the cache is emptied
    torch.cuda.empty_cache()
    return 2 * nbytes / t


def matmul_flops(n: int = 8192, dtype: torch.dtype = torch.bfloat16, iters: int = 10) -> float:
    """Dense matmul throughput, FLOP/s, on random data (the practical peak)."""
    a = torch.randn(n, n, dtype=dtype, device="cuda")
    b = torch.randn(n, n, dtype=dtype, device="cuda")
    t = time_cuda(lambda: a @ b, iters)
    a = b = None  # freed before the cache is emptied
    torch.cuda.empty_cache()
    return 2 * n ** 3 / t


def fp8_matmul_flops(n: int = 8192, iters: int = 10) -> float | None:
    """FP8 (e4m3, row-wise scaled, fast accumulation) matmul throughput, FLOP/s; None where
    this GPU has no FP8 tensor cores (before compute capability 8.9)."""
    if torch.cuda.get_device_capability() < (8, 9):
        return None
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    sa = torch.ones(n, 1, device="cuda")
    sb = torch.ones(1, n, device="cuda")
    t = time_cuda(lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb,
                                           out_dtype=torch.bfloat16, use_fast_accum=True),
                   iters)
    a = b = None
    torch.cuda.empty_cache()
    return 2 * n ** 3 / t
