"""``pagedgen generate -dp N -tp M``: N engine replicas on this host, each a group of M
tensor-parallel worker processes on M GPUs (``launch.py``), started before the input is
read so that their start-up overlaps it. The requests are dealt so that replicas finish together
(by prompt + output tokens), requests that share a prompt prefix go to the same replica (its
prefix cache then serves them), and every replica's lines (from its rank 0) stream into the one
output file. A single replica (``-tp M`` alone) reports the usual engine summary.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pagedgen.errors import PagedgenError
from pagedgen.runtime.config import EngineConfig, SamplingParams
from pagedgen.runtime.drivers.images import RemoteImages
from pagedgen.runtime.drivers.launch import WorkerError, Workers
from pagedgen.runtime.drivers.replica import RecordFn, Replica, Request
from pagedgen.runtime.engine.stats import startup
from pagedgen.runtime.hardware import host_cores

PREFIX_TOKENS = 128  # prompts longer than twice this, with the same first tokens, travel together
PROGRESS_S = 0.5  # a worker reports its tokens this often while no request finishes


def check(replicas: int, engine_config: EngineConfig) -> list[list[int] | None]:
    """The GPUs of each replica (``tensor_parallel_size`` each; None on the CPU). Fails before
    anything starts on a size the model cannot be sharded to, too few GPUs or a backend that
    cannot run here."""
    import torch

    from pagedgen.attention.registry import backend_names, unavailable_reason
    from pagedgen.runtime.models import registry
    from pagedgen.runtime.models.loader import resolve_model

    tp = engine_config.tensor_parallel_size
    if replicas < 1:
        raise PagedgenError("--data-parallel-size must be >= 1")
    if tp < 1:
        raise PagedgenError("--tensor-parallel-size must be >= 1")
    if tp > 1:
        model = engine_config.model
        hf = resolve_model(model).hf_config
        why = registry.model_class(hf).tensor_parallel_error(hf, tp)
        if why:
            name = Path(model).stem if model.endswith((".yaml", ".yml")) else model
            raise PagedgenError(f"-tp {tp}: {name}: {why}")
    if engine_config.device not in ("auto", "cuda", "cpu"):
        raise PagedgenError("-dp/-tp place their ranks on GPUs 0, 1, ...: use --device auto, "
                            "cuda or cpu")
    have = torch.cuda.device_count() if engine_config.device != "cpu" else 0
    on_gpu = have > 0 or engine_config.device == "cuda"
    name = engine_config.backend
    if name in backend_names():  # an unusable backend fails here, not in every worker
        why = unavailable_reason(name, torch.device("cuda" if on_gpu else "cpu"))
        if why:
            raise PagedgenError(f"backend '{name}' cannot run here: {why}")
    if not on_gpu:
        cores = host_cores()
        if replicas * tp > cores:
            sizes = f"-dp {replicas}" + (f" -tp {tp}" if tp > 1 else "")
            raise PagedgenError(f"{sizes} starts {replicas * tp} worker processes on the CPU; "
                                f"this process has {cores} core(s): give at most {cores} "
                                "(each worker needs a core of its own)")
        return [None] * replicas
    need = replicas * tp
    if need > have:
        sizes = f"-dp {replicas}" + (f" -tp {tp}" if tp > 1 else "")
        raise PagedgenError(f"{sizes} needs {need} GPUs; {have} are visible")
    return [list(range(i * tp, (i + 1) * tp)) for i in range(replicas)]


def deal(requests: list[Request], n: int, defaults: SamplingParams) -> list[list[Request]]:
    """Split ``requests`` into ``n`` parts of about equal cost (prompt + output tokens), each in
    input order. Requests that share their first ``PREFIX_TOKENS`` tokens stay together, unless
    their group alone costs more than a part (then it is cut into part-sized pieces, each
    replica computing the shared prefix once)."""
    def cost(r: Request) -> int:
        p = r.sampling(defaults)
        return len(r.prompt_token_ids) + p.max_tokens * p.n

    groups: dict[Any, list[Request]] = {}
    for r in requests:
        ids = r.prompt_token_ids
        key = bytes(ids[:PREFIX_TOKENS]) if len(ids) > 2 * PREFIX_TOKENS else r.index
        groups.setdefault(key, []).append(r)
    share = sum(cost(r) for r in requests) / n
    pieces: list[tuple[int, list[Request]]] = []
    for g in groups.values():
        total = sum(cost(r) for r in g)
        k = max(1, min(len(g), round(total / share)))
        step = -(-len(g) // k)
        for i in range(0, len(g), step):
            piece = g[i:i + step]
            pieces.append((sum(cost(r) for r in piece), piece))
    load = [0] * n
    parts: list[list[Request]] = [[] for _ in range(n)]
    for c, piece in sorted(pieces, key=lambda p: -p[0]):  # largest first, to the least loaded
        i = load.index(min(load))
        load[i] += c
        parts[i] += piece
    return [sorted(p, key=lambda r: r.index) for p in parts]


def run_on_ranks(target, args: tuple, engine_config: EngineConfig) -> Any:
    """``target(*args, inbox)`` on every rank of one tensor-parallel group (GPUs 0..N-1, or
    gloo on the CPU; ``check`` first); the last message rank 0 yields."""
    gpus = check(1, engine_config)
    last = None
    try:
        with Workers(target, [args], gpus, engine_config.tensor_parallel_size) as w:
            for message in w.messages():
                last = message[1]
    except WorkerError as e:
        raise PagedgenError(f"tensor parallel: {e}")
    return last


def replica_main(engine_config: EngineConfig, defaults: SamplingParams, inbox
                 ) -> Iterator[tuple]:
    """A worker (every rank of a tensor-parallel group runs it; rank 0's messages are read):
    loads its engine at once, then runs the (line maker, requests) it is sent; its lines as
    steps finish them, then its busy seconds and engine summary."""
    rep = Replica(engine_config, defaults)
    yield ("started", rep.name, rep.load_s)
    rep.record, requests = inbox.get()
    t0 = last = time.perf_counter()
    for step in rep.stream(requests):
        if step:
            yield ("lines", [(i, json.dumps(line, ensure_ascii=False), n) for i, line, n in step])
        elif time.perf_counter() - last > PROGRESS_S:  # tokens while nothing finishes
            last = time.perf_counter()
            yield ("tokens", rep.engine.stats.tokens_generated)
    busy = time.perf_counter() - t0
    summary = rep.engine.summary(busy, t0, {"load_time_s": rep.load_s})
    yield ("finished", busy, summary, rep.engine.stats.first_step_wall_time)


class DataParallel:
    """``replicas`` workers, started now so that their imports and engine loads overlap the
    driver reading and tokenizing the input; ``stop`` ends them (always call it)."""

    def __init__(self, engine_config: EngineConfig, defaults: SamplingParams, replicas: int,
                 gpus: list[list[int] | None]) -> None:
        self.engine_config, self.defaults, self.replicas = engine_config, defaults, replicas
        self.images = RemoteImages(engine_config, defaults)
        self.workers = Workers(replica_main, [(engine_config, defaults)] * replicas, gpus,
                               engine_config.tensor_parallel_size)
        self.per = [{"name": "", "requests": 0, "output_tokens": 0, "busy_s": 0.0, "load_s": 0.0,
                     "summary": {}, "first_step": None} for _ in range(replicas)]
        self.output_tokens = 0

    def stop(self) -> None:
        self.workers.stop()

    def run(self, todo: list[Request], record: RecordFn
            ) -> Iterator[tuple[list[tuple[int, str]], int]]:
        """Deal ``todo`` to the workers (their lines made by ``record``); yields each batch of
        finished lines as (input index, JSON text) with the output tokens so far."""
        for rank, part in enumerate(deal(todo, self.replicas, self.defaults)):
            self.workers.send(rank, (record, part))
        try:
            for rank, msg in self.workers.messages():
                r = self.per[rank]
                if msg[0] == "started":
                    r["name"], r["load_s"] = msg[1], msg[2]
                elif msg[0] == "finished":
                    r["busy_s"], r["summary"], r["first_step"] = msg[1:]
                elif msg[0] == "tokens":  # progress: tokens made, finished or not
                    r["generated"] = msg[1]
                    yield [], self._progress()
                else:
                    r["requests"] += len(msg[1])
                    n = sum(t for _, _, t in msg[1])
                    r["output_tokens"] += n
                    self.output_tokens += n
                    yield [(i, text) for i, text, _ in msg[1]], self._progress()
        except WorkerError as e:
            what = "data parallel" if self.replicas > 1 else "tensor parallel"
            raise PagedgenError(f"{what}: {e}")

    def _progress(self) -> int:
        """Output tokens so far: each replica's generated count, or its finished lines'."""
        return sum(max(r.get("generated", 0), r["output_tokens"]) for r in self.per)

    def prepare(self, requests: list[Request], progress=None) -> None:
        """The requests' images made ready here (``RemoteImages``), while the workers load."""
        self.images.prepare(requests, progress)

    def check(self, request: Request) -> None:
        """A request with images (here); each worker's engine checks the others."""
        self.images.check(request)

    def summary(self, requests: int, wall: float, start: float,
                extra: dict[str, Any]) -> dict[str, Any]:
        """The run's summary: a single replica's engine summary (``-tp`` alone), else the
        replicas' figures with a line each."""
        tp = self.engine_config.tensor_parallel_size
        if self.replicas == 1 and self.per[0]["summary"]:
            return one_replica_summary(self.per[0], extra)
        how = {"data_parallel_size": self.replicas,
               **({"tensor_parallel_size": tp} if tp > 1 else {})}
        return replicas_summary(self.engine_config, how, self.per, requests,
                                self.output_tokens, wall, extra)


def one_replica_summary(rep: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """A single worker's engine summary (its wall time runs from its first request, as a
    local run's does after its load), with this command's start-up."""
    return {**rep["summary"], **extra, **startup(rep["first_step"])}


def replicas_summary(engine_config: EngineConfig, how: dict[str, Any],
                     per: list[dict[str, Any]], requests: int, output_tokens: int, wall: float,
                     extra: dict[str, Any]) -> dict[str, Any]:
    """The summary of a run on replicas (``-dp`` or Ray; ``how`` says which), with a line per
    replica: requests, output tokens, tok/s while busy, start-up."""
    busy = max((r["busy_s"] for r in per), default=0.0)
    return {"model": engine_config.model, "backend": engine_config.backend, **how,
            "requests": requests, "output_tokens": output_tokens, "wall_time_s": wall,
            "output_tokens_per_s": output_tokens / wall if wall else 0.0,
            # the busiest replica's time from receiving its requests: start-ups apart
            "output_tokens_per_s_while_busy": output_tokens / busy if busy else 0.0, **extra,
            **_replica_lines(per)}


def _replica_lines(per: list[dict[str, Any]]) -> dict[str, str]:
    return {f"replica_{i}": (
        f"{r['name']}: {r['requests']:,} requests, {r['output_tokens']:,} tokens out, "
        f"{r['output_tokens'] / max(r['busy_s'], 1e-9):,.0f} tok/s while busy, "
        f"start-up {r['load_s']:.1f} s") for i, r in enumerate(per)}
