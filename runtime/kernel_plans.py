"""Kernel choices measured once per machine and kept on disk (``$XDG_CACHE_HOME/pagedgen/``):
the FP8 GEMM per M (``quantization/fp8_gemm.py``) and the MoE tiles per M
(``layers/moe_plan.py``) are timed from CUDA-graph replays, as the model runs them, and written
under a key naming the GPU, the library versions and the shape, so only the first start on a
machine pays for the timing."""

from __future__ import annotations

import json
import os
from pathlib import Path

from typing import Any, Callable

import torch


def device_key(device: torch.device) -> str:
    """The GPU and the versions a measured plan holds for."""
    import triton

    return f"{torch.cuda.get_device_name(device)}|{torch.__version__}|{triton.__version__}"


def cache_file(name: str) -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pagedgen" / name


def load(name: str) -> dict[str, Any]:
    """Every plan in cache file ``name`` ({} when there is none or it does not parse)."""
    try:
        data = json.loads(cache_file(name).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def save(name: str, key: str, plan: Any) -> None:
    """Add ``plan`` (JSON) under ``key`` to cache file ``name`` (written whole to a temporary
    file, then renamed: concurrent starts never read half a file)."""
    path = cache_file(name)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {**load(name), key: plan}
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)
    except OSError:
        pass  # a read-only home: measured again next time


_MEMORY: dict[tuple[str, str], Any] = {}  # plans this process has read or measured


def cached(name: str, key: str, read: Callable[[Any], Any], measure: Callable[[], Any],
           write: Callable[[Any], Any]) -> Any:
    """The plan under ``key`` in cache file ``name``: this process's, else the disk's
    (``read`` turns its JSON into a plan, or None when it no longer fits), else ``measure``d
    and saved (``write``: the plan as JSON). Every layer of a shape asks; the file is read
    and the timing done once a process."""
    if (name, key) not in _MEMORY:
        plan = read(load(name).get(key))
        if plan is None:
            plan = measure()
            save(name, key, write(plan))
        _MEMORY[(name, key)] = plan
    return _MEMORY[(name, key)]


def graph_time(fn, calls: int = 5, replays: int = 3) -> float:
    """Median seconds of one ``fn`` call, replayed from a CUDA graph as the model runs it
    (small kernels would otherwise be timed by their launches)."""
    from pagedgen.runtime.hardware import time_cuda

    fn()  # compiles
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    t = time_cuda(graph.replay, replays) / calls
    del graph
    return t
