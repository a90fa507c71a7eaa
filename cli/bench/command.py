"""`pagedgen bench throughput|latency|kernels`: one command and its options for the three
measures (``measures.py``), the engine's options shared."""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from pagedgen.cli.common import cli_errors, console, out_console
from pagedgen.cli.formats.output_target import check_creatable, write_result
from pagedgen.errors import PagedgenError

KINDS = ("throughput", "latency", "kernels")
SHOWN = {"model": "model", "backend": "backend", "device": "device", "dtype": "dtype",
         "quantization": "quantization", "requests": "requests",
         "prompt_tokens": "prompt tokens", "output_tokens": "output tokens",
         "wall_time_s": "wall time (s)", "requests_per_s": "requests/s",
         "total_tokens_per_s": "total tokens/s", "output_tokens_per_s": "output tokens/s",
         "preemptions": "preemptions", "max_num_seqs": "max_num_seqs",
         "kv_cache_token_slots": "KV cache token slots",
         "startup_s": "start-up (s): command to first request"}


@cli_errors
def bench(
    kind: str = typer.Argument(..., help="throughput: NUM-PROMPTS requests (random or a "
                                         "dataset's) through the engine, as vllm bench "
                                         "throughput; latency: one batch of each BATCH-SIZES "
                                         "again and again, as vllm bench latency; kernels: "
                                         "throughput's requests under torch.profiler, the "
                                         "run's time by kernel group."),
    model: str | None = typer.Option(None, help="A preset, checkpoint directory, GGUF file or "
                                                "Hub id [default: tiny]."),
    input_len: int | None = typer.Option(None, min=1, help="Prompt tokens (random ids) "
                                         "[default: 1024 for throughput, 32 for latency]."),
    output_len: int = typer.Option(128, min=1, help="Output tokens of every request (EOS "
                                                    "ignored)."),
    num_prompts: int = typer.Option(1000, min=1, help="throughput, kernels: requests."),
    range_ratio: float = typer.Option(0.0, min=0.0, max=1.0, help="throughput, kernels: prompt "
                                      "lengths drawn from input-len x [1 - r, 1 + r]."),
    dataset: Path | None = typer.Option(None, help="throughput, kernels: a JSONL file of "
                                                   "pagedgen's lines instead of random "
                                                   "prompts (its first --num-prompts)."),
    top: int = typer.Option(15, min=1, help="kernels: the heaviest kernels listed."),
    peer: str | None = typer.Option(None, help="throughput: vllm also runs the same random "
                                               "prompts after pagedgen, in a process of its "
                                               "own, at its defaults (where vLLM is "
                                               "installed: here or $PAGEDGEN_VLLM_SITE)."),
    batch_sizes: str = typer.Option("8", help="latency: requests in the batch; a comma list "
                                              "measures each (e.g. 1,8,64)."),
    num_iters_warmup: int = typer.Option(10, min=0, help="latency: unmeasured batches first."),
    num_iters: int = typer.Option(30, min=1, help="latency: measured batches."),
    seed: int = typer.Option(0, help="Seed of the random prompts and of the run."),
    backend: str | None = typer.Option(None, help="Attention backend [default: auto]."),
    device: str | None = typer.Option(None, help="auto, cpu, cuda or cuda:N."),
    dtype: str | None = typer.Option(None, help="auto, float32, float16 or bfloat16."),
    quantization: str | None = typer.Option(None, "--quantization", "-q",
                                            help="fp8: FP8 weights made at load."),
    kv_cache_dtype: str | None = typer.Option(None, help="auto or fp8."),
    max_num_seqs: int | None = typer.Option(None, help="Most sequences in a step "
                                            "[default: the device's; latency: the largest "
                                            "batch]."),
    max_num_batched_tokens: int | None = typer.Option(None, help="Most tokens in a step."),
    max_model_len: int | None = typer.Option(None, help="Longest sequence."),
    gpu_memory_utilization: float | None = typer.Option(
        None, help="Share of the GPU's memory the run may use [default: 0.9]."),
    kv_cache_memory: str | None = typer.Option(None, help="KV-cache size, e.g. 4GiB."),
    enforce_eager: bool | None = typer.Option(None, "--enforce-eager/--cuda-graphs",
                                              help="CUDA graphs off [default: on]."),
    json_out: bool = typer.Option(False, "--json", help="Print every figure as JSON."),
    output: Path | None = typer.Option(None, "--output", "-o",
                                       help="Write every figure here, as JSON."),
) -> None:
    """Measure this machine as vllm bench does: offline throughput, or one batch's latency
    (each request to OUTPUT-LEN tokens, EOS ignored; the engine at its defaults)."""
    started = time.perf_counter()
    from pagedgen.cli.bench import measures
    from pagedgen.runtime.api import LLM

    if kind not in KINDS:
        raise PagedgenError(f"unknown measure {kind!r}; use {' or '.join(KINDS)}")
    if peer is not None and (peer != "vllm" or kind != "throughput" or dataset is not None):
        raise PagedgenError("--peer: vllm, with bench throughput on random prompts (the token "
                            "ids both systems take alike)" + (f", not {peer!r}"
                                                              if peer != "vllm" else ""))
    sizes = _sizes(batch_sizes) if kind == "latency" else []
    if output is not None:
        output = output.expanduser()
        check_creatable(output, "--output")
    options = dict(backend=backend, device=device, dtype=dtype, quantization=quantization,
                   kv_cache_dtype=kv_cache_dtype,
                   max_num_seqs=max(sizes, default=None) if max_num_seqs is None
                   else max_num_seqs,
                   max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                   gpu_memory_utilization=gpu_memory_utilization,
                   kv_cache_memory=kv_cache_memory, enforce_eager=enforce_eager, seed=seed)
    llm = LLM(model=model, _named_as_options=True,
              **{k: v for k, v in options.items() if v is not None})
    if kind == "latency":
        figures = {"model": llm.engine.src.name, "rows": [
            measures.latency(llm, b, input_len or 32, output_len, num_iters_warmup, num_iters,
                             seed) for b in sizes]}
    else:
        prompts = (measures.dataset_prompts(dataset.expanduser(), num_prompts) if dataset
                   else measures.synthetic_prompts(llm.engine.src.hf_config.vocab_size,
                                                   num_prompts, input_len or 1024, range_ratio,
                                                   seed))
        figures = (measures.kernels(llm, prompts, output_len, top) if kind == "kernels"
                   else measures.measure(llm, prompts, output_len, started))
        if peer:
            src, run_dtype = llm.engine.src, llm.engine.dtype
            del llm  # its GPU memory back before vLLM starts
            figures["peer"] = measures.vllm_peer(src, run_dtype, prompts, output_len,
                                                 max_model_len, quantization, kv_cache_dtype)
            if "output_tokens_per_s" in figures["peer"]:
                figures["vs_vllm"] = (figures["output_tokens_per_s"]
                                      / figures["peer"]["output_tokens_per_s"])
    report = json.dumps(figures, indent=2, default=str)
    if output is not None:
        write_result(output, report, "--output")
    if json_out:
        print(report)
    elif kind == "latency":
        _show_latency(figures["rows"])
    elif kind == "kernels":
        _show_kernels(figures)
    else:
        _show_throughput(figures, measures.throughput_line(figures))


def _sizes(batch_sizes: str) -> list[int]:
    try:
        sizes = [int(b) for b in batch_sizes.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise PagedgenError(f"--batch-sizes: positive integers separated by commas, not "
                            f"{batch_sizes!r}")
    return sizes


def _show_throughput(summary: dict, line: str) -> None:
    table = Table(title="pagedgen bench throughput", show_header=False, title_justify="left")
    table.add_column()
    table.add_column(justify="right")
    for key, label in SHOWN.items():
        if key in summary:
            value = summary[key]
            text = f"{value:,.2f}" if isinstance(value, float) else (
                f"{value:,}" if isinstance(value, int) else str(value))
            table.add_row(label, escape(text))
    out = out_console()
    out.print(table)
    out.print(line)
    theirs = summary.get("peer")
    if theirs and "skipped" in theirs:
        console.print(f"--peer vllm: {escape(theirs['skipped'])}")
    elif theirs:
        out.print(f"{theirs['system']}: {theirs['output_tokens_per_s']:,.2f} output tokens/s "
                  f"({theirs['total_tokens_per_s']:,.2f} total, start-up "
                  f"{theirs['startup_s']:.1f} s); pagedgen {summary['vs_vllm']:.2f}x")
    if summary.get("preemptions"):
        console.print(f"note: {summary['preemptions']} preemption(s): the KV cache held fewer "
                      "sequences than were admitted")


def _show_latency(rows: list[dict]) -> None:
    table = Table(title="pagedgen bench latency", title_justify="left")
    for col in ("batch", "avg (s)", "p50 (s)", "p90 (s)", "p99 (s)", "TTFT (ms)",
                "per output token (ms)"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["batch_size"]), *(f"{r[k]:.4f}" for k in (
            "avg_latency_s", "p50_latency_s", "p90_latency_s", "p99_latency_s")),
            f"{r['mean_ttft_s'] * 1e3:.2f}", f"{r['mean_tpot_s'] * 1e3:.2f}")
    out_console().print(table)


def _show_kernels(f: dict) -> None:
    out = out_console()
    table = Table(title=f"pagedgen bench kernels: {escape(f['model'])} on {escape(f['device'])} "
                        f"({escape(f['backend'])}), {f['measured']}", title_justify="left")
    for col in ("group", "seconds", "share"):
        table.add_column(col, justify="right" if col != "group" else "left")
    for group, sec in sorted(f["groups_s"].items(), key=lambda kv: -kv[1]):
        table.add_row(group, f"{sec:.3f}", f"{sec / f['device_s']:.1%}" if f["device_s"] else "")
    out.print(table)
    top = Table(title=f"the {len(f['top_s'])} heaviest", title_justify="left")
    top.add_column("kernel")
    top.add_column("seconds", justify="right")
    for name, sec in f["top_s"]:
        top.add_row(escape(name), f"{sec:.3f}")
    out.print(top)
    calls = "launches" if f["measured"] == "GPU kernels" else "operator calls"
    out.print(f"{f['device_s']:.2f} s of {f['measured']} in {f['wall_time_s']:.2f} s of wall "
              f"time ({f['busy_fraction']:.0%}), {f['launches']:,} {calls}, "
              f"{f['requests']:,} requests")
