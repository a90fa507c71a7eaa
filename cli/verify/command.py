"""`pagedgen verify`: every backend checked against the eager reference, kernel and model
level (checks: ``kernel_checks.py``, ``model_checks.py``; running them: ``runner.py``)."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import typer
from rich.markup import escape

from pagedgen.cli.common import cli_errors, console, out_console
from pagedgen.cli.formats.output_target import check_creatable, write_result
from pagedgen.errors import PagedgenError


@cli_errors  # Ctrl-C and SIGTERM: one line (bad options exit with 2 below)
def verify(
    backend: str = typer.Option("all", help="A backend name, all, or auto (the model on "
                                            "what auto picks for each KV group; all adds it "
                                            "where that mixes backends)."),
    model: str = typer.Option("tiny", help="Model for the model-level check (its own weights; "
                                           "dummy ones for a preset)."),
    dtype: str = typer.Option("auto", help="Model dtype for the model-level check."),
    cases: int = typer.Option(24, min=1, help="Random cases per kernel check group."),
    steps: int = typer.Option(16, min=1, help="Decode steps in the model-level check."),
    seed: int = typer.Option(0),
    device: str | None = typer.Option(None, help="auto, cpu, cuda or cuda:N [default: auto]."),
    tensor_parallel_size: int = typer.Option(
        1, "--tensor-parallel-size", "-tp", min=1,
        help="Also check the model sharded over this many ranks (GPUs 0..N-1, or gloo on CPU) "
             "against one rank's eager run."),
    quantization: str | None = typer.Option(
        None, "--quantization", "-q",
        help="fp8: also check the FP8 GEMMs and the model with FP8 weights against their "
             "dequantized reference."),
    model_only: bool = typer.Option(
        False, "--model-only",
        help="Only the model-level checks (no kernel checks: nothing compiled beyond what the "
             "model runs); one worker unless --jobs says otherwise, as each check holds the "
             "model on the GPU."),
    json_report: bool = typer.Option(False, "--json", help="Print every figure as JSON (on "
                                                          "stdout; the progress on stderr)."),
    output: Path | None = typer.Option(None, "--output", "-o",
                                       help="Write every figure here, as JSON."),
    jobs: int = typer.Option(
        0, min=0, help="Worker processes for the checks (0: one per core up to 16 on a GPU, "
                       "where kernel compiles dominate; 1 on the CPU)."),
    kv_cache_dtype: str = typer.Option(
        "auto", "--kv-cache-dtype",
        help="With --batch-invariance: the KV cache's dtype (fp8: e4m3 pages)."),
    batch_invariance: bool = typer.Option(
        False, "--batch-invariance",
        help="Instead: whether a request's tokens and log-probabilities are bitwise those it "
             "gets alone, in random batches (--cases of them), behind a cached prefix, in "
             "other prefill chunks and after preemptions (--model on --backend; all: auto)."),
) -> None:
    """Check backends against the eager reference; exit 0 when all pass, 1 on a mismatch, 3
    when a backend named with --backend (or the FP8 checks of -q fp8) cannot run here."""
    # the checks' modules (torch among them) load here, not for --help
    from pagedgen.attention.registry import backend_names, get_backend
    from pagedgen.cli.verify.fp8_checks import NAME as FP8_CHECKS
    from pagedgen.cli.verify.fp8_checks import plan_fp8
    from pagedgen.cli.verify.linear_checks import plan_linear
    from pagedgen.cli.verify.model_checks import check_tensor_parallel
    from pagedgen.cli.verify.runner import (
        default_jobs,
        graph_modes,
        mixes_backends,
        plan_backend,
        run_plans,
    )
    from pagedgen.runtime.config import EngineConfig
    from pagedgen.runtime.models.loader import resolve_model

    names = backend_names()
    if backend not in ("all", "auto") and backend not in names:
        console.print(f"[bold red]error:[/] unknown backend '{backend}'; known: "
                      f"{', '.join(names)}")
        raise typer.Exit(2)
    if kv_cache_dtype != "auto" and not batch_invariance:
        console.print("[bold red]error:[/] --kv-cache-dtype goes with --batch-invariance (the "
                      "backends' FP8-KV kernel rows run in every verify)")
        raise typer.Exit(2)
    if quantization not in (None, "fp8"):
        console.print(f"[bold red]error:[/] unknown quantization '{escape(quantization)}'; "
                      "use fp8")
        raise typer.Exit(2)
    try:
        dev = EngineConfig(device=device or "auto").torch_device()
        EngineConfig(dtype=dtype).torch_dtype(dev)  # a bad dtype or model before any check
        resolve_model(model)
        if output is not None:  # before the checks: their results must have a place
            output = output.expanduser()
            check_creatable(output, "--output")
        t0 = time.perf_counter()
        out = console if json_report else out_console()
        every = names + (["auto"] if mixes_backends(model, dtype, dev) else [])
        plans = [plan_backend(n, dev, model, dtype, cases, steps, seed, not model_only)
                 for n in (every if backend == "all" else [backend])]
        if batch_invariance:  # these checks alone
            from pagedgen.cli.verify.invariance_checks import plan_invariance
            plans = [plan_invariance(dev, model, dtype, "auto" if backend == "all" else backend,
                                     cases, steps, seed, quantization, kv_cache_dtype)]
        elif quantization == "fp8":
            plans.append(plan_fp8(dev, model, dtype, cases, steps, seed))
        if dev.type == "cuda" and backend == "all" and not model_only and not batch_invariance:
            plans.append(plan_linear(dev, cases, seed))  # linear attention's own kernels
        reports = run_plans(plans, jobs or (1 if model_only else default_jobs(dev)), out,
                            lambda name: check_tensor_parallel(
                                name, model, dtype, dev, steps, seed, tensor_parallel_size,
                                graph_modes(get_backend(name, dev), dev)[-1])
                            if tensor_parallel_size > 1 else None)
    except PagedgenError as e:
        console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        raise typer.Exit(2)
    checked = [r for r in reports if r.status == "checked"]
    failed = [r.backend for r in checked if not r.passed]
    n_rows = sum(len(r.rows) for r in checked)
    n_bad = sum(not row.passed for r in checked for row in r.rows)
    skipped = [r.backend for r in reports if r.status == "skipped"]
    # what the user named, not what "all" lists: skipped here means not verified at all
    unchecked = [n for n in skipped if n == backend or (quantization and n == FP8_CHECKS)
                 or batch_invariance]  # then its report alone: the checks asked for
    verdict = ("[bold red]FAIL" if failed else "[bold yellow]NOT CHECKED" if unchecked
               else "[bold green]PASS")
    out.print(f"{verdict}[/]: {n_rows - n_bad}/{n_rows}"
              f" checks passed on {dev} for {', '.join(r.backend for r in checked) or 'nothing'}"
              + (f"; failing: {', '.join(failed)}" if failed else "")
              + (f"; skipped: {', '.join(skipped)}" if skipped else "")
              + f" ({time.perf_counter() - t0:.1f} s)")
    report = json.dumps({"device": str(dev), "passed": not failed and not unchecked,
                         "not_checked": unchecked,
                         "backends": [dataclasses.asdict(r) for r in reports]}, indent=2)
    if json_report:
        print(report)
    if output:
        try:
            write_result(output, report, "--output")
        except PagedgenError as e:
            console.print(f"[bold red]error:[/] {escape(str(e))}")
            raise typer.Exit(2)
    if failed:
        raise typer.Exit(1)
    if unchecked:
        console.print(f"[bold red]error:[/] {', '.join(unchecked)} cannot run on {dev}: "
                      "nothing of it was checked")
        raise typer.Exit(3)
