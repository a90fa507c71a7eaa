"""`pagedgen` command line: generate, backends (and the commands registered from other modules)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Optional

import typer
from rich.markup import escape
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)
from rich.table import Table

from pagedgen.cli.common import cli_errors, console, engine_and_sampling, out_console
from pagedgen.cli.profile import profile
from pagedgen.cli.verify import verify
from pagedgen.errors import PagedgenError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_show_locals=False,
                  help="Offline batch LLM generation and attention profiling over a paged KV cache.")
@app.command()
@cli_errors
def generate(
    prompts: Path = typer.Argument(..., help="JSONL file: one {\"prompt\"|\"prompt_token_ids\"|"
                                             "\"messages\": ...} per line."),
    output: Optional[Path] = typer.Option(None, "--output", "-o",
                                          help="Output JSONL [default: PROMPTS.completions.jsonl]."),
    resume: bool = typer.Option(False, help="Skip ids already in the output file."),
    model: Optional[str] = typer.Option(None, help="Checkpoint directory or preset [default: tiny]."),
    profile: Optional[str] = typer.Option(None, help="Run profile: a name in profiles/ or a YAML file."),
    backend: Optional[str] = typer.Option(None, help="Attention backend, or auto."),
    device: Optional[str] = typer.Option(None, help="auto, cpu, cuda or cuda:N."),
    dtype: Optional[str] = typer.Option(None, help="auto, float32, float16 or bfloat16."),
    kv_cache_dtype: Optional[str] = typer.Option(None, help="auto or fp8."),
    load_format: Optional[str] = typer.Option(None, help="auto, safetensors or dummy."),
    max_tokens: Optional[int] = typer.Option(None, help="Default output tokens per request."),
    temperature: Optional[float] = typer.Option(None, help="Default temperature (0 = greedy)."),
    top_p: Optional[float] = typer.Option(None),
    top_k: Optional[int] = typer.Option(None),
    seed: Optional[int] = typer.Option(None, help="Run seed (per-request seeds derive from it)."),
    ignore_eos: Optional[bool] = typer.Option(None, "--ignore-eos/--no-ignore-eos"),
    block_size: Optional[int] = typer.Option(None, help="Tokens per KV page (default: the "
                                             "backend's)."),
    num_blocks: Optional[int] = typer.Option(None),
    kv_cache_memory: Optional[str] = typer.Option(None, help="KV-cache size, e.g. 4GiB."),
    max_num_seqs: Optional[int] = typer.Option(None),
    max_num_batched_tokens: Optional[int] = typer.Option(None),
    max_model_len: Optional[int] = typer.Option(None),
    enforce_eager: Optional[bool] = typer.Option(None, "--enforce-eager/--cuda-graphs",
                                                 help="Turn CUDA graphs off."),
    fused_kernels: Optional[bool] = typer.Option(
        None, "--fused-kernels/--no-fused-kernels",
        help="Norms, rotary and SwiGLU as fused Triton kernels on CUDA (default: on)."),
    json_summary: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Generate completions for every line of PROMPTS and print a throughput summary."""
    from pagedgen.cli.output import OutputWriter
    from pagedgen.cli.prompts import read_requests
    from pagedgen.cli.summary import summarize, summary_table
    from pagedgen.runtime.engine import Engine

    engine_cfg, defaults, _ = engine_and_sampling(
        profile, model,
        dict(backend=backend, device=device, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
             load_format=load_format, seed=seed, block_size=block_size, num_blocks=num_blocks,
             kv_cache_memory=kv_cache_memory, max_num_seqs=max_num_seqs,
             max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
             enforce_eager=enforce_eager, fused_kernels=fused_kernels),
        dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
             ignore_eos=ignore_eos))
    try:
        defaults.validate()
    except ValueError as e:
        raise PagedgenError(f"options: {e}")
    requests = read_requests(prompts)
    output = output or prompts.with_name(prompts.stem + ".completions.jsonl")
    if output.resolve() == prompts.resolve():
        raise PagedgenError("--output must differ from the prompts file")

    t_load = time.perf_counter()
    with console.status(f"loading {engine_cfg.model} ..."):
        engine = Engine(engine_cfg)
    load_s = time.perf_counter() - t_load

    # tokenize and check every request before touching the output file
    tok = engine.tokenizer
    prompt_ids: list[list[int]] = []
    for req in requests:
        try:
            if req.prompt is not None:
                ids = tok.encode(req.prompt)
            elif req.messages is not None:
                ids = tok.apply_chat_template(req.messages)
            else:
                ids = req.prompt_token_ids
            engine.check_prompt(ids)
        except (ValueError, PagedgenError) as e:
            raise PagedgenError(f"{req.where(prompts)}: {e}")
        prompt_ids.append(ids)

    writer = OutputWriter(output, resume)
    seqs = []
    for req, ids in zip(requests, prompt_ids):
        if not writer.is_done(req.id):
            seqs.append(engine.add_request(ids, req.sampling(defaults), request=req,
                                            index=req.index))
    skipped = len(requests) - len(seqs)

    def record(seq) -> dict[str, Any]:
        req = seq.request
        return {"id": req.id,
                "prompt": req.prompt if req.prompt is not None else tok.decode(seq.prompt_token_ids),
                "text": engine.output_text(seq), "token_ids": seq.output_token_ids,
                "num_prompt_tokens": seq.num_prompt_tokens,
                "num_output_tokens": seq.num_output_tokens, "finish_reason": seq.finish_reason}

    order = [r.id for r in requests]
    start = time.perf_counter()
    progress = Progress(TextColumn("[bold]generating"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[tokens]:,} tokens out"), TimeElapsedColumn(),
                        TimeRemainingColumn(), console=console, transient=json_summary)
    try:
        with progress:
            task = progress.add_task("gen", total=len(seqs), tokens=0)

            def on_step(finished):
                for seq in finished:
                    writer.write(record(seq))
                progress.update(task, advance=len(finished),
                                tokens=sum(s.num_output_tokens for s in seqs))

            engine.run(on_step=on_step)
    except KeyboardInterrupt:
        writer.close(order)
        console.print(f"[yellow]interrupted:[/] {len(writer.done)} of {len(requests)} requests "
                      f"are in {output}; run again with --resume to finish")
        raise typer.Exit(130)
    except BaseException:
        writer.close(order)
        raise
    wall = time.perf_counter() - start
    writer.close(order)
    summary = summarize(engine, seqs, wall, start,
                        {"load_time_s": load_s, "skipped_resumed": skipped, "output": str(output)})
    if json_summary:
        print(json.dumps(summary, indent=2))
    else:
        out_console().print(summary_table(summary))


@app.command()
@cli_errors
def backends(device: Optional[str] = typer.Option(None, help="auto, cpu, cuda or cuda:N.")) -> None:
    """List the attention backends and whether each runs here (and why not)."""
    from pagedgen.attention.registry import backend_status, get_backend
    from pagedgen.runtime.config import EngineConfig

    dev = EngineConfig(device=device or "auto").torch_device()
    table = Table(title=f"attention backends on {dev}", title_justify="left")
    for col in ("backend", "available", "notes"):
        table.add_column(col)
    for s in backend_status(dev):
        table.add_row(s.name, "[green]yes[/]" if s.available else "[red]no[/]", escape(s.reason))
    out = out_console()
    out.print(table)
    out.print(f"auto → {get_backend('auto', dev).name}")


app.command()(verify)
app.command("profile")(profile)


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
