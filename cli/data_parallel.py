"""``pagedgen generate -dp N``: N engine replicas on this host, one GPU each (worker processes,
``runtime/launch.py``), started before the input is read so that their start-up overlaps it.
The requests are dealt so that replicas finish together (by prompt + output tokens), requests
that share a prompt prefix go to the same replica (its prefix cache then serves them), and every
replica's lines stream into the one output file.
"""

from __future__ import annotations

import json
import time
from typing import Any, Iterator

from pagedgen.cli.replica import Replica
from pagedgen.cli.request import Request
from pagedgen.errors import PagedgenError
from pagedgen.runtime.config import EngineConfig, SamplingParams
from pagedgen.runtime.launch import WorkerError, Workers

PREFIX_TOKENS = 128  # prompts longer than twice this, with the same first tokens, travel together


def check(replicas: int, engine_config: EngineConfig) -> list[int | None]:
    """The GPU of each replica (None on the CPU); fails before anything loads."""
    if replicas < 1:
        raise PagedgenError("--data-parallel-size must be >= 1")
    if engine_config.device == "cpu":
        return [None] * replicas
    if engine_config.device not in ("auto", "cuda"):
        raise PagedgenError("-dp places replica i on GPU i: use --device auto or cuda")
    import torch

    have = torch.cuda.device_count()
    if have == 0 and engine_config.device == "auto":
        return [None] * replicas
    if replicas > have:
        raise PagedgenError(f"-dp {replicas} needs {replicas} GPUs; {have} are visible")
    return list(range(replicas))


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


def replica_main(engine_config: EngineConfig, defaults: SamplingParams,
                 served_model_name: str | None, inbox) -> Iterator[tuple]:
    """A worker: loads its engine at once, then runs the (format, requests) it is sent; its
    lines as steps finish them, then its busy seconds."""
    rep = Replica(engine_config, defaults, "pagedgen", served_model_name)
    yield ("started", rep.name, rep.load_s)
    rep.fmt, requests = inbox.get()
    t0 = time.perf_counter()
    for step in rep.stream(requests):
        if step:
            yield ("lines", [(i, json.dumps(line, ensure_ascii=False), n) for i, line, n in step])
    yield ("finished", time.perf_counter() - t0)


class DataParallel:
    """``replicas`` workers, started now so that their imports and engine loads overlap the
    driver reading and tokenizing the input; ``stop`` ends them (always call it)."""

    def __init__(self, engine_config: EngineConfig, defaults: SamplingParams,
                 served_model_name: str | None, replicas: int, gpus: list[int | None]) -> None:
        self.engine_config, self.defaults, self.replicas = engine_config, defaults, replicas
        self.workers = Workers(replica_main, [(engine_config, defaults, served_model_name)]
                               * replicas, gpus)

    def stop(self) -> None:
        self.workers.stop()

    def generate(self, rf, todo: list[Request], writer, extra: dict[str, Any], quiet: bool
                 ) -> dict[str, Any]:
        """Deal ``todo`` to the workers and stream their lines into ``writer``; returns the
        summary with a line per replica."""
        from pagedgen.cli.generate import stream_output

        for rank, part in enumerate(deal(todo, self.replicas, self.defaults)):
            self.workers.send(rank, (rf.format, part))
        per = [{"name": "", "requests": 0, "output_tokens": 0, "busy_s": 0.0, "load_s": 0.0}
               for _ in range(self.replicas)]
        total = 0

        def run(emit) -> None:
            nonlocal total
            try:
                for rank, msg in self.workers.messages():
                    r = per[rank]
                    if msg[0] == "started":
                        r["name"], r["load_s"] = msg[1], msg[2]
                    elif msg[0] == "finished":
                        r["busy_s"] = msg[1]
                    else:
                        r["requests"] += len(msg[1])
                        n = sum(t for _, _, t in msg[1])
                        r["output_tokens"] += n
                        total += n
                        emit([(i, text) for i, text, _ in msg[1]], total)
            except WorkerError as e:
                raise PagedgenError(f"data parallel: {e}")

        start, wall = stream_output(rf, writer, len(todo), run, quiet)
        return replicas_summary(self.engine_config, {"data_parallel_size": self.replicas},
                                per, len(todo), total, wall, extra)


def replicas_summary(engine_config: EngineConfig, how: dict[str, Any],
                     per: list[dict[str, Any]], requests: int, output_tokens: int, wall: float,
                     extra: dict[str, Any]) -> dict[str, Any]:
    """The summary of a run on replicas (``-dp`` or Ray; ``how`` says which), with a line per
    replica: requests, output tokens, tok/s while busy, start-up."""
    return {"model": engine_config.model, "backend": engine_config.backend, **how,
            "requests": requests, "output_tokens": output_tokens, "wall_time_s": wall,
            "output_tokens_per_s": output_tokens / wall if wall else 0.0, **extra,
            **_replica_lines(per)}


def _replica_lines(per: list[dict[str, Any]]) -> dict[str, str]:
    return {f"replica_{i}": (
        f"{r['name']}: {r['requests']:,} requests, {r['output_tokens']:,} tokens out, "
        f"{r['output_tokens'] / max(r['busy_s'], 1e-9):,.0f} tok/s while busy, "
        f"start-up {r['load_s']:.1f} s") for i, r in enumerate(per)}
