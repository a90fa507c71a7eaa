"""`pagedgen generate`: a JSONL prompt file through the engine into a JSONL completions file.

Order of work, so that every error a user can cause shows before the slow parts: options →
read and validate the file → check the output path → tokenize every prompt (the model's
tokenizer, before its weights load) → load the engine → stream the requests into it lazily,
appending each finished line as it comes → put the file in input order → summary. With
``--ray``, the requests run on Ray Data replicas instead (``pagedgen.ray``), their lines
streamed into the same writer; with ``-dp N``, on N worker processes of this host
(``cli/data_parallel.py``).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TaskProgressColumn,
                           TextColumn, TimeElapsedColumn, TimeRemainingColumn)

from pagedgen.cli import data_parallel, openai_batch, records
from pagedgen.cli.common import cli_errors, console, engine_and_sampling, out_console
from pagedgen.cli.output import OutputWriter, ShardWriter
from pagedgen.cli.output_claim import OutputClaim
from pagedgen.cli.prompts import (InputSource, check_requests, input_files, read_requests,
                                  tokenize_requests)
from pagedgen.cli.replica import Replica
from pagedgen.cli.request import InputOptions
from pagedgen.cli.summary import startup, summarize, summary_table
from pagedgen.errors import PagedgenError, Terminated
from pagedgen.runtime.engine import check_request


@cli_errors
def generate(
    prompts: str = typer.Argument(..., help="JSONL file (one {\"prompt\"|\"prompt_token_ids\"|"
                                            "\"messages\": ...} per line, or an OpenAI batch "
                                            "input file), or a directory or glob of them."),
    output: Optional[str] = typer.Option(
        None, "--output", "-o", help="Output JSONL [default: PROMPTS.completions.jsonl; needed "
                                     "for stdin or a glob]; with --ray, a path ending in / is "
                                     "a directory of shards."),
    resume: bool = typer.Option(
        False, help="Finish an output file an earlier run of the same input and settings "
                    "began: its whole lines are kept, the rest run."),
    overwrite: bool = typer.Option(
        False, help="Replace an output file that already holds completions (at the first "
                    "new line; until then it stays as it was)."),
    model: Optional[str] = typer.Option(
        None, help="Checkpoint directory or preset [default: the profile's, else tiny]."),
    profile: Optional[str] = typer.Option(
        None, help="Run profile: a name in profiles/ or a YAML file [default: the preset's, "
                   "else none]."),
    backend: Optional[str] = typer.Option(
        None, help="Attention backend: auto, flashinfer, flash-attn, triton, sdpa or eager "
                   "[default: auto: the fastest that runs here]."),
    device: Optional[str] = typer.Option(
        None, help="auto, cpu, cuda or cuda:N [default: auto: cuda where there is one]."),
    dtype: Optional[str] = typer.Option(
        None, help="auto, float32, float16 or bfloat16 [default: auto: bfloat16 on a GPU, "
                   "float32 on a CPU]."),
    kv_cache_dtype: Optional[str] = typer.Option(
        None, help="auto (the model's dtype) or fp8 [default: auto]."),
    load_format: Optional[str] = typer.Option(
        None, help="auto, safetensors or dummy (random weights) [default: auto: safetensors "
                   "for a checkpoint, dummy for a preset]."),
    max_tokens: Optional[int] = typer.Option(
        None, help="Output tokens per request, where a line sets none [default: the "
                   "profile's, else 64]."),
    temperature: Optional[float] = typer.Option(
        None, help="Sampling temperature, 0 = greedy [default: the profile's, else 1.0]."),
    top_p: Optional[float] = typer.Option(
        None, help="Sample from the smallest set of tokens whose probability reaches this, "
                   "in (0, 1] [default: the profile's, else 1.0: off]."),
    top_k: Optional[int] = typer.Option(
        None, help="Sample from the k most likely tokens [default: the profile's, else 0: "
                   "off]."),
    seed: Optional[int] = typer.Option(
        None, help="Run seed; a request without one samples with a seed derived from it and "
                   "its position [default: 0]."),
    ignore_eos: Optional[bool] = typer.Option(
        None, "--ignore-eos/--no-ignore-eos",
        help="Keep generating past the end-of-sequence token [default: no]."),
    n: Optional[int] = typer.Option(None, "--n", help="Samples per request (1-128); they "
                                    "share the prompt's KV cache [default: 1]."),
    block_size: Optional[int] = typer.Option(
        None, help="Tokens per KV page [default: the backend's]."),
    num_blocks: Optional[int] = typer.Option(
        None, help="KV-cache pages [default: sized from memory, see --kv-cache-memory]."),
    kv_cache_memory: Optional[str] = typer.Option(
        None, help="KV-cache size, e.g. 4GiB [default: what the GPU has left at 90% use "
                   "after the model; on a CPU up to 1 GiB, at least one whole sequence]."),
    max_num_seqs: Optional[int] = typer.Option(
        None, help="Most sequences in a step [default: the profile's, else 128; cut to the "
                   "run's sequences]."),
    max_num_batched_tokens: Optional[int] = typer.Option(
        None, help="Most tokens in a step; longer prompts prefill in chunks [default: the "
                   "profile's, else 8192]."),
    max_model_len: Optional[int] = typer.Option(
        None, help="Longest sequence, prompt and output [default: the model's context]."),
    enforce_eager: Optional[bool] = typer.Option(
        None, "--enforce-eager/--cuda-graphs", help="Turn CUDA graphs off [default: on, "
                                                    "where the backend has them]."),
    fused_kernels: Optional[bool] = typer.Option(
        None, "--fused-kernels/--no-fused-kernels",
        help="Norms, rotary and SwiGLU as fused Triton kernels on CUDA [default: on]."),
    prefix_caching: Optional[bool] = typer.Option(
        None, "--prefix-caching/--no-prefix-caching",
        help="Reuse the KV cache of prompt prefixes computed before [default: on]."),
    cascade_attention: Optional[bool] = typer.Option(
        None, "--cascade-attention/--no-cascade-attention",
        help="Decode steps attend the KV pages all their sequences share once for the batch "
             "[default: on, where the backend can: flash-attn FA4, flashinfer, triton]."),
    logprobs: Optional[int] = typer.Option(
        None, help="Log-probabilities per output token, with this many top alternatives "
                   "(0-20), where a line sets none [default: none]."),
    prompt_logprobs: Optional[int] = typer.Option(
        None, help="Log-probabilities per prompt token, with this many top alternatives "
                   "(0-20), where a line sets none [default: none]."),
    prompt_field: str = typer.Option("prompt", help="The field that holds a text prompt."),
    messages_field: str = typer.Option("messages", help="The field that holds chat messages."),
    strict_fields: bool = typer.Option(
        False, "--strict-fields", help="Unknown fields are errors [default: they are copied "
                                      "into the output line's \"metadata\"]."),
    served_model_name: Optional[str] = typer.Option(
        None, help="OpenAI batch files: the model name their lines' body \"model\" must "
                   "have, and the name reported."),
    ray: Optional[str] = typer.Option(
        None, "--ray", help="Run on Ray Data: 'local' (a Ray instance started here) or a "
                            "cluster address; needs pagedgen[ray]."),
    replicas: int = typer.Option(1, help="With --ray: engine replicas (actors), one GPU each."),
    data_parallel_size: int = typer.Option(
        1, "--data-parallel-size", "-dp", help="Engine replicas on this host, each on "
                                                "--tensor-parallel-size GPUs (worker processes)."),
    tensor_parallel_size: Optional[int] = typer.Option(
        None, "--tensor-parallel-size", "-tp", help="GPUs one model is sharded over (worker "
                                                     "processes joined by NCCL; gloo on CPU) "
                                                     "[default: 1]."),
    json_summary: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Generate completions for every line of PROMPTS and print a throughput summary."""
    from pagedgen.runtime.models.loader import load_tokenizer, resolve_model, weights_format

    engine_cfg, defaults, _ = engine_and_sampling(
        profile, model,
        dict(backend=backend, device=device, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
             load_format=load_format, seed=seed, block_size=block_size, num_blocks=num_blocks,
             kv_cache_memory=kv_cache_memory, max_num_seqs=max_num_seqs,
             max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
             enforce_eager=enforce_eager, fused_kernels=fused_kernels,
             prefix_caching=prefix_caching, cascade_attention=cascade_attention,
             tensor_parallel_size=tensor_parallel_size),
        dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
             ignore_eos=ignore_eos, n=n, logprobs=logprobs, prompt_logprobs=prompt_logprobs))
    ranks = _torchrun_ranks(engine_cfg, tensor_parallel_size, data_parallel_size, ray)
    lead = ranks is None or ranks.rank == 0  # the one process that writes and reports
    if ray is not None:
        import pagedgen.ray as on_ray
        on_ray.check(replicas)
        if data_parallel_size != 1:
            raise PagedgenError("--ray and -dp are two ways to run replicas: give one")
        if engine_cfg.tensor_parallel_size != 1:
            raise PagedgenError("--ray runs one GPU per replica: -tp is for local runs")
    workers = ranks is None and (data_parallel_size != 1 or engine_cfg.tensor_parallel_size != 1)
    dp_gpus = data_parallel.check(data_parallel_size, engine_cfg) if workers else None
    sources = input_files(prompts)
    shards = output is not None and output.endswith("/")
    out_path = _output_path(prompts, sources, output)
    if shards and (ray is None or resume or overwrite):
        raise PagedgenError("an output directory (--output ending in /) needs --ray and "
                            "cannot --resume or --overwrite; give a file to resume")
    opts = InputOptions(prompt_field, messages_field, strict_fields, served_model_name)

    # -dp workers start now: their imports and model loads overlap reading the input
    dp = data_parallel.DataParallel(engine_cfg, defaults, served_model_name, data_parallel_size,
                                    dp_gpus) if dp_gpus is not None else None
    writer = None
    rf = None
    try:
        t_read = time.perf_counter()
        with _startup_progress(json_summary or not lead) as progress:
            task = progress.add_task("reading", total=sum(s.size or 0 for s in sources) or None)
            rf = read_requests(sources, lambda n: progress.update(task, completed=n), opts)
            if lead:  # the output is claimed before anything slow: it may refuse this run
                writer = ShardWriter(out_path) if shards else OutputWriter(
                    OutputClaim(out_path, [s.identity for s in sources], rf.fingerprint,
                                result_settings(engine_cfg, defaults, opts), resume, overwrite),
                    rf.index_of, *_record_kind(rf.format))
            input_s = time.perf_counter() - t_read
            t_load = time.perf_counter()
            src = resolve_model(engine_cfg.model)
            weights_format(src, engine_cfg.load_format)  # no weight files: fail now
            tokenizer = load_tokenizer(src)
            load_s = time.perf_counter() - t_load
            limit, vocab = engine_cfg.context_limit(src.hf_config), src.hf_config.vocab_size
            t_tok = time.perf_counter()
            task = progress.add_task("tokenizing", total=len(rf))
            tokenize_requests(rf, tokenizer, lambda n: progress.update(task, completed=n))
            seats = engine_cfg.max_num_seqs
            check_requests(rf, lambda r: check_request(r.prompt_token_ids, r.sampling(defaults),
                                                       limit, vocab, seats))
            input_s += time.perf_counter() - t_tok

        if not lead:  # a torchrun rank: the lead's requests, computed here too, written there
            todo = _lead_todo(ranks, rf, None)
            rep = Replica(fit_seats(engine_cfg, todo, defaults), defaults, rf.format,
                          served_model_name, src, tokenizer)
            for _ in rep.stream(todo):
                pass
            return
        todo = [r for r in rf.requests if not writer.is_done(r.index)]
        if getattr(writer, "num_dropped", 0):
            console.print(f"[yellow]{escape(str(out_path))}:[/] {writer.num_dropped} damaged or "
                          "repeated line(s) are dropped; their requests run again",
                          highlight=False, soft_wrap=True)
        if ranks is not None:
            _lead_todo(ranks, rf, todo)
        extra = {"input_time_s": input_s, "skipped_resumed": len(rf) - len(todo),
                 "output": str(out_path) + ("/" if shards else "")}
        if ray is not None:
            import pagedgen.ray as on_ray
            summary = on_ray.generate(rf, todo, writer, engine_cfg, defaults, served_model_name,
                                      ray, replicas, extra, quiet=json_summary)
        elif dp is not None:
            summary = dp.generate(rf, todo, writer, extra, quiet=json_summary)
        else:
            summary = _generate_here(rf, todo, writer, fit_seats(engine_cfg, todo, defaults),
                                     defaults, src, tokenizer, load_s, served_model_name, extra,
                                     quiet=json_summary)
    except (KeyboardInterrupt, Terminated) as e:
        _interrupted(e, writer, rf)
    finally:
        if writer is not None:
            _close_quietly(writer, reorder=False)  # after an error; a finished run closed it
        if dp is not None:
            dp.stop()
    if json_summary:
        print(json.dumps(summary, indent=2))
    else:
        out_console().print(summary_table(summary))


def result_settings(engine_cfg, defaults, opts: InputOptions) -> dict:
    """The settings that choose a run's results, as its resume record keeps them: a resumed
    run must have the same (speed settings such as the backend or batch limits may differ)."""
    model = engine_cfg.model
    if Path(model).expanduser().exists():
        model = str(Path(model).expanduser().resolve())
    dtype = engine_cfg.torch_dtype(engine_cfg.torch_device())
    return {"model": model, "load_format": engine_cfg.load_format,
            "dtype": str(dtype).removeprefix("torch."),
            "kv_cache_dtype": str(engine_cfg.cache_dtype(dtype)).removeprefix("torch."),
            "seed": engine_cfg.seed, "max_model_len": engine_cfg.max_model_len,
            **dataclasses.asdict(defaults), "prompt_field": opts.prompt_field,
            "messages_field": opts.messages_field, "strict_fields": opts.strict_fields,
            "served_model_name": opts.served_model_name}


def _record_kind(fmt: str):
    """(is_complete, id field) of the output lines of input format ``fmt``."""
    if fmt == "openai":
        return openai_batch.is_complete, "custom_id"
    return records.is_complete, "id"


def _interrupted(e: BaseException, writer, rf) -> None:
    """Ctrl-C (exit code 130) or SIGTERM (143) at any phase: one line saying what is kept."""
    what = "interrupted" if isinstance(e, KeyboardInterrupt) else "terminated (SIGTERM)"
    code = 130 if isinstance(e, KeyboardInterrupt) else 143
    if writer is None or rf is None or writer.num_done == 0:
        console.print(f"[yellow]{what}:[/] no completions were written", highlight=False,
                      soft_wrap=True)
    else:
        if writer is not None:
            _close_quietly(writer, reorder=False)
        console.print(f"[yellow]{what}:[/] {writer.num_done} of {len(rf)} requests are in "
                      f"{escape(str(writer.path))}; run again with --resume to finish",
                      highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def fit_seats(engine_cfg, todo, defaults):
    """``engine_cfg`` with ``max_num_seqs`` cut to the sequences of ``todo`` (each request's
    ``n``) when they are fewer: a short run then captures CUDA graphs, and sizes buffers, only
    for batches it can form (the 16 sample prompts: 5 decode graphs, not 23 for 256 seats)."""
    seqs = 0
    for r in todo:  # stops at the seats: a long file costs nothing here
        seqs += r.sampling(defaults).n
        if seqs >= engine_cfg.max_num_seqs:
            return engine_cfg
    return dataclasses.replace(engine_cfg, max_num_seqs=seqs) if seqs else engine_cfg


def _torchrun_ranks(engine_cfg, tensor_parallel_size: int | None, data_parallel_size: int,
                    ray: str | None):
    """This process's tensor-parallel group when ``torchrun`` started it (every process runs
    this command as one rank; the engine is sharded over all of them), else None."""
    from pagedgen.runtime import parallel

    size = parallel.torchrun_size()
    if size == 1:
        return None
    if tensor_parallel_size not in (None, size) or data_parallel_size != 1 or ray is not None:
        raise PagedgenError(f"under torchrun the {size} processes are one model's "
                            f"tensor-parallel ranks: give -tp {size} or no -tp, no -dp or --ray")
    engine_cfg.tensor_parallel_size = size
    import torch

    return parallel.init_from_env(engine_cfg.device != "cpu" and torch.cuda.is_available())


def _lead_todo(ranks, rf, todo):
    """The requests still to run, as rank 0 found them in its output file (``todo`` there),
    on every rank."""
    import torch.distributed as dist

    box = [None if todo is None else [r.index for r in todo]]
    dist.broadcast_object_list(box, src=0, group=ranks.group)
    if todo is not None:
        return todo
    by_index = {r.index: r for r in rf.requests}
    return [by_index[i] for i in box[0]]


def _generate_here(rf, todo, writer, engine_cfg, defaults, src, tokenizer, load_s: float,
                   served_model_name, extra: dict, quiet: bool) -> dict:
    """Run the requests on an engine in this process; returns the summary."""
    t_load = time.perf_counter()
    with console.status(f"loading {engine_cfg.model} ..."):
        rep = Replica(engine_cfg, defaults, rf.format, served_model_name, src, tokenizer)
    engine = rep.engine
    if engine.max_model_len < engine_cfg.context_limit(src.hf_config):
        # the KV cache holds less than the model's context: the error names the memory
        check_requests(rf, lambda r: engine.check_request(r.prompt_token_ids,
                                                          r.sampling(defaults)), todo)
    load_s += time.perf_counter() - t_load

    def run(emit) -> None:
        for step in rep.stream(todo):
            emit([(i, json.dumps(line, ensure_ascii=False)) for i, line, _ in step],
                 engine.stats.output_tokens)

    start, wall = stream_output(rf, writer, len(todo), run, quiet)
    return summarize(engine, wall, start, {**extra, "load_time_s": load_s,
                                           **startup(engine.stats.first_step_wall_time,
                                                   engine.runner.startup_phases)})


def stream_output(rf, writer: OutputWriter | ShardWriter, total: int, run, quiet: bool
                  ) -> tuple[float, float]:
    """``run(emit)`` produces the lines, calling ``emit([(index, JSON text), ...],
    output_tokens_so_far)`` as they finish; each call is one write, with a progress bar (live
    tok/s). Ctrl-C or an error keeps what was written. Returns (start, wall seconds)."""
    start = time.perf_counter()
    progress = Progress(TextColumn("[bold]generating"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[tokens]:,} tokens out, "
                                   "{task.fields[rate]:,.0f} tok/s"), TimeElapsedColumn(),
                        TimeRemainingColumn(), console=console, transient=quiet,
                        disable=not console.is_terminal)  # a log gets the summary
    try:
        with progress:
            task = progress.add_task("gen", total=total, tokens=0, rate=0.0)

            def emit(lines: list[tuple[int, str]], tokens: int) -> None:
                writer.write_lines(lines)
                progress.update(task, advance=len(lines), tokens=tokens,
                                rate=tokens / max(time.perf_counter() - start, 1e-9))

            run(emit)
    except BaseException:
        _close_quietly(writer, reorder=False)  # Ctrl-C or an error: keep what was written
        raise
    wall = time.perf_counter() - start
    writer.close()
    return start, wall


def _output_path(spec: str, sources: list[InputSource], output: str | None) -> Path:
    """``--output``, or beside a single input file (or a directory) as
    ``NAME.completions.jsonl`` (``OutputClaim`` makes sure it is none of the inputs)."""
    if output is not None:
        return Path(output)
    if spec == "-" or (len(sources) == 1 and not Path(spec).is_file()
                       and not Path(spec).is_dir()):
        raise PagedgenError(f"{spec}: reading from a pipe or standard input: give --output")
    if len(sources) == 1 and Path(spec).is_file():
        path = sources[0].path
        return path.with_name(path.stem + ".completions.jsonl")
    if Path(spec).is_dir():
        return Path(spec.rstrip("/") + ".completions.jsonl")
    raise PagedgenError(f"{spec}: give --output for a glob of input files")


def _startup_progress(quiet: bool) -> Progress:
    """Bars for reading and tokenizing the input (gone when done)."""
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), TaskProgressColumn(),
                    TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=True,
                    disable=quiet or not console.is_terminal)


def _close_quietly(writer: OutputWriter | ShardWriter, reorder: bool = True) -> None:
    """Close after an error or Ctrl-C; the error in flight is the one to show."""
    try:
        writer.close(reorder)
    except PagedgenError:
        pass
