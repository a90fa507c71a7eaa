"""One interface for every way a job's requests run, so that the command has one path: an
engine in this process (``LocalDriver``; also each rank of a ``torchrun`` group), ``-dp`` / ``-tp``
worker processes on this host (``data_parallel.DataParallel``) or Ray Data actors
(``ray_data.RayReplicas``).

A driver takes the requests still to run and the format's line maker, yields each batch of
finished lines (input index, JSON text) with the output tokens made so far, and reports the
run's summary. ``start_driver`` makes the drivers whose workers start before the input is read
(their imports and model loads overlap it); the local one is made once the model's tokenizer
and the requests' constraints are ready.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from pagedgen.errors import PagedgenError
from pagedgen.runtime.config import EngineConfig, SamplingParams
from pagedgen.runtime.drivers import data_parallel, ray_data
from pagedgen.runtime.drivers.images import PreparedImages
from pagedgen.runtime.drivers.replica import RecordFn, Replica, Request
from pagedgen.runtime.engine.requests import check_request
from pagedgen.runtime.engine.stats import startup
from pagedgen.runtime.output.outputs import RequestOutput

# finished lines (input index, JSON text) and the output tokens made so far
Batch = tuple[list[tuple[int, str]], int]


class Driver(Protocol):
    def run(self, todo: list[Request], record: RecordFn) -> Iterator[Batch]: ...

    def prepare(self, requests: list[Request],
                progress: Callable[[int], None] | None = None) -> None:
        """Make the requests' images ready for ``check`` (read and sized, in threads);
        ``progress(n)`` as each request's ``n`` images are done."""

    def check(self, request: Request) -> None:
        """ValueError for a request its engines cannot take (a KV cache smaller than the
        model's context); checked before the run."""

    def summary(self, requests: int, wall: float, start: float,
                extra: dict[str, Any]) -> dict[str, Any]: ...

    def stop(self) -> None: ...


def check_mode(data_parallel_size: int, tensor_parallel_size: int, ray: str | None,
               replicas: int) -> None:
    """The run's kind from its options, or a one-line error for a combination that cannot be."""
    if ray is None and replicas != 1:
        raise PagedgenError("--replicas counts Ray replicas: give --ray too, or -dp N for "
                            "replicas on this host")
    if ray is not None:
        ray_data.check(replicas)
        if data_parallel_size != 1:
            raise PagedgenError("--ray and -dp are two ways to run replicas: give one")
        if tensor_parallel_size != 1:
            raise PagedgenError("--ray runs one GPU per replica: -tp is for local runs")


def start_driver(cfg: EngineConfig, defaults: SamplingParams, data_parallel_size: int,
                 ray: str | None, replicas: int, torchrun: bool) -> Driver | None:
    """The driver whose workers start now (``-dp`` / ``-tp`` worker processes, checked against
    the devices first; Ray's actors, at its run), or None for an engine in this process."""
    if ray is not None:
        return ray_data.RayReplicas(cfg, defaults, ray, replicas)
    if not torchrun and (data_parallel_size != 1 or cfg.tensor_parallel_size != 1):
        gpus = data_parallel.check(data_parallel_size, cfg)
        return data_parallel.DataParallel(cfg, defaults, data_parallel_size, gpus)
    return None


class LocalDriver:
    """An engine in this process (``load`` builds it); on a ``torchrun`` rank, that rank's
    shard of the group's model."""

    def __init__(self, cfg: EngineConfig, defaults: SamplingParams, src=None, tokenizer=None,
                 grammars=None, load_s: float = 0.0) -> None:
        self.cfg, self.defaults = cfg, defaults
        self.src, self.tokenizer, self.grammars = src, tokenizer, grammars
        self.load_s = load_s  # the caller's share of the load (config, tokenizer)
        self.replica: Replica | None = None
        self.images = PreparedImages()

    def load(self) -> None:
        t0 = time.perf_counter()
        self.replica = Replica(self.cfg, self.defaults, None, self.src, self.tokenizer,
                               self.grammars)
        self.load_s += time.perf_counter() - t0

    @property
    def engine(self):
        if self.replica is None:
            self.load()
        return self.replica.engine

    def prepare(self, requests: list[Request],
                progress: Callable[[int], None] | None = None) -> None:
        """Each request's images read and sized in threads (``drivers/images.py``)."""
        self.images.prepare(requests, self.engine.prompt_images, progress)

    def check(self, request: Request) -> None:
        eng = self.engine
        if request.images:  # the placeholders as the images ask, their pixels and positions
            self.images.take(request, eng.prompt_images)
            eng.check_request(request.prompt_token_ids, request.sampling(self.defaults))
        elif eng.max_model_len < self.cfg.context_limit(eng.src.hf_config):
            # the KV cache holds less than the model's context: the error names the memory
            eng.check_request(request.prompt_token_ids, request.sampling(self.defaults))

    def run(self, todo: list[Request], record: RecordFn) -> Iterator[Batch]:
        eng = self.engine
        self.replica.record = record
        for step in self.replica.stream(todo):
            yield ([(i, json.dumps(line, ensure_ascii=False)) for i, line, _ in step],
                   eng.stats.tokens_generated)

    def outputs(self, todo: list[Request]) -> Iterator[list[tuple[int, RequestOutput]]]:
        """``todo`` run; after each step, the requests it finished as (input index, output)
        (the Python API's results)."""
        self.engine  # noqa: B018 - built now
        self.replica.record = _output_itself
        for step in self.replica.stream(todo):
            yield [(i, out) for i, out, _ in step]

    def summary(self, requests: int, wall: float, start: float,
                extra: dict[str, Any]) -> dict[str, Any]:
        eng = self.engine
        return eng.summary(wall, start, {**extra, "load_time_s": self.load_s,
                                         **startup(eng.stats.first_step_wall_time,
                                                   eng.startup_phases)})

    def stop(self) -> None:
        pass


def _output_itself(out: RequestOutput) -> RequestOutput:
    return out


def checked_request(request: Request, defaults: SamplingParams, limit: int, vocab: int,
                    num_seqs: int | None, max_num_seqs_named: str = "--max-num-seqs") -> None:
    """``engine.requests.check_request`` of one input request before any engine loads (its
    prompt against the model's context and vocabulary, its settings against ``num_seqs``,
    which ``max_num_seqs_named`` set)."""
    check_request(request.prompt_token_ids, request.sampling(defaults), limit, vocab, num_seqs,
                  max_num_seqs_named=max_num_seqs_named)
