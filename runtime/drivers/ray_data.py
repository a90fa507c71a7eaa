"""Engine replicas on Ray Data (``pip install 'pagedgen[ray]'``): ``pagedgen generate --ray``.

The driver validates and tokenizes the input (as without Ray) and sends the requests, pickled,
to ``replicas`` actors, one engine each (``_RequestRunner``); their lines come back as batches
complete. When an actor dies mid-batch, Ray Data runs the batch again (its actor pools restart
actors and retry their tasks by default: ``max_restarts`` and ``max_task_retries`` -1); a
batch's lines reach the output once, after it completed. ``pagedgen.ray.Generator``
(``cli/ray``) is the same engine in a pipeline of the user's own.
"""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from pagedgen.errors import PagedgenError
from pagedgen.runtime.config import EngineConfig, SamplingParams
from pagedgen.runtime.drivers.data_parallel import replicas_summary
from pagedgen.runtime.drivers.images import RemoteImages
from pagedgen.runtime.drivers.replica import RecordFn, Replica, Request


def check(replicas: int) -> None:
    """Fail before anything loads when Ray is missing or ``--replicas`` is not positive."""
    if replicas < 1:
        raise PagedgenError("--replicas must be >= 1")
    try:
        import ray  # noqa: F401
        import ray.data  # noqa: F401
    except ImportError:
        raise PagedgenError("--ray needs Ray Data: pip install 'pagedgen[ray]'")


class _RequestRunner:
    """The CLI's actors: rows of pickled, validated, tokenized requests in; each request's
    index and output line (JSON text) out, with the batch's figures."""

    def __init__(self, engine_config: EngineConfig, defaults: SamplingParams,
                 record: RecordFn) -> None:
        self.replica = Replica(engine_config, defaults, record)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list]:
        reqs = [pickle.loads(b) for b in batch["request"]]
        lines, tokens, busy = self.replica.run(reqs)
        n = len(reqs)
        # figures per row, so that sums over rows are right however Ray splits the blocks
        return {"index": [r.index for r in reqs],
                "line": [json.dumps(line, ensure_ascii=False) for line in lines],
                "output_tokens": tokens, "busy_s": [busy / n] * n,
                "replica": [self.replica.name] * n, "load_s": [self.replica.load_s] * n}


def run_requests(todo: Iterable[Request], engine_config: EngineConfig,
                 defaults: SamplingParams, record: RecordFn, address: str, replicas: int,
                 batch_size: int) -> Iterator[dict[str, np.ndarray]]:
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
            engine_config=engine_config, defaults=defaults, record=record),
        # one batch per actor at a time: a batch waits for a free engine rather than queueing
        # behind a busy one while another replica idles
        compute=ray.data.ActorPoolStrategy(size=replicas, max_tasks_in_flight_per_actor=1),
        batch_size=batch_size,
        num_gpus=gpus, num_cpus=1, batch_format="numpy")
    yield from out.iter_batches(batch_size=None, batch_format="numpy")


class RayReplicas:
    """``pagedgen generate --ray``: the requests on ``replicas`` actors of a Ray cluster, their
    lines as batches complete, and the run's summary with a line per replica."""

    def __init__(self, engine_config: EngineConfig, defaults: SamplingParams, address: str,
                 replicas: int) -> None:
        self.engine_config, self.defaults = engine_config, defaults
        self.address, self.replicas = address, replicas
        self.images = RemoteImages(engine_config, defaults)
        self.per: dict[str, dict[str, Any]] = {}
        self.output_tokens = 0

    def run(self, todo: list[Request], record: RecordFn
            ) -> Iterator[tuple[list[tuple[int, str]], int]]:
        """Yields each completed batch's lines as (input index, JSON text), with the output
        tokens so far."""
        # enough to keep an engine's batch full, and at least two batches per replica (a
        # replica that starts late still gets work)
        num_seqs = self.engine_config.max_num_seqs or 256  # None: each actor's device says
        batch_size = max(1, min(2 * num_seqs,
                                -(-len(todo) // (2 * self.replicas))))
        try:
            for b in run_requests(todo, self.engine_config, self.defaults, record,
                                  self.address, self.replicas, batch_size):
                for name, tok, busy, load in zip(b["replica"], b["output_tokens"],
                                                 b["busy_s"], b["load_s"]):
                    r = self.per.setdefault(str(name), {"name": str(name), "requests": 0,
                                                        "output_tokens": 0, "busy_s": 0.0,
                                                        "load_s": 0.0})
                    r["requests"] += 1
                    r["output_tokens"] += int(tok)
                    r["busy_s"] += float(busy)
                    r["load_s"] = max(r["load_s"], float(load))
                self.output_tokens += int(b["output_tokens"].sum())
                yield list(zip(b["index"].tolist(), b["line"].tolist())), self.output_tokens
        except Exception as e:  # a failed task: Ray's error wraps the actor's
            if isinstance(e, PagedgenError) or not type(e).__module__.startswith("ray"):
                raise
            raise PagedgenError(f"Ray: {str(e).strip().splitlines()[-1]}")

    def prepare(self, requests: list[Request], progress=None) -> None:
        """The requests' images made ready here (``RemoteImages``): actors get them made."""
        self.images.prepare(requests, progress)

    def check(self, request: Request) -> None:
        """A request with images (here); each actor's engine checks the others."""
        self.images.check(request)

    def stop(self) -> None:
        """Ray's actors end with its pipeline."""

    def summary(self, requests: int, wall: float, start: float,
                extra: dict[str, Any]) -> dict[str, Any]:
        return replicas_summary(self.engine_config,
                                {"ray": self.address, "replicas": self.replicas},
                                [self.per[k] for k in sorted(self.per)], requests,
                                self.output_tokens, wall, extra)


def _have_gpu() -> bool:
    import ray

    return ray.cluster_resources().get("GPU", 0) > 0
