"""Kernel choices measured per GPU: the FP8 GEMM per M (``quantization/fp8/gemm.py``), the MoE
tiles per token count (``layers/moe/plan.py``) and ``--batch-invariant``'s GEMM tiles per row
count (``quantization/invariant_gemm.py``), each timed from CUDA-graph replays as the model
runs them, for a shape (a plan's key, without the GPU).

A plan comes from, in order: this process (every layer of a shape asks); the machine's cache
(``$XDG_CACHE_HOME/pagedgen/``, under the GPU's name, the torch and Triton versions and a digest
of the kernels' sources: a plan timed on other kernels is timed again); the
plans shipped with the package for the GPU's name (``runtime/plans/*.json``, written by
``benchmarks/kernel_plans.py`` on the GPUs we measure on: a first run on such a GPU times
nothing); else it is measured at load, before the first step, and cached. ``sources`` counts
where this process's plans came from (the run summary shows it);
``$PAGEDGEN_SHIPPED_PLANS=0`` passes over the shipped ones."""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any

import torch

from pagedgen import envs
from pagedgen.meta import cache_file

SHIPPED = Path(__file__).parent / "plans"
# the kernels plans choose between, and the code that times them
KERNEL_SOURCES = (Path(__file__).parent / "layers", Path(__file__).parent / "quantization")


def gpu_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)


def versions() -> str:
    """The library versions and kernel sources a plan measured on this machine holds for."""
    import triton

    return f"{torch.__version__}|{triton.__version__}|{sources_digest(KERNEL_SOURCES)}"


@cache
def sources_digest(folders: tuple[Path, ...]) -> str:
    """A short digest of the Python sources in ``folders`` (names and contents)."""
    h = hashlib.sha256()
    for folder in folders:
        for path in sorted(folder.rglob("*.py")):  # subpackages too (layers/moe/)
            h.update(path.relative_to(folder).as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def shipped_file(gpu: str) -> Path:
    """The shipped plans' file for GPU ``gpu`` (its name as CUDA gives it)."""
    return SHIPPED / (re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-") + ".json")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def load(name: str) -> dict[str, Any]:
    """Every plan in cache file ``name`` ({} when there is none or it does not parse)."""
    return _read_json(cache_file(name))


def shipped(name: str, gpu: str) -> dict[str, Any]:
    """The shipped plans of kind ``name`` for ``gpu``, by shape ({} for another GPU)."""
    if envs.SHIPPED_PLANS.get() == "0":
        return {}
    plans = _read_json(shipped_file(gpu)).get(name)
    return plans if isinstance(plans, dict) else {}


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


# plans this process has taken: (name, gpu, shape) -> (plan, its JSON)
_MEMORY: dict[tuple[str, str, str], tuple[Any, Any]] = {}
sources: Counter[str] = Counter()  # "shipped", "cached", "measured": plans this process took
measured_s = [0.0]  # seconds this process spent measuring
_listeners: list[Callable[[str], None]] = []  # told what is being measured


@contextmanager
def telling(listener: Callable[[str], None]) -> Iterator[None]:
    """``listener`` is told, in words, what is timed while the block runs (a status line)."""
    _listeners.append(listener)
    try:
        yield
    finally:
        _listeners.remove(listener)


def cached(name: str, gpu: str, shape: str, read: Callable[[Any], Any],
           measure: Callable[[], Any], write: Callable[[Any], Any]) -> Any:
    """The plan of kind ``name`` for ``shape`` on GPU ``gpu``: this process's, else the
    machine's cache, else the shipped one (``read`` turns JSON into a plan, or None when it
    no longer fits), else ``measure``d and cached (``write``: the plan as JSON)."""
    if (name, gpu, shape) not in _MEMORY:
        disk_key = f"{gpu}|{versions()}|{shape}"
        saved = load(name).get(disk_key)
        plan, source = read(saved), "cached"
        if plan is None:
            saved = shipped(name, gpu).get(shape)
            plan, source = read(saved), "shipped"
        if plan is None:
            for tell in _listeners:
                tell(f"timing kernels for {name.split('-plans')[0]} shape {shape} on {gpu} "
                     "(once per machine)")
            t0 = time.perf_counter()
            plan, source = measure(), "measured"
            measured_s[0] += time.perf_counter() - t0
            saved = write(plan)
            save(name, disk_key, saved)
        _MEMORY[(name, gpu, shape)] = (plan, saved)
        sources[source] += 1
    return _MEMORY[(name, gpu, shape)][0]


def planned(name: str, gpu: str, shape: str) -> Any:
    """The plan of kind ``name`` for ``shape`` this process holds already, or None (where
    nothing may be timed: under CUDA-graph capture)."""
    got = _MEMORY.get((name, gpu, shape))
    return None if got is None else got[0]


def taken() -> dict[str, dict[str, Any]]:
    """This process's plans as JSON, by kind and shape (what ``benchmarks/kernel_plans.py``
    ships)."""
    out: dict[str, dict[str, Any]] = {}
    for (name, _, shape), (_, saved) in _MEMORY.items():
        out.setdefault(name, {})[shape] = saved
    return out


def summary() -> str:
    """Where this process's plans came from, in words (once it took some: ``sources``)."""
    return ", ".join(f"{sources[s]} {s}" + (f" in {measured_s[0]:.0f} s" if s == "measured"
                                            else "")
                     for s in ("shipped", "cached", "measured") if sources[s])


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
