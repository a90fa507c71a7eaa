"""One engine replica: validated, tokenized requests in, their output lines out (pagedgen's or
OpenAI's format). Ray actors (``pagedgen.ray``) and data-parallel workers (``-dp``) each hold
one."""

from __future__ import annotations

import os
import time
from typing import Any, Iterator

from pagedgen.cli import openai_batch, records
from pagedgen.cli.request import Request
from pagedgen.runtime.config import EngineConfig, SamplingParams
from pagedgen.runtime.engine import Engine
from pagedgen.runtime.models.loader import ModelSource
from pagedgen.runtime.tokenizer import Tokenizer


class Replica:
    def __init__(self, engine_config: EngineConfig, defaults: SamplingParams, fmt: str,
                 served_model_name: str | None = None, src: ModelSource | None = None,
                 tokenizer: Tokenizer | None = None) -> None:
        t0 = time.perf_counter()
        self.engine = Engine(engine_config, src, tokenizer)
        self.load_s = time.perf_counter() - t0
        self.defaults = defaults
        self.fmt = fmt
        self.model_name = served_model_name or self.engine.src.name
        self.name = f"{os.uname().nodename}:{os.getpid()}"

    def record(self, samples) -> dict[str, Any]:
        """The output line of one request whose samples have all finished."""
        if self.fmt == "openai":
            return openai_batch.record(self.engine, samples, self.model_name)
        return records.record(self.engine, samples)

    def stream(self, requests: list[Request]) -> Iterator[list[tuple[int, dict[str, Any], int]]]:
        """Run ``requests`` (tokenized and checked); after each step, the requests it
        finished (often none) as (input index, output line, output tokens)."""
        eng = self.engine
        eng.add_requests((r.prompt_token_ids, r.sampling(self.defaults), r, r.index)
                         for r in requests)
        while eng.has_unfinished():
            yield [(g[0].request.index, self.record(g), sum(s.num_output_tokens for s in g))
                   for g in records.finished_requests(eng.step())]

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
