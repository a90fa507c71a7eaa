"""pagedgen on Ray Data (``pip install 'pagedgen[ray]'``): one engine per actor, batches of
requests in, output rows out.

In a pipeline of your own::

    import ray, pagedgen.ray
    ds = ray.data.read_json("prompts/")            # rows with the fields of a JSONL line
    out = ds.map_batches(pagedgen.ray.Generator, fn_constructor_kwargs={"model": "/ckpt"},
                         compute=ray.data.ActorPoolStrategy(size=4), num_gpus=1,
                         batch_size=512)

From the command line, ``pagedgen generate PROMPTS --ray local --replicas N`` validates and
tokenizes the input on the driver (as without Ray), sends the requests to N replicas and
streams their lines into the output. When an actor dies mid-batch, Ray Data runs the batch again
(its actor pools restart actors and retry their tasks by default: ``max_restarts`` and
``max_task_retries`` -1); a batch's lines reach the output once, after it completed.
"""

from __future__ import annotations

import json
import os
import pickle
import zlib
from typing import Any, Iterable, Iterator

import numpy as np

from pagedgen.cli.data_parallel import replicas_summary
from pagedgen.cli.prompts import RequestFile, check_requests, parse_line, tokenize_requests
from pagedgen.cli.replica import Replica
from pagedgen.cli.request import InputOptions, Request
from pagedgen.errors import PagedgenError
from pagedgen.runtime.config import EngineConfig, SamplingParams
from pagedgen.runtime.engine import check_request


class Generator:
    """A callable class for ``Dataset.map_batches``: one pagedgen engine per actor.

    Takes batches of request rows (the fields of a pagedgen JSONL line: ``prompt`` |
    ``prompt_token_ids`` | ``messages``, optional ``id`` and sampling fields, fields of your
    own) and returns the output rows (the fields of an output line, ``metadata`` included; a
    field a row lacks is null). A row without ``id`` gets its position in the batch; a row
    without ``seed`` samples with one derived from its ``id`` (else its fields), so rows at the
    same position of different batches draw different numbers, the same on every rerun.
    Constructor arguments are ``pagedgen generate``'s: ``model``, ``profile``, ``engine``
    (EngineConfig fields), ``sampling`` (default SamplingParams fields), ``strict_fields``,
    ``prompt_field``, ``messages_field``.
    """

    def __init__(self, model: str | None = None, profile: str | None = None,
                 engine: dict[str, Any] | None = None, sampling: dict[str, Any] | None = None,
                 strict_fields: bool = False, prompt_field: str = "prompt",
                 messages_field: str = "messages") -> None:
        from pagedgen.cli.common import engine_and_sampling

        cfg, defaults, _ = engine_and_sampling(profile, model, engine or {}, sampling or {})
        defaults.validate()
        self.options = InputOptions(prompt_field, messages_field, strict_fields)
        self.replica = Replica(cfg, defaults, "pagedgen")

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list]:
        rows = _rows(batch)
        reqs = [parse_line(row, i, i + 1, f"row {i}", self.options)
                for i, row in enumerate(rows)]
        for row, r in zip(rows, reqs):  # positions repeat from batch to batch; ids do not
            if not (r.overrides and "seed" in r.overrides):
                key = json.dumps(row.get("id", row), sort_keys=True, default=str)
                r.overrides = {**(r.overrides or {}), "seed": zlib.crc32(key.encode()) >> 1}
        rf = RequestFile(["batch row"], reqs, {r.id: r.index for r in reqs})
        eng = self.replica.engine
        tokenize_requests(rf, eng.tokenizer)
        check_requests(rf, lambda r: check_request(
            r.prompt_token_ids, r.sampling(self.replica.defaults), eng.max_model_len,
            eng.src.hf_config.vocab_size, eng.config.max_num_seqs))
        lines, _, _ = self.replica.run(reqs)
        keys = list(dict.fromkeys(k for line in lines for k in line))
        return {k: [line.get(k) for line in lines] for k in keys}


class _RequestRunner:
    """The CLI's actors: rows of pickled, validated, tokenized requests in; each request's
    index and output line (JSON text) out, with the batch's figures."""

    def __init__(self, engine_config: EngineConfig, defaults: SamplingParams, fmt: str,
                 served_model_name: str | None) -> None:
        self.replica = Replica(engine_config, defaults, fmt, served_model_name)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list]:
        reqs = [pickle.loads(b) for b in batch["request"]]
        lines, tokens, busy = self.replica.run(reqs)
        n = len(reqs)
        # figures per row, so that sums over rows are right however Ray splits the blocks
        return {"index": [r.index for r in reqs],
                "line": [json.dumps(line, ensure_ascii=False) for line in lines],
                "output_tokens": tokens, "busy_s": [busy / n] * n,
                "replica": [self.replica.name] * n, "load_s": [self.replica.load_s] * n}


def run_requests(rf: RequestFile, todo: Iterable[Request], engine_config: EngineConfig,
                 defaults: SamplingParams, served_model_name: str | None, address: str,
                 replicas: int, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
    """Run ``todo`` on ``replicas`` actors of a Ray cluster (``address`` "local" starts one
    here); yields result batches (columns ``index``, ``line`` and the batch's figures) as
    they complete."""
    import ray

    if not ray.is_initialized():
        if address == "local":
            # a CPU left for Ray Data's own tasks beside the actors (else 2 CPUs deadlock)
            ray.init(num_cpus=max(os.cpu_count() or 1, replicas + 1), include_dashboard=False,
                     log_to_driver=False, configure_logging=False)
        else:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
    gpus = 1 if engine_config.device != "cpu" and _have_gpu() else 0
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    rows = [{"request": pickle.dumps(r)} for r in todo]
    if not rows:
        return
    ds = ray.data.from_items(rows, override_num_blocks=max(1, -(-len(rows) // batch_size)))
    out = ds.map_batches(
        _RequestRunner, fn_constructor_kwargs=dict(
            engine_config=engine_config, defaults=defaults, fmt=rf.format,
            served_model_name=served_model_name),
        # one batch per actor at a time: a batch waits for a free engine rather than queueing
        # behind a busy one while another replica idles
        compute=ray.data.ActorPoolStrategy(size=replicas, max_tasks_in_flight_per_actor=1),
        batch_size=batch_size,
        num_gpus=gpus, num_cpus=1, batch_format="numpy")
    yield from out.iter_batches(batch_size=None, batch_format="numpy")


def generate(rf: RequestFile, todo: list[Request], writer, engine_config: EngineConfig,
             defaults: SamplingParams, served_model_name: str | None, address: str,
             replicas: int, extra: dict[str, Any], quiet: bool) -> dict[str, Any]:
    """``pagedgen generate --ray``: the requests on ``replicas`` actors, their lines streamed
    into ``writer`` as batches complete; returns the summary, with a line per replica."""
    from pagedgen.cli.generate import stream_output

    # enough to keep an engine's batch full, and at least two batches per replica (a replica
    # that starts late still gets work)
    batch_size = max(1, min(2 * engine_config.max_num_seqs, -(-len(todo) // (2 * replicas))))
    per: dict[str, dict[str, Any]] = {}
    total = 0

    def run(emit) -> None:
        nonlocal total
        try:
            for b in run_requests(rf, todo, engine_config, defaults, served_model_name,
                                  address, replicas, batch_size):
                for name, tok, busy, load in zip(b["replica"], b["output_tokens"],
                                                 b["busy_s"], b["load_s"]):
                    r = per.setdefault(str(name), {"name": str(name), "requests": 0,
                                                   "output_tokens": 0, "busy_s": 0.0,
                                                   "load_s": 0.0})
                    r["requests"] += 1
                    r["output_tokens"] += int(tok)
                    r["busy_s"] += float(busy)
                    r["load_s"] = max(r["load_s"], float(load))
                total += int(b["output_tokens"].sum())
                emit(list(zip(b["index"].tolist(), b["line"].tolist())), total)
        except Exception as e:  # a failed task: Ray's error wraps the actor's
            if isinstance(e, PagedgenError) or not type(e).__module__.startswith("ray"):
                raise
            raise PagedgenError(f"Ray: {str(e).strip().splitlines()[-1]}")

    start, wall = stream_output(rf, writer, len(todo), run, quiet)
    return replicas_summary(engine_config, {"ray": address, "replicas": replicas},
                            [per[k] for k in sorted(per)], len(todo), total, wall, extra)


def _have_gpu() -> bool:
    import ray

    return ray.cluster_resources().get("GPU", 0) > 0


def _rows(batch: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    """Ray Data's columns back to JSON-like rows: numpy values to Python ones; a missing field
    (null, or NaN in a number column) left out."""
    names = list(batch)
    n = len(batch[names[0]]) if names else 0
    rows = []
    for i in range(n):
        row = {}
        for k in names:
            v = _py(batch[k][i])
            if v is not None and not (isinstance(v, float) and v != v):
                row[k] = v
        rows.append(row)
    return rows


def _py(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return [_py(x) for x in v.tolist()] if v.dtype == object else v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, dict):
        return {k: _py(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_py(x) for x in v]
    return v


def check(replicas: int) -> None:
    """Fail before anything loads when Ray is missing or ``--replicas`` is not positive."""
    if replicas < 1:
        raise PagedgenError("--replicas must be >= 1")
    try:
        import ray  # noqa: F401
        import ray.data  # noqa: F401
    except ImportError:
        raise PagedgenError("--ray needs Ray Data: pip install 'pagedgen[ray]'")


