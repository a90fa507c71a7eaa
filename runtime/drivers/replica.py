"""One engine replica: validated, tokenized requests in, their output lines out, in the format
its caller gives (``record(request_output)``: pagedgen's or OpenAI's lines, ``cli/formats``).
Ray actors (``ray_data.py``), data-parallel workers (``-dp``) and a local run each hold one."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from pagedgen.runtime.config import EngineConfig, SamplingParams
from pagedgen.runtime.engine.engine import Engine
from pagedgen.runtime.engine.sequence import Sequence
from pagedgen.runtime.models.loader import ModelSource
from pagedgen.runtime.models.tokenizer import Tokenizer
from pagedgen.runtime.output.outputs import RequestOutput
from pagedgen.runtime.sampling.structured import Grammars

# The output line of one finished request (picklable: workers get it).
RecordFn = Callable[[RequestOutput], dict[str, Any]]


class Request(Protocol):
    """What a replica needs of a request (``runtime/inputs/request.Request`` has it)."""

    index: int
    prompt_token_ids: Any
    images: list[str] | None
    mm: Any  # its images as the engine made them (``Engine.prompt_images``)

    def sampling(self, defaults: SamplingParams) -> SamplingParams: ...


class Replica:
    def __init__(self, engine_config: EngineConfig, defaults: SamplingParams,
                 record: RecordFn | None = None, src: ModelSource | None = None,
                 tokenizer: Tokenizer | None = None, grammars: Grammars | None = None) -> None:
        """``grammars``: the requests' structured-output constraints, compiled already (the
        engine compiles them at first use otherwise)."""
        t0 = time.perf_counter()
        self.engine = Engine(engine_config, src, tokenizer, grammars=grammars)
        self.engine.tokenizer  # noqa: B018 - loaded now, with the model: lines need it
        self.load_s = time.perf_counter() - t0
        self.defaults = defaults
        self.record = record  # set before ``stream`` when the format is known later
        self.name = f"{os.uname().nodename}:{os.getpid()}"

    def stream(self, requests: list[Request]) -> Iterator[list[tuple[int, dict[str, Any], int]]]:
        """Run ``requests`` (tokenized and checked); after each step, the requests it
        finished (often none) as (input index, output line, output tokens)."""
        eng = self.engine
        eng.add_requests((r.prompt_token_ids, r.sampling(self.defaults), r, r.index, r.mm)
                         for r in requests)
        while eng.has_unfinished():
            yield [(g[0].request.index, self.record(eng.request_output(g)),
                    sum(s.num_output_tokens for s in g)) for g in finished_requests(eng.step())]

    def run(self, requests: list[Request]) -> tuple[list[dict[str, Any]], list[int], float]:
        """Output lines of ``requests`` in their order, each one's output tokens, and the
        seconds the engine took."""
        t0 = time.perf_counter()
        pos = {r.index: i for i, r in enumerate(requests)}
        lines: list[dict[str, Any] | None] = [None] * len(requests)
        tokens = [0] * len(requests)
        for step in self.stream(requests):
            for index, line, n in step:
                lines[pos[index]], tokens[pos[index]] = line, n
        return lines, tokens, time.perf_counter() - t0


def finished_requests(finished: list[Sequence]) -> list[list[Sequence]]:
    """The samples of each request completed by this step's finished sequences (once per
    request, whichever of its samples finished last)."""
    out, groups = [], {}
    for seq in finished:
        if seq.samples is None:
            out.append([seq])
        elif all(s.finish_time is not None for s in seq.samples):
            groups[id(seq.samples)] = seq.samples
    return out + list(groups.values())
