"""A run's images made ready before it starts, for every driver: each request's images read
and sized in threads (``ImagePrompter.prompt``: its placeholders repeated as each image asks,
its M-RoPE positions), then, as the command checks each request, its prompt ids and images set
on it or the line's error.

An engine in this process prompts with its own prompter (``Engine.prompt_images``); replicas
elsewhere (``-dp``/``-tp`` workers, Ray actors) with the checkpoint's prompter made here
(``RemoteImages``), so a bad image is its line's error before any worker sees it, and the
request travels with what was made: the images' bytes, grids and positions. Where it runs,
each image's pixels are made again from its bytes just before the vision tower needs them
(``ImageEncoder.prefetch``), so no patches cross a process boundary.

The image processor's resizing runs in C with the GIL released (~8 ms per 448 x 448 image on
one core), so threads, not processes: a file of thousands waits seconds before the run.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pagedgen.errors import PagedgenError
from pagedgen.runtime.config import EngineConfig, SamplingParams
from pagedgen.runtime.drivers.replica import Request
from pagedgen.runtime.engine.requests import check_request
from pagedgen.runtime.models.loader import resolve_model
from pagedgen.runtime.models.multimodal import ImagePrompter

# (prompt ids, images) → (ids with each image's placeholders, the images' MultiModalPrompt)
PromptFn = Callable[[list[int], list[Any]], tuple[list[int], Any]]


class PreparedImages:
    """``prepare`` a run's requests' images ahead; ``take`` one request's as it is checked."""

    def __init__(self) -> None:
        self._made: dict[int, Any] = {}  # id(request) → (ids, images) or the error

    def prepare(self, requests: list[Request], prompt: PromptFn,
                progress: Callable[[int], None] | None = None) -> None:
        """Each request with images made by ``prompt`` in threads; ``progress(n)`` as each
        request's ``n`` images are done."""
        self._made = _made([r for r in requests if r.images], prompt, progress)

    def take(self, request: Request, prompt: PromptFn) -> None:
        """``request``'s prompt ids and images (``mm``) as prepared (made now if it was not);
        ValueError where an image cannot be read or the model takes none."""
        made = self._made.pop(id(request), None) or _made([request], prompt)[id(request)]
        if isinstance(made, PagedgenError):
            raise ValueError(str(made))
        request.prompt_token_ids, request.mm = array("i", made[0]), made[1]


def _made(requests: list[Request], prompt: PromptFn,
          progress: Callable[[int], None] | None = None) -> dict[int, Any]:
    def one(r: Request) -> Any:
        try:
            return prompt(list(r.prompt_token_ids), r.images)
        except PagedgenError as e:
            return e
        finally:
            if progress is not None:
                progress(len(r.images))
    if len(requests) < 2:
        return {id(r): one(r) for r in requests}
    with ThreadPoolExecutor(min(16, os.cpu_count() or 1)) as pool:
        return dict(zip((id(r) for r in requests), pool.map(one, requests)))


class RemoteImages:
    """Images of requests that run in replicas elsewhere (``-dp``, ``--ray``): prepared here
    with the checkpoint's prompter, each request checked against the model's context once its
    image tokens are in (the replica's engine takes it as checked)."""

    def __init__(self, engine_config: EngineConfig, defaults: SamplingParams) -> None:
        self.engine_config, self.defaults = engine_config, defaults
        self.images = PreparedImages()
        self._prompter: ImagePrompter | PagedgenError | None = None
        self._limit = self._vocab = 0

    def _prompt(self, ids: list[int], images: list[Any]) -> tuple[list[int], Any]:
        if isinstance(self._prompter, PagedgenError):  # the model takes no images
            raise self._prompter
        return self._prompter.prompt(ids, images)

    def _load(self) -> None:
        if self._prompter is None:  # once, before any thread prompts
            src = resolve_model(self.engine_config.model)
            self._limit = self.engine_config.context_limit(src.hf_config)
            self._vocab = src.hf_config.vocab_size
            try:
                self._prompter = ImagePrompter.of(src)
            except PagedgenError as e:
                self._prompter = e

    def prepare(self, requests: list[Request], progress=None) -> None:
        if any(r.images for r in requests):
            self._load()
            self.images.prepare(requests, self._prompt, progress)

    def check(self, request: Request) -> None:
        """A request with images: its image tokens in, then ``check_request`` on the whole
        prompt (others: each replica's engine checks its own)."""
        if request.images:
            self._load()
            self.images.take(request, self._prompt)
            cfg = self.engine_config
            check_request(request.prompt_token_ids, request.sampling(self.defaults),
                          self._limit, self._vocab, cfg.max_num_seqs,
                          max_num_seqs_named=cfg.named("max_num_seqs"))
