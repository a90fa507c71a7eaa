"""`pagedgen profile`: where the time goes, per kernel group and phase, against the hardware
(the workload: ``workload.py``; measuring it: ``measure.py``; the tables and charts:
``report.py``)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import typer
from rich.markup import escape

from pagedgen.cli.common import cli_errors, out_console
from pagedgen.errors import BackendCannotRun, PagedgenError
from pagedgen.runtime.inputs.settings import engine_and_sampling


@cli_errors
def profile(
    profile_name: str | None = typer.Option(None, "--profile",
                                            help="Run profile: name or YAML [default: tiny]."),
    backend: str | None = typer.Option(None, help="Backend name, auto, or all (every "
                                                  "available backend but eager) "
                                                  "[default: auto]."),
    model: str | None = typer.Option(
        None, help="Checkpoint directory, .gguf file, Hub id (org/name) or preset [default: "
                   "the profile's]."),
    revision: str | None = typer.Option(
        None, help="A Hub id's branch, tag or commit [default: main]."),
    device: str | None = typer.Option(None, help="auto, cpu, cuda or cuda:N [default: auto]."),
    dtype: str | None = typer.Option(
        None, help="auto, float32, float16 or bfloat16 [default: auto: bfloat16 on a GPU]."),
    kv_cache_dtype: str | None = typer.Option(None, help="auto or fp8 [default: auto]."),
    quantization: str | None = typer.Option(
        None, "--quantization", "-q",
        help="fp8: FP8 weights quantized at load [default: the checkpoint's own, else none]."),
    block_size: int | None = typer.Option(
        None, help="Tokens per KV page [default: the backend's]."),
    batch_sizes: str | None = typer.Option(
        None, help="Comma-separated, e.g. 1,8,64 [default: the profile's workload, else 1,4,16]."),
    prompt_len: int | None = typer.Option(
        None, help="Prompt tokens [default: the profile's workload, else 64]."),
    shared_prefix_len: int | None = typer.Option(
        None, help="Leading tokens every prompt of a batch shares (shows prefix caching) "
                   "[default: 0]."),
    output_len: int | None = typer.Option(
        None, help="Decode steps per batch size at most [default: the profile's workload, "
                   "else 16]."),
    prompts: str | None = typer.Option(
        None, help="JSONL prompt file instead of random prompts [default: random]."),
    warmup_steps: int | None = typer.Option(None, help="[default: 2]"),
    measured_steps: int | None = typer.Option(None, help="[default: 8]"),
    cuda_graphs: bool | None = typer.Option(None, "--cuda-graphs/--no-cuda-graphs",
                                            help="[default: on]"),
    fused_kernels: bool | None = typer.Option(
        None, "--fused-kernels/--no-fused-kernels",
        help="Norms, rotary and SwiGLU as fused Triton kernels on CUDA [default: on]."),
    prefix_caching: bool | None = typer.Option(None, "--prefix-caching/--no-prefix-caching",
                                               help="[default: on]"),
    cascade_attention: bool | None = typer.Option(
        None, "--cascade-attention/--no-cascade-attention",
        help="Decode batches sharing prefix pages attend them once [default: on]."),
    expert_parallel: bool | None = typer.Option(
        None, "--expert-parallel/--no-expert-parallel", "-ep",
        help="Under -tp, each rank holds a share of a MoE model's experts whole, instead of a "
             "share of every expert [default: off]."),
    tensor_parallel_size: int | None = typer.Option(
        None, "--tensor-parallel-size", "-tp",
        help="Shard the model over this many GPUs (rank 0's kernels are reported) "
             "[default: 1]."),
    output_dir: Path = typer.Option(Path("pagedgen-profile"), help="Trace, JSON and charts."),
    seed: int = typer.Option(0),
) -> None:
    """Run a workload under torch.profiler; report kernel groups, phases and rooflines."""
    # the run's modules (torch among them) load here, not for --help
    from pagedgen.attention.registry import backend_status, get_backend
    from pagedgen.cli.profile.measure import run_backend, run_sharded
    from pagedgen.cli.profile.report import charts, render
    from pagedgen.cli.profile.workload import workload_from

    engine_cfg, _, prof = engine_and_sampling(
        profile_name, model, dict(device=device, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                                  quantization=quantization,
                                  block_size=block_size, seed=seed,
                                  fused_kernels=fused_kernels, prefix_caching=prefix_caching,
                                  cascade_attention=cascade_attention,
                                  tensor_parallel_size=tensor_parallel_size,
                                  expert_parallel=expert_parallel), {}, revision=revision)
    output_dir = output_dir.expanduser()  # where a script quoted "~/..."
    prompts = os.path.expanduser(prompts) if prompts else prompts
    wl = workload_from(prof, dict(batch_sizes=batch_sizes, prompt_len=prompt_len,
                              shared_prefix_len=shared_prefix_len,
                              output_len=output_len, prompts=prompts,
                              warmup_steps=warmup_steps, measured_steps=measured_steps,
                              cuda_graphs=cuda_graphs))
    dev = engine_cfg.torch_device()
    asked = backend or engine_cfg.backend
    if asked == "all":  # every fast path; eager is the reference, not a contender
        names = [s.name for s in backend_status(dev) if s.available and s.name != "eager"]
    else:  # auto stays auto: the engine picks the first backend that runs the model's layers
        names = [asked if asked == "auto" else get_backend(asked, dev).name]
    try:  # before anything loads: a run's traces must have somewhere to go
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PagedgenError(f"--output-dir {output_dir}: cannot make a directory there: "
                            f"{e.strerror or e}")
    if not os.access(output_dir, os.W_OK | os.X_OK):
        raise PagedgenError(f"--output-dir {output_dir}: not writable")
    limits: dict[str, float] = {}
    console = out_console()
    if dev.type == "cuda":
        from pagedgen.runtime import hardware
        limits = {"copy_bw": hardware.copy_bandwidth(), "matmul": hardware.matmul_flops()}
        fp8_peak = hardware.fp8_matmul_flops() if engine_cfg.quantization else None
        if fp8_peak:
            limits["matmul_fp8"] = fp8_peak
    results = []
    for name in names:
        console.print(f"[bold]profiling {name}[/] ...")
        cfg = dataclasses.replace(engine_cfg, backend=name)
        try:
            if cfg.tensor_parallel_size > 1:
                results.append(run_sharded(cfg, wl, output_dir, seed, limits))
            else:
                results.append(run_backend(cfg, wl, output_dir, seed, limits))
        except BackendCannotRun as e:
            if asked != "all":
                raise
            console.print(f"[yellow]skipped:[/] {escape(str(e))}")
    if not results:
        raise PagedgenError(f"no available backend runs {engine_cfg.model}")
    render(results, console)
    pngs = charts(results, output_dir)
    summary = output_dir / "profile.json"
    summary.write_text(json.dumps({"workload": dataclasses.asdict(wl), "limits": limits,
                                   "results": results}, indent=2))
    console.print(f"wrote {summary}, {', '.join(str(p) for p in pngs)} and "
                  f"{', '.join(r['trace'] for r in results)} (open in Perfetto)")
