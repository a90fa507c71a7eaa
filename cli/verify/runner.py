"""Running `pagedgen verify`'s checks: each backend's checks as tasks, run in worker processes
(kernel compiles in parallel) or here in order, rows printed as each backend completes."""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from pagedgen.attention.backend import AttentionBackend
from pagedgen.attention.registry import get_backend, unavailable_reason
from pagedgen.cli.common import console
from pagedgen.cli.verify.kernel_checks import (
    cascade_cases,
    cascade_dtype,
    cascade_row,
    kernel_cases,
    kernel_groups,
    kernel_row,
    page_sizes,
)
from pagedgen.cli.verify.model_checks import check_model, check_prefix_cache, prefix_cache_unused
from pagedgen.cli.verify.report import BackendReport, Row, render
from pagedgen.errors import PagedgenError
from pagedgen.runtime.children import die_with_parent

CHUNK = 6  # kernel cases per task: each task's compiles stay short against the whole run


Task = tuple[Callable[..., Any], tuple]  # a module-level function and its arguments


@dataclass
class Check:
    """One report row: the tasks that compute it (run here or in worker processes) and how
    their results make the row (None: no row, e.g. a backend without cascade)."""

    tasks: list[Task]
    finish: Callable[[list[Any]], Row | None]


def single(results: list[Row]) -> Row:
    return results[0]


def plan_backend(name: str, device: torch.device, model: str, dtype: str, cases: int,
                 steps: int, seed: int, kernels: bool = True
                 ) -> tuple[BackendReport, list[Check]]:
    """The report for backend ``name`` (skipped or the reference: final) and its checks
    (``kernels``: the kernel and cascade checks too, not only the model's)."""
    if name == "eager":
        return BackendReport(name, "reference", "the reference itself (tested against a dense "
                                                "float64 computation in the test suite)"), []
    if name == "auto":  # the model on what auto picks for each KV group: the model's checks
        backend = get_backend("auto", device)
        return BackendReport(name, "checked"), [
            Check([(check_model, (name, model, dtype, device, steps, seed, graphs))], single)
            for graphs in graph_modes(backend, device)]
    why = unavailable_reason(name, device) or cannot_run(name, model, dtype, device)
    if why is not None:  # not here, or not this model's layers
        return BackendReport(name, "skipped", why), []
    backend = get_backend(name, device)
    chunks = [list(range(i, min(i + CHUNK, cases))) for i in range(0, cases, CHUNK)]
    checks = []
    if kernels:
        checks = [Check([(kernel_cases, (name, device, dt, opts, c, seed)) for c in chunks],
                        functools.partial(kernel_row, label, dt, opts))
                  for label, dt, opts in kernel_groups(backend, device)]
        checks.append(Check([(cascade_cases, (name, device, c, seed)) for c in chunks],
                            functools.partial(cascade_row, cascade_dtype(backend))))
    for graphs in graph_modes(backend, device):
        checks.append(Check([(check_model, (name, model, dtype, device, steps, seed, graphs))],
                            single))
    report = BackendReport(name, "checked")
    unused = prefix_cache_unused(model)
    if unused:
        report.not_checked.append(("prefix-cached prefill", unused))
    for page in page_sizes(backend) if not unused else ():
        checks.append(Check([(check_prefix_cache,
                              (name, model, dtype, device, steps, seed, page))], single))
    return report, checks


def graph_modes(backend: type[AttentionBackend], device: torch.device) -> list[bool]:
    """Model checks run eagerly, and with CUDA graphs where the backend captures them."""
    return [False] + ([True] if backend.supports_cuda_graphs and device.type == "cuda" else [])


WORKER_HOST_BYTES = 4 << 30  # a worker's host memory, with torch and the GPU libraries loaded


def default_jobs(device: torch.device) -> int:
    """Worker processes for the checks: one per core (up to 16, and as many as free host
    memory holds) on a GPU, where the time goes into single-threaded kernel compiles; none on
    the CPU, where the checks share the cores."""
    if device.type != "cuda":
        return 1
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        free = 16 * WORKER_HOST_BYTES
    return max(1, min(16, os.cpu_count() or 1, free // WORKER_HOST_BYTES))


def verify_backend(name: str, device: torch.device, model: str, dtype: str, cases: int,
                   steps: int, seed: int, jobs: int = 1) -> BackendReport:
    """Backend ``name``'s report, printing nothing."""
    return run_plans([plan_backend(name, device, model, dtype, cases, steps, seed)], jobs)[0]


class _Deferred:
    """A task run when its result is asked for (``jobs`` 1: in order, in this process)."""

    def __init__(self, fn: Callable[..., Any], args: tuple) -> None:
        self.fn, self.args = fn, args

    def result(self) -> Any:
        return self.fn(*self.args)


def run_plans(plans: list[tuple[BackendReport, list[Check]]], jobs: int,
              out: Console | None = None,
              sharded: Callable[[str], Row | None] = lambda name: None) -> list[BackendReport]:
    """Run every check's tasks (in ``jobs`` worker processes, or here in order for 1); with
    ``out``, show progress (a bar on a terminal; else a line as each check's row is in: a
    log shows a cold run's long compiles are moving) and print each backend's table as soon
    as its rows are in. ``sharded`` adds the tensor-parallel row (run here: it starts its own
    rank processes)."""
    tasks = [t for _, checks in plans for c in checks for t in c.tasks]
    shown = out is not None and (out.is_terminal or console.is_terminal)
    lines, done, t0 = out is not None and not shown, 0, time.perf_counter()
    progress = Progress(TextColumn("[bold]verifying"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=out if out and out.is_terminal else console,
                        transient=True, disable=not shown)
    pool = None
    if jobs > 1 and len(tasks) > 1:
        jobs = min(jobs, len(tasks))
        pool = ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn"),
                                   initializer=_share_cores, initargs=(jobs,))
    try:
        with progress:
            bar = progress.add_task("checks", total=len(tasks))
            pending = iter([pool.submit(_timed, fn, args) if pool
                            else _Deferred(_timed, (fn, args)) for fn, args in tasks])
            for report, checks in plans:
                for c in checks:
                    results, seconds = [], 0.0
                    for _ in c.tasks:
                        result, s = _result(next(pending))
                        results.append(result)
                        seconds += s
                        done += 1
                        progress.advance(bar)
                    row = c.finish(results)
                    if row is not None:
                        row.seconds = seconds
                        report.rows.append(row)
                        if lines:
                            out.print(f"verifying {report.backend}: {row.group} "
                                      f"{'pass' if row.passed else 'fail'} ({done}/"
                                      f"{len(tasks)} tasks, {time.perf_counter() - t0:.0f} s)",
                                      highlight=False, markup=False, soft_wrap=True)
                if report.status == "checked":
                    row, seconds = _timed(sharded, (report.backend,))
                    if row is not None:
                        row.seconds = seconds
                        report.rows.append(row)
                if out is not None:
                    render([report], out)
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    return [r for r, _ in plans]


def _timed(fn: Callable[..., Any], args: tuple) -> tuple[Any, float]:
    """A task's result and its seconds in the process that ran it (kernel compiles included:
    where a cold run's time goes)."""
    t = time.perf_counter()
    return fn(*args), time.perf_counter() - t


def _share_cores(jobs: int) -> None:
    """In a worker: its share of the cores for build tools and torch, so ``jobs`` workers
    compiling at once do not start ``jobs`` x cores compilers (FlashInfer's JIT runs ninja
    with ``MAX_JOBS`` jobs, else one per core, each nvcc taking GBs of host memory)."""
    die_with_parent()
    cores = int(os.environ.get("MAX_JOBS", "0")) or os.cpu_count() or 1
    share = max(1, cores // jobs)
    os.environ["MAX_JOBS"] = str(share)
    torch.set_num_threads(share)


def _result(task: Future | _Deferred) -> Any:
    try:
        return task.result()
    except BrokenProcessPool as e:
        raise PagedgenError(f"a verify worker process died ({e}); rerun with --jobs 1 to see "
                            f"where")


def cannot_run(name: str, model: str, dtype: str, device: torch.device) -> str | None:
    """Why backend ``name`` cannot run ``model``'s layers (a head size, a soft cap), or None."""
    from pagedgen.attention.registry import backend_for_model
    from pagedgen.runtime.engine.kv_groups import model_layout

    specs, _, t, kv = model_layout(model, device, dtype)
    try:
        backend_for_model(name, device, specs, t, kv, model)
    except PagedgenError as e:
        return str(e)
    return None


def mixes_backends(model: str, dtype: str, device: torch.device) -> bool:
    """Whether ``auto`` runs ``model``'s KV groups on more than one backend here (Gemma 4 on a
    GPU: FA4 beside triton), so ``verify``'s "all" checks that mix too."""
    from pagedgen.runtime.engine.kv_groups import group_backends, model_layout

    specs, layout, t, kv = model_layout(model, device, dtype)
    try:
        _, chosen = group_backends(specs, layout, "auto", device, t, kv, model)
    except PagedgenError:  # no backend runs it here: the named backends' rows say why
        return False
    return len(set(chosen)) > 1
