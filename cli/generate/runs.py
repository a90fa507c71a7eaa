"""`pagedgen generate`, the run: every error a user can cause shows before the slow parts.

Options (checked by the command) → read and validate the input → claim the output (it may
refuse the run) → tokenize every prompt (the model's tokenizer, before its weights load) →
load the engine → stream the requests into it lazily, appending each finished line as it comes
→ put the file in input order → summary. The requests run on an engine in this process, on
``-dp``/``-tp`` worker processes (``runtime/drivers/data_parallel.py``), on Ray Data
replicas (``--ray``: ``runtime/drivers/ray_data.py``), or as one rank of ``torchrun``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.markup import escape

from pagedgen.cli.common import console
from pagedgen.cli.formats.lines import error_line, line_check, line_maker
from pagedgen.cli.formats.output import OutputWriter, ShardWriter, StreamWriter
from pagedgen.cli.formats.output_claim import OutputClaim
from pagedgen.cli.formats.output_target import OutputTarget, resolve_output
from pagedgen.cli.formats.reader import InputSource, input_files, read_requests
from pagedgen.cli.generate.stream import close_quietly, interrupted, startup_progress, stream_output
from pagedgen.errors import PagedgenError, Terminated
from pagedgen.runtime import kernel_plans
from pagedgen.runtime.collectives import parallel
from pagedgen.runtime.config import EngineConfig, SamplingParams, StructuredOutput
from pagedgen.runtime.drivers.driver import (
    Driver,
    LocalDriver,
    check_mode,
    checked_request,
    start_driver,
)
from pagedgen.runtime.inputs.parse import (
    RequestFile,
    check_requests,
    check_text_settings,
    tokenize_requests,
)
from pagedgen.runtime.inputs.request import InputOptions, Request
from pagedgen.runtime.models.loader import (
    ModelSource,
    load_tokenizer,
    model_quantization,
    resolve_model,
    weights_fingerprint,
    weights_format,
)
from pagedgen.runtime.models.tokenizer import has_text
from pagedgen.runtime.sampling.structured import Grammars


@dataclass
class Job:
    """What the command was asked (options already checked)."""

    prompts: str
    output: str | None
    resume: bool
    overwrite: bool
    engine_cfg: EngineConfig
    defaults: SamplingParams
    opts: InputOptions
    tensor_parallel_size: int | None  # as given (None: not given)
    data_parallel_size: int
    ray: str | None
    replicas: int
    quiet: bool  # --json: no transient bars
    given_sampling: frozenset[str] = frozenset()  # sampling options given on the command line


def run(job: Job) -> dict[str, Any] | None:
    """Run ``job``; its summary (None on a torchrun rank other than 0). The ``max_num_seqs`` a
    config leaves to the device are this host's (Ray's actors: each its own)."""
    cfg = job.engine_cfg if job.ray is not None else job.engine_cfg.with_step_limits()
    ranks = _torchrun_ranks(cfg, job.tensor_parallel_size, job.data_parallel_size, job.ray)
    lead = ranks is None or ranks.rank == 0  # the one process that writes and reports
    check_mode(job.data_parallel_size, cfg.tensor_parallel_size, job.ray, job.replicas)
    sources = input_files(job.prompts, lambda text: console.print(
        f"note: {text}", highlight=False, markup=False, soft_wrap=True))
    shards = job.output is not None and job.output.endswith("/")
    out_path = _output_path(job.prompts, sources, job.output)
    if shards and (job.ray is None or job.resume or job.overwrite):
        raise PagedgenError("an output directory (--output ending in /) needs --ray and "
                            "cannot --resume or --overwrite; give a file to resume")
    target = None if shards else resolve_output(out_path)
    if target is not None and target.is_stream:
        if job.resume:
            raise PagedgenError(f"{target.given}: is {target.stream}; a stream cannot be "
                                "resumed: give a file to --resume")
        if job.overwrite:
            console.print(f"[yellow]note:[/] {escape(target.given)} is {target.stream}: "
                          "--overwrite does nothing there", highlight=False, soft_wrap=True)

    # -dp / -tp workers start now: their imports and model loads overlap reading the input
    driver: Driver | None = start_driver(cfg, job.defaults, job.data_parallel_size, job.ray,
                                         job.replicas, ranks is not None)
    writer: OutputWriter | ShardWriter | StreamWriter | None = None
    rf: RequestFile | None = None
    try:
        t_read = time.perf_counter()
        _say_what_reading_waits_for(sources)
        with startup_progress(job.quiet or not lead) as progress:
            task = progress.add_task("reading", total=sum(s.size or 0 for s in sources) or None)
            rf = read_requests(sources, lambda n: progress.update(task, completed=n), job.opts)
            input_s = time.perf_counter() - t_read
            t_load = time.perf_counter()
            src = resolve_model(cfg.model)  # its files' fingerprint joins the resume record
            if lead:  # the output is claimed before anything slow: it may refuse this run
                writer = _writer(target, out_path, sources, rf, cfg, job, src)
            weights_format(src, cfg.load_format)  # no weight files: fail now
            model_quantization(src, cfg.quantization)  # nor an unknown quantization
            tokenizer = load_tokenizer(src)
            check_text_settings(rf, tokenizer, job.defaults)
            load_s = time.perf_counter() - t_load
            limit, vocab = cfg.context_limit(src.hf_config), src.hf_config.vocab_size
            _check_context(cfg, src)
            if rf.format != "openai" and job.opts.served_model_name is not None:
                console.print("[yellow]note:[/] --served-model-name applies to OpenAI batch "
                              "files; this input is in pagedgen's format", highlight=False)
            t_tok = time.perf_counter()
            # grammars compile while prompts tokenize, in daemon threads: Ctrl-C or SIGTERM
            # ends the run at once, however long a constraint takes to compile
            bar = progress.add_task("compiling constraints", total=None, visible=False)
            compiling = _Background(compile_constraints, rf, tokenizer, vocab,
                                    job.defaults.structured,
                                    lambda n, total: progress.update(
                                        bar, completed=n, total=total, visible=True))
            task = progress.add_task("tokenizing", total=len(rf))
            tokenize_requests(rf, tokenizer, lambda n: progress.update(task, completed=n))
            grammars = compiling.wait()
            check_requests(rf, lambda r: checked_request(r, job.defaults, limit, vocab,
                                                         cfg.max_num_seqs,
                                                         cfg.named("max_num_seqs")))
            input_s += time.perf_counter() - t_tok

        record = line_maker(rf.format, job.opts.served_model_name or src.name)
        if lead:
            todo = [r for r in rf.requests if not writer.is_done(r.index)]
            if writer.num_dropped:
                console.print(f"[yellow]{escape(str(out_path))}:[/] {writer.num_dropped} "
                              "damaged or repeated line(s) are dropped; their requests run "
                              "again", highlight=False, soft_wrap=True)
        todo = _lead_todo(ranks, rf, todo if lead else None) if ranks is not None else todo
        todo, bad = set_aside(todo, rf, writer if lead else None)  # lines that cannot run
        if driver is None:  # an engine here (a torchrun rank's shard of one)
            driver = LocalDriver(fit_seats(cfg, todo, job.defaults), job.defaults, src,
                                 tokenizer, grammars, load_s)
            loading = f"loading {escape(src.name)}"
            with console.status(f"{loading} ...") as status, kernel_plans.telling(
                    lambda what: status.update(f"{loading}: {escape(what)} ...")):
                driver.load()
        images = sum(len(r.images) for r in todo if r.images)
        with startup_progress(job.quiet or not lead or not images) as progress:
            task = progress.add_task("reading images", total=images)
            driver.prepare(todo, lambda n: progress.update(task, advance=n))
        check_requests(rf, driver.check, todo)  # against its KV cache, once it is known
        todo, late = set_aside(todo, rf, writer if lead else None)
        bad += late
        if not lead:  # a torchrun rank: the lead's requests, computed here too, written there
            for _ in driver.run(todo, record):
                pass
            return None
        chats = getattr(tokenizer, "chat_format", None) and any(
            r.messages is not None for r in rf.requests)
        if bad:
            console.print(f"[yellow]{len(bad)} line(s) cannot run:[/] each has an error record "
                          f"in its place (the first: {escape(bad[0].error)})", highlight=False,
                          soft_wrap=True)
        extra = {"input_time_s": input_s, "lines_with_errors": len(bad),
                 "skipped_resumed": len(rf) - len(todo) - len(bad),
                 "output": out_path, **({"chat_format": tokenizer.chat_format} if chats else {}),
                 **({"output_stream": f"{target.stream}, lines in completion order"}
                    if target is not None and target.is_stream else {}),
                 **({} if has_text(tokenizer) else
                    {"output_text": "empty: no tokenizer files"}),
                 **({"weights": "dummy (random: no trained model)"}
                    if weights_format(src, cfg.load_format) == "dummy" else {}),
                 **({"sampling_defaults": said} if (said := changed_sampling(
                     job.defaults, job.given_sampling)) else {})}
        start, wall = stream_output(writer, len(todo), driver.run(todo, record), job.quiet,
                                    {r.index: len(r.images) for r in todo if r.images})
        return driver.summary(len(todo), wall, start, extra)
    except (KeyboardInterrupt, Terminated) as e:
        interrupted(e, writer, len(rf) if rf is not None else 0)
    finally:
        if writer is not None:
            close_quietly(writer)  # after an error; a finished run closed it already
        if driver is not None:
            driver.stop()
        if ranks is not None:  # leave the torchrun group before exit: a group torn down by
            parallel.shutdown()  # the interpreter's exit aborted ranks ("terminate called")


def changed_sampling(defaults: SamplingParams, given: frozenset[str] = frozenset()) -> str:
    """The sampling a preset or profile set (not the ``given`` options) where it differs from
    pagedgen's own: what a line that sets none ran with, said in the summary."""
    base = SamplingParams()
    return ", ".join(f"{f.name} {getattr(defaults, f.name)}"
                     for f in dataclasses.fields(SamplingParams)
                     if f.name not in ("structured", "reasoning", *given)
                     and getattr(defaults, f.name) != getattr(base, f.name))


def set_aside(todo: list[Request], rf: RequestFile, writer
              ) -> tuple[list[Request], list[Request]]:
    """``todo`` split into the requests that run and those a stage failed
    (``--on-bad-line error``), whose error records ``writer`` (None: a rank that writes
    nothing) takes now, in their places."""
    failed = [r for r in todo if r.error is not None]
    if failed and writer is not None:
        writer.write_lines([(r.index, json.dumps(error_line(rf.format, r), ensure_ascii=False))
                            for r in failed])
    return rf.runnable(todo), failed


def _check_context(cfg: EngineConfig, src) -> None:
    """``max_model_len`` within the model's context (as vLLM checks it)."""
    own = getattr(src.hf_config, "max_position_embeddings", None)
    if cfg.max_model_len is not None and own and cfg.max_model_len > own:
        raise PagedgenError(f"{cfg.named('max_model_len')} {cfg.max_model_len:,} is more than "
                            f"{src.name}'s context ({own:,} tokens, max_position_embeddings)")


def _say_what_reading_waits_for(sources: list[InputSource]) -> None:
    """A FIFO's reading waits for its writer, and a terminal's for the user's lines: say so
    (else the run looks hung)."""
    for s in sources:
        if s.path is not None and s.path.is_fifo():
            console.print(f"{escape(s.name)}: waiting for a writer of the FIFO",
                          highlight=False, soft_wrap=True)
        elif s.path is None and sys.stdin.isatty():
            console.print("reading prompts from the terminal: one JSON line each, then Ctrl-D",
                          highlight=False, soft_wrap=True)


def _writer(target: OutputTarget | None, out_path: str, sources: list[InputSource],
            rf: RequestFile, cfg: EngineConfig, job: Job, src: ModelSource):
    """The output's writer, once the input is read: shards, a stream (opened now: a FIFO
    waits for its reader here, before the model loads) or a claimed file."""
    if target is None:
        return ShardWriter(Path(out_path.rstrip("/")))
    if target.is_stream:
        writer = StreamWriter(target)
        if target.stream == "a FIFO":
            console.print(f"{escape(target.given)}: waiting for a reader of the FIFO",
                          highlight=False, soft_wrap=True)
        writer.open()
        return writer
    return OutputWriter(OutputClaim(target, [s.identity for s in sources], rf.fingerprint,
                                    result_settings(cfg, job.defaults, job.opts, src),
                                    job.resume, job.overwrite),
                        rf.index_of, *line_check(rf.format))


class _Background(threading.Thread):
    """``fn(*args)`` in a daemon thread; ``wait`` returns its result (or raises its error),
    waking every tenth of a second so that a signal reaches the main thread at once."""

    def __init__(self, fn: Callable, *args) -> None:
        super().__init__(daemon=True, name=getattr(fn, "__name__", "background"))
        self.fn, self.args = fn, args
        self.result: Any = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.result = self.fn(*self.args)
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
            self.error = e

    def wait(self) -> Any:
        while self.is_alive():
            self.join(0.1)
        if self.error is not None:
            raise self.error
        return self.result


def compile_constraints(rf: RequestFile, tokenizer, vocab_size: int,
                        default: StructuredOutput | None = None,
                        progress: Callable[[int, int], None] | None = None
                        ) -> Grammars | None:
    """Every distinct structured-output constraint of ``rf`` (and the run's ``default``,
    ``--json-schema``) compiled for ``tokenizer`` (None: there is none); the first line whose
    constraint does not compile is a file:line error. ``progress(done, total)`` hears how
    many have compiled."""
    first: dict[StructuredOutput, Request] = {}
    for r in rf.runnable():
        c = (r.overrides or {}).get("structured")
        if c is not None and c not in first:
            first[c] = r
    if not first and default is None:
        return None
    total = len(first) + (default is not None and default not in first)
    if progress is not None:
        progress(0, total)
    grammars = Grammars(tokenizer, vocab_size)
    if default is not None:
        try:
            grammars.compile(default)
        except ValueError as e:
            raise PagedgenError(f"--json-schema: {e}")
    base = int(default is not None and default not in first)
    errors = grammars.compile_all(first, progress and (lambda n: progress(base + n, total)))
    if errors:  # stop: the first line's; error: every line of a constraint that failed
        for r in sorted((r for r in rf.runnable()
                         if (r.overrides or {}).get("structured") in errors),
                        key=lambda r: r.index):
            rf.fail(r, f"{rf.where(r)}: {errors[r.overrides['structured']]}")
    return grammars


def result_settings(engine_cfg: EngineConfig, defaults: SamplingParams, opts: InputOptions,
                    src: ModelSource) -> dict[str, Any]:
    """The settings that choose a run's results, as its resume record keeps them (``src``:
    the model, its files fingerprinted): a resumed run must have the same (speed settings
    such as the backend or batch limits may differ)."""
    model = engine_cfg.model
    if Path(model).expanduser().exists():
        model = str(Path(model).expanduser().resolve())
    dtype = engine_cfg.torch_dtype(engine_cfg.torch_device())
    sampling = dataclasses.asdict(defaults)
    sampling["request_seed"] = sampling.pop("seed")  # a profile's; --seed is the run's
    return {"model": model, "weights": weights_fingerprint(src, engine_cfg.load_format),
            "load_format": engine_cfg.load_format,
            "dtype": str(dtype).removeprefix("torch."),
            "kv_cache_dtype": str(engine_cfg.cache_dtype(dtype)).removeprefix("torch."),
            "quantization": engine_cfg.quantization,
            "seed": engine_cfg.seed, "max_model_len": engine_cfg.max_model_len,
            "reasoning_parser": engine_cfg.reasoning_parser,
            **sampling, "prompt_field": opts.prompt_field,
            "messages_field": opts.messages_field, "strict_fields": opts.strict_fields,
            "served_model_name": opts.served_model_name}


def fit_seats(engine_cfg, todo, defaults):
    """``engine_cfg`` with ``max_num_seqs`` cut to the sequences of ``todo`` (each request's
    ``n``) when they are fewer: a short run then captures CUDA graphs, and sizes buffers, only
    for batches it can form (the 16 sample prompts: 5 decode graphs, not 23 for 256)."""
    seqs = 0
    for r in todo:  # stops at max_num_seqs: a long file costs nothing here
        seqs += r.sampling(defaults).n
        if engine_cfg.max_num_seqs is None or seqs >= engine_cfg.max_num_seqs:
            return engine_cfg
    return dataclasses.replace(engine_cfg, max_num_seqs=seqs) if seqs else engine_cfg


def _torchrun_ranks(engine_cfg, tensor_parallel_size: int | None, data_parallel_size: int,
                    ray: str | None):
    """This process's tensor-parallel group when ``torchrun`` started it (every process runs
    this command as one rank; the engine is sharded over all of them), else None."""
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


def _output_path(spec: str, sources: list[InputSource], output: str | None) -> str:
    """``--output``, or beside a single input file (or a directory) as
    ``NAME.completions.jsonl`` (``OutputClaim`` makes sure it is none of the inputs)."""
    if output is not None:
        return output
    if spec == "-" or (len(sources) == 1 and not Path(spec).is_file()
                       and not Path(spec).is_dir()):
        raise PagedgenError(f"{spec}: reading from a pipe or standard input: give --output")
    if len(sources) == 1 and Path(spec).is_file():
        path = sources[0].path
        if sources[0].gzipped and path.suffix == ".gz":
            path = path.with_suffix("")
        return str(path.with_name(path.stem + ".completions.jsonl"))
    if Path(spec).is_dir():
        return spec.rstrip("/") + ".completions.jsonl"
    raise PagedgenError(f"{spec}: give --output for a glob of input files")
