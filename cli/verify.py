"""`pagedgen verify`: every backend checked against the eager reference, kernel and model level.

Tolerances live in ``KERNEL_TOL`` and ``MODEL_TOL`` below; docs/VERIFY.md explains them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import multiprocessing as mp
import os
import time
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                           TimeElapsedColumn)
from rich.table import Table

from pagedgen.attention.backend import AttentionBackend
from pagedgen.attention import cascade
from pagedgen.attention.cases import make_paged_batch, make_shared_prefix_batch, run_backend
from pagedgen.attention.eager import EagerBackend
from pagedgen.attention.registry import backend_names, get_backend, unavailable_reason
from pagedgen.cli import data_parallel
from pagedgen.cli.common import console, out_console
from pagedgen.errors import PagedgenError

# Max absolute error of the attention output against eager (float32 math over the same cache),
# for q/k/v ~ N(0, 1). See docs/VERIFY.md for the reasoning.
KERNEL_TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
FP8_KV_TOL = 4e-2  # bf16 queries over an FP8 cache, compared with eager over the same FP8 cache
# Max logit difference relative to the largest reference logit, per model-level step.
MODEL_TOL = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 5e-2}

GQA_RATIOS = (1, 2, 4, 8)
HEAD_SIZES = (64, 128, 256)
PAGE_SIZES = (16, 32)


@dataclass
class Row:
    kind: str  # "kernel" | "model"
    group: str
    cases: int
    worst_abs: float
    worst_rel: float
    tol: float
    passed: bool
    detail: str = ""
    seconds: float = 0.0  # its tasks' time in the processes that ran them, compiles included


@dataclass
class BackendReport:
    backend: str
    status: str  # "checked" | "skipped" | "reference"
    reason: str = ""
    rows: list[Row] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.rows)


def kernel_groups(backend: type[AttentionBackend], device: torch.device
                  ) -> list[tuple[str, torch.dtype, dict]]:
    """(label, dtype, case options) for each group this backend supports."""
    groups = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        if dtype not in backend.supported_dtypes:
            continue
        name = str(dtype).removeprefix("torch.")
        groups.append((f"{name}", dtype, {}))
        if backend.supports_sliding_window:
            groups.append((f"{name} sliding window", dtype, {"sliding_window": 19}))
        if backend.supports_soft_cap:
            groups.append((f"{name} soft-cap", dtype, {"soft_cap": 20.0}))
    if backend.supports_fp8_kv_cache and torch.bfloat16 in backend.supported_dtypes:
        groups.append(("bfloat16 fp8 KV cache", torch.bfloat16,
                       {"cache_dtype": torch.float8_e4m3fn}))
    return groups


def page_sizes(backend: type[AttentionBackend]) -> list[int]:
    """The pages to check: 16 and 32 where allowed, and the backend's default."""
    allowed = backend.get_supported_block_sizes()
    pages = {p for p in PAGE_SIZES if allowed is None or p in allowed}
    return sorted(pages | {backend.resolve_block_size(None)})


@dataclass
class Partial:
    """Worst errors over some of a kernel check group's cases (the group's row is the
    combination of its parts, which may run in different processes)."""

    cases: int = 0
    worst_abs: float = 0.0
    worst_rel: float = 0.0
    bad_cache: int = 0

    def add(self, out: torch.Tensor, ref: torch.Tensor, same_cache: bool = True) -> None:
        err = (out.float() - ref.float()).abs().max().item()
        self.cases += 1
        self.worst_abs = max(self.worst_abs, err)
        self.worst_rel = max(self.worst_rel, err / max(ref.float().abs().max().item(), 1e-6))
        self.bad_cache += not same_cache

    @staticmethod
    def combine(parts: list["Partial"]) -> "Partial":
        return Partial(sum(p.cases for p in parts), max(p.worst_abs for p in parts),
                       max(p.worst_rel for p in parts), sum(p.bad_cache for p in parts))


def _shapes(backend: type[AttentionBackend]) -> tuple[list[int], list[int]]:
    """The head sizes and page sizes checked for ``backend``."""
    return [h for h in HEAD_SIZES if h in backend.get_supported_head_sizes()], page_sizes(backend)


def kernel_cases(name: str, device: torch.device, dtype: torch.dtype, opts: dict,
                 case_ids: list[int], seed: int) -> Partial:
    """Cases ``case_ids`` of one kernel group: random mixed prefill/decode batches through
    backend ``name`` and through eager, outputs and written caches compared. Case ``i`` cycles
    through the GQA ratios, then head sizes, then page sizes."""
    backend = get_backend(name, device)
    sizes, pages = _shapes(backend)
    part = Partial()
    for i in case_ids:
        gqa = GQA_RATIOS[i % len(GQA_RATIOS)]
        head = sizes[(i // len(GQA_RATIOS)) % len(sizes)]
        page = pages[(i // (len(GQA_RATIOS) * len(sizes))) % len(pages)]
        b = make_paged_batch(seed * 100_003 + i, num_heads=2 * gqa, num_kv_heads=2,
                             head_size=head, block_size=page, dtype=dtype, device=device,
                             num_prefills=1 + i % 3, num_decodes=1 + (i * 7) % 6,
                             max_context=3 * page + 5, max_new=2 * page + 3, **opts)
        ref, ref_cache = run_backend(EagerBackend, b)
        out, cache = run_backend(backend, b)
        part.add(out, ref, torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8)))
    return part


def kernel_row(label: str, dtype: torch.dtype, opts: dict, parts: list[Partial]) -> Row:
    p = Partial.combine(parts)
    tol = FP8_KV_TOL if "cache_dtype" in opts else KERNEL_TOL[dtype]
    detail = f"{p.bad_cache} case(s) wrote the KV cache differently" if p.bad_cache else ""
    return Row("kernel", label, p.cases, p.worst_abs, p.worst_rel, tol,
               p.worst_abs <= tol and p.bad_cache == 0, detail)


def cascade_dtype(backend: type[AttentionBackend]) -> torch.dtype:
    return next(d for d in (torch.bfloat16, torch.float16, torch.float32)
                if d in backend.supported_dtypes)


def cascade_cases(name: str, device: torch.device, case_ids: list[int], seed: int
                  ) -> Partial | None:
    """Cascade decode (decodes sharing their first pages: the prefix attended once for the
    batch) against eager attention; None when the backend's state has no cascade. One head
    size (128 where supported): the split and merge do not depend on it, and each shape is one
    more kernel variant to compile (FA4)."""
    backend = get_backend(name, device)
    sizes, pages = _shapes(backend)
    sizes = [128] if 128 in sizes else sizes
    dtype = cascade_dtype(backend)
    part = Partial()
    for i in case_ids:
        gqa = GQA_RATIOS[i % len(GQA_RATIOS)]
        page = pages[(i // len(GQA_RATIOS)) % len(pages)]
        b = make_shared_prefix_batch(
            seed * 100_003 + i, shared_pages=-(-cascade.MIN_TOKENS // page) + i % 3,
            num_decodes=cascade.MIN_SEQS + i % 5, num_heads=2 * gqa, num_kv_heads=2,
            head_size=sizes[i % len(sizes)], block_size=page, dtype=dtype, device=device,
            max_suffix=2 * page + 5)
        state = backend.get_state_cls()(backend, [b.spec], page, dtype, dtype, device)
        if not state.supports_cascade:
            return None
        ref, _ = run_backend(EagerBackend, b)
        out, _ = run_backend(backend, b, state)
        part.add(out, ref)
    return part


def cascade_row(dtype: torch.dtype, parts: list[Partial | None]) -> Row | None:
    if any(p is None for p in parts):
        return None
    p = Partial.combine(parts)
    tol = KERNEL_TOL[dtype]
    return Row("kernel", f"{str(dtype).removeprefix('torch.')} cascade decode (shared prefix)",
               p.cases, p.worst_abs, p.worst_rel, tol, p.worst_abs <= tol)


def _model_config(backend_name: str, model: str, dtype: str, device: torch.device, seed: int,
                  graphs: bool, tp: int = 1):
    from pagedgen.runtime.config import EngineConfig

    return EngineConfig(model=model, device=str(device), dtype=dtype, load_format="dummy",
                        seed=seed, num_blocks=1024, max_num_seqs=8, max_num_batched_tokens=1024,
                        max_model_len=512, async_scheduling=False, backend=backend_name,
                        enforce_eager=not graphs, tensor_parallel_size=tp)


def _model_prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 15, 16, 17, 40, 100]  # around page boundaries, and a single token
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


Trace = tuple[dict[tuple[int, int], torch.Tensor], list[list[int]]]


def trace(engine, prompts: list[list[int]], steps: int) -> Trace:
    """Greedy generation of ``prompts``: the float32 logits each output position was sampled
    from, by (prompt index, position), and the output tokens."""
    from pagedgen.runtime.config import SamplingParams

    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in prompts]
    index = {s.seq_id: i for i, s in enumerate(seqs)}
    logits = {}
    while engine.has_unfinished():
        engine.step()
        for row, s in enumerate(engine.runner.last_sampled):
            logits[(index[s.seq_id], s.num_output_tokens - 1)] = \
                engine.runner.last_logits[row].float().cpu()
    return logits, [list(s.output_token_ids) for s in seqs]


def trace_worker(config, prompts: list[list[int]], steps: int, inbox):
    """``trace`` on an engine built in a worker process (every tensor-parallel rank runs it;
    rank 0's trace is sent, as numpy arrays: tensors do not outlive a worker)."""
    from pagedgen.runtime.engine import Engine

    logits, outputs = trace(Engine(config), prompts, steps)
    yield {k: v.numpy() for k, v in logits.items()}, outputs


def compare(ref: Trace, got: Trace, tol: float, label: str) -> Row:
    """Logits at every position where both runs had produced the same tokens so far, and the
    greedy agreement."""
    worst_abs = worst_rel = 0.0
    first = None
    for i, (a, b) in enumerate(zip(got[1], ref[1])):
        for pos in range(min(len(a), len(b))):
            la, lb = torch.as_tensor(got[0][(i, pos)]), ref[0][(i, pos)]
            err = (la - lb).abs().max().item()
            worst_abs = max(worst_abs, err)
            worst_rel = max(worst_rel, err / max(lb.abs().max().item(), 1e-6))
            if a[pos] != b[pos]:  # contexts differ from here on: no longer comparable
                first = pos if first is None else min(first, pos)
                break
    total = sum(len(a) for a in got[1])
    same = sum(x == y for a, b in zip(got[1], ref[1]) for x, y in zip(a, b))
    detail = (f"greedy agreement {same}/{total}; "
              + (f"first divergence at step {first}" if first is not None else "no divergence"))
    return Row("model", label, total, worst_abs, worst_rel, tol, worst_rel <= tol, detail)


def check_model(backend_name: str, model: str, dtype: str, device: torch.device, steps: int,
                seed: int, graphs: bool) -> Row:
    """The same prompts through the model with the backend and with eager."""
    from pagedgen.runtime.engine import Engine

    prompts = _model_prompts(seed)
    ref = trace(Engine(_model_config("eager", model, dtype, device, seed, False)), prompts, steps)
    eng = Engine(_model_config(backend_name, model, dtype, device, seed, graphs))
    label = f"model {eng.src.name} {str(eng.runner.dtype).removeprefix('torch.')}, " \
            f"CUDA graphs {'on' if graphs else 'off'}"
    return compare(ref, trace(eng, prompts, steps), MODEL_TOL[eng.runner.dtype], label)


def check_tensor_parallel(backend_name: str, model: str, dtype: str, device: torch.device,
                          steps: int, seed: int, tp: int, graphs: bool) -> Row:
    """The model sharded over ``tp`` ranks (worker processes, NCCL on GPUs 0..tp-1 or gloo on
    the CPU) with the backend, against one process running eager attention."""
    from pagedgen.runtime.engine import Engine

    prompts = _model_prompts(seed)
    cfg = _model_config(backend_name, model, dtype, device, seed, graphs, tp)
    got = data_parallel.run_on_ranks(trace_worker, (cfg, prompts, steps), cfg)
    ref_engine = Engine(_model_config("eager", model, dtype, device, seed, False))
    ref = trace(ref_engine, prompts, steps)
    label = f"tensor parallel {tp} ({ref_engine.src.name}, CUDA graphs " \
            f"{'on' if graphs else 'off'}) vs 1 rank eager"
    return compare(ref, got, MODEL_TOL[ref_engine.runner.dtype], label)


def check_prefix_cache(backend_name: str, model: str, dtype: str, device: torch.device,
                       steps: int, seed: int, page_size: int) -> Row:
    """A prompt whose first blocks come from the prefix cache against an uncached run of the
    same prompt on the same backend. The shared prefix ends mid-block (2.5 pages), so the
    cached run recomputes the prefix's last half page on top of two cached pages."""
    from pagedgen.runtime.config import EngineConfig, SamplingParams
    from pagedgen.runtime.engine import Engine

    base = EngineConfig(model=model, device=str(device), dtype=dtype, load_format="dummy",
                        seed=seed, backend=backend_name, block_size=page_size, num_blocks=64,
                        max_num_seqs=4, max_num_batched_tokens=2048, max_model_len=8 * page_size,
                        async_scheduling=False)
    cached = Engine(base)
    fresh = Engine(dataclasses.replace(base, prefix_caching=False))
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, 256, (5 * page_size // 2,), generator=g).tolist()
    warm, prompt = (prefix + torch.randint(0, 256, (n,), generator=g).tolist() for n in (9, 13))
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    cached.generate([warm], params)  # fills the cache with the prefix's two full pages
    a, b = cached.add_request(prompt, params), fresh.add_request(prompt, params)
    worst_abs = worst_rel = 0.0
    while fresh.has_unfinished():
        cached.step()
        fresh.step()
        if a.output_token_ids[:-1] != b.output_token_ids[:-1]:
            break  # contexts differ from here on
        la, lb = cached.runner.last_logits[0].float(), fresh.runner.last_logits[0].float()
        err = (la - lb).abs().max().item()
        worst_abs = max(worst_abs, err)
        worst_rel = max(worst_rel, err / max(lb.abs().max().item(), 1e-6))
    hit = cached.stats.prefix_hit_tokens
    same = sum(x == y for x, y in zip(a.output_token_ids, b.output_token_ids))
    tol = MODEL_TOL[cached.runner.dtype]
    ok = worst_rel <= tol and hit == 2 * page_size
    return Row("model", f"prefix-cached prefill, page {page_size}", steps, worst_abs, worst_rel,
               tol, ok, f"{hit} of {len(prompt)} prompt tokens from the cache; greedy agreement "
                        f"{same}/{b.num_output_tokens}")


CHUNK = 6  # kernel cases per task: each task's compiles stay short against the whole run

Task = tuple[Callable[..., Any], tuple]  # a module-level function and its arguments


@dataclass
class Check:
    """One report row: the tasks that compute it (run here or in worker processes) and how
    their results make the row (None: no row, e.g. a backend without cascade)."""

    tasks: list[Task]
    finish: Callable[[list[Any]], Row | None]


def _single(results: list[Row]) -> Row:
    return results[0]


def plan_backend(name: str, device: torch.device, model: str, dtype: str, cases: int,
                 steps: int, seed: int) -> tuple[BackendReport, list[Check]]:
    """The report for backend ``name`` (skipped or the reference: final) and its checks."""
    if name == "eager":
        return BackendReport(name, "reference", "the reference itself (tested against a dense "
                                                "float64 computation in the test suite)"), []
    why = unavailable_reason(name, device)  # this backend only, not every backend's status
    if why is not None:
        return BackendReport(name, "skipped", why), []
    backend = get_backend(name, device)
    chunks = [list(range(i, min(i + CHUNK, cases))) for i in range(0, cases, CHUNK)]
    checks = [Check([(kernel_cases, (name, device, dt, opts, c, seed)) for c in chunks],
                    functools.partial(kernel_row, label, dt, opts))
              for label, dt, opts in kernel_groups(backend, device)]
    checks.append(Check([(cascade_cases, (name, device, c, seed)) for c in chunks],
                        functools.partial(cascade_row, cascade_dtype(backend))))
    for graphs in graph_modes(backend, device):
        checks.append(Check([(check_model, (name, model, dtype, device, steps, seed, graphs))],
                            _single))
    for page in page_sizes(backend):
        checks.append(Check([(check_prefix_cache,
                              (name, model, dtype, device, steps, seed, page))], _single))
    return BackendReport(name, "checked"), checks


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
    ``out``, show progress and print each backend's table as soon as its rows are in.
    ``sharded`` adds the tensor-parallel row (run here: it starts its own rank processes)."""
    tasks = [t for _, checks in plans for c in checks for t in c.tasks]
    shown = out is not None and (out.is_terminal or console.is_terminal)
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
                        progress.advance(bar)
                    row = c.finish(results)
                    if row is not None:
                        row.seconds = seconds
                        report.rows.append(row)
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


def render(reports: list[BackendReport], console: Console) -> None:
    for rep in reports:
        if rep.status != "checked":
            console.print(f"[bold]{rep.backend}[/]: {rep.status} — {escape(rep.reason)}")
            continue
        t = Table(title=f"{rep.backend} vs eager", title_justify="left")
        for col in ("check", "cases", "worst abs err", "worst rel err", "tolerance", "result",
                    "time", "notes"):
            t.add_column(col, justify="left" if col in ("check", "notes") else "right")
        for r in rep.rows:
            t.add_row(r.group, str(r.cases), f"{r.worst_abs:.2e}", f"{r.worst_rel:.2e}",
                      f"{r.tol:.0e}{' rel' if r.kind == 'model' else ''}",
                      "[green]pass[/]" if r.passed else "[bold red]FAIL[/]",
                      f"{r.seconds:.1f} s", escape(r.detail))
        console.print(t)


def verify(
    backend: str = typer.Option("all", help="A backend name, or all."),
    model: str = typer.Option("tiny", help="Model for the model-level check (dummy weights)."),
    dtype: str = typer.Option("auto", help="Model dtype for the model-level check."),
    cases: int = typer.Option(24, min=1, help="Random cases per kernel check group."),
    steps: int = typer.Option(16, min=1, help="Decode steps in the model-level check."),
    seed: int = typer.Option(0),
    device: Optional[str] = typer.Option(None, help="auto, cpu, cuda or cuda:N [default: auto]."),
    tensor_parallel_size: int = typer.Option(
        1, "--tensor-parallel-size", "-tp", min=1,
        help="Also check the model sharded over this many ranks (GPUs 0..N-1, or gloo on CPU) "
             "against one rank's eager run."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write every figure here."),
    jobs: int = typer.Option(
        0, min=0, help="Worker processes for the checks (0: one per core up to 16 on a GPU, "
                       "where kernel compiles dominate; 1 on the CPU)."),
) -> None:
    """Check backends against the eager reference; exit 0 when all pass, 1 on a mismatch."""
    from pagedgen.runtime.config import EngineConfig

    names = backend_names()
    if backend != "all" and backend not in names:
        console.print(f"[bold red]error:[/] unknown backend '{backend}'; known: "
                      f"{', '.join(names)}")
        raise typer.Exit(2)
    try:
        dev = EngineConfig(device=device or "auto").torch_device()
        t0 = time.perf_counter()
        out = out_console()
        plans = [plan_backend(n, dev, model, dtype, cases, steps, seed)
                 for n in (names if backend == "all" else [backend])]
        reports = run_plans(plans, jobs or default_jobs(dev), out,
                            lambda name: check_tensor_parallel(
                                name, model, dtype, dev, steps, seed, tensor_parallel_size,
                                graph_modes(get_backend(name, dev), dev)[-1])
                            if tensor_parallel_size > 1 else None)
    except PagedgenError as e:
        console.print(f"[bold red]error:[/] {escape(str(e))}")
        raise typer.Exit(2)
    checked = [r for r in reports if r.status == "checked"]
    failed = [r.backend for r in checked if not r.passed]
    n_rows = sum(len(r.rows) for r in checked)
    n_bad = sum(not row.passed for r in checked for row in r.rows)
    skipped = [r.backend for r in reports if r.status == "skipped"]
    out.print(f"{'[bold red]FAIL' if failed else '[bold green]PASS'}[/]: {n_rows - n_bad}/{n_rows}"
              f" checks passed on {dev} for {', '.join(r.backend for r in checked) or 'nothing'}"
              + (f"; failing: {', '.join(failed)}" if failed else "")
              + (f"; skipped: {', '.join(skipped)}" if skipped else "")
              + f" ({time.perf_counter() - t0:.1f} s)")
    if json_path:
        json_path.write_text(json.dumps({"device": str(dev), "passed": not failed,
                                         "backends": [dataclasses.asdict(r) for r in reports]},
                                        indent=2))
    if failed:
        raise typer.Exit(1)
