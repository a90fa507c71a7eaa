"""A step's images: the embeddings of the image tokens its prefill chunks carry and every
row's M-RoPE positions (``StepImages``, the model's ``metadata.model_inputs``), and where an
image's tokens see each other (Gemma 4), its blocks (``metadata.image_blocks``).

A sequence's images are read and patched (``ImagePrompter.pixels``) in worker threads as soon
as the engine makes the sequence (``prefetch``: a scheduler's lookahead ahead of admission),
so the CPU work runs beside the GPU's and only the images of the sequences near admission
hold their pixels in host memory. Each image runs through the vision tower once, when the
first chunk holding its tokens is scheduled, with every other image that step needs: batched
in calls of at most ``call_tokens`` image tokens (the step's budget, or the largest image the
processor makes where that is more; the memory plan profiles one such call). Its pixels are
then let go and its embeddings stay in a cache keyed by its pixels' hash, so a chunked
prompt's later chunks, a preempted sequence's recompute and another request with the same
image take them from there (``encoded`` counts the tower's images, ``reused`` the cache's
hits). The cache holds the embeddings last used, at most ``capacity_bytes`` of them
(``CACHE_BYTES``: the memory plan keeps that much off the KV cache; a step's own images stay
whatever their size); one evicted and needed again is patched and encoded again.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from pagedgen.attention.image_blocks import ImageBlock
from pagedgen.errors import PagedgenError
from pagedgen.runtime.engine.sequence import Sequence
from pagedgen.runtime.models.multimodal import ImagePrompter, StepImages
from pagedgen.transfer import upload_host

CACHE_BYTES = 512 << 20  # the embeddings cache's bound (a 1,280 x 960 image's 1,200 tokens
# of a 4,096-wide model are 9.8 MB: about 50 of the largest, thousands of small ones)


class ImageEncoder:
    """Image embeddings for ``model`` (one with ``encode_images``) on ``device``; ``prompter``
    (its checkpoint's) patches the images."""

    def __init__(self, model: Any, prompter: ImagePrompter, device: torch.device,
                 max_num_batched_tokens: int | None = None, capacity_bytes: int = CACHE_BYTES,
                 threads: int = 4) -> None:
        largest = prompter.largest_block
        if max_num_batched_tokens is not None and largest > max_num_batched_tokens:
            raise PagedgenError(
                f"an image's {largest} tokens see each other and are computed in one step: "
                f"--max-num-batched-tokens {max_num_batched_tokens} is too small; give at "
                f"least {largest}")
        self.model, self.prompter, self.device = model, prompter, device
        self.call_tokens = max(max_num_batched_tokens or 0, prompter.largest_image)
        self.capacity_bytes = capacity_bytes
        self.cache: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.cache_bytes = 0
        self.reset_counts()
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="pagedgen-images")

    def reset_counts(self) -> None:
        """The summary's figures from zero (between benchmark runs on one engine)."""
        self.encoded = 0
        self.reused = 0
        self.pixel_wait_s = 0.0  # the step loop waiting for pixels not made ahead
        self._timings: list[Any] = []  # the tower's runs: (start, end) events, or seconds

    def forget(self) -> None:
        """Drop every cached embedding (between benchmark runs: each starts cold)."""
        self.cache.clear()
        self.cache_bytes = 0

    def prefetch(self, images: Any) -> None:
        """Start patching ``images``' (a ``MultiModalPrompt``'s) images not encoded yet."""
        for im in images.images:
            if im.pixel_values is None and im.key not in self.cache:
                im.pixel_values = self.pool.submit(self.prompter.pixels,
                                                   im.source)

    def attach(self, md: Any, prefills: list[tuple[Sequence, int]],
               decode_positions: list[int]) -> None:
        """Set the step's ``model_inputs`` (``StepImages``: prefill rows first, then one row
        per decode at ``decode_positions``) and, for images whose tokens see each other,
        its ``image_blocks``; both stay None when no chunk holds an image's tokens."""
        spans = [(seq, seq.num_computed_tokens, seq.num_computed_tokens + n, im)
                 for seq, n in prefills if seq.mm is not None for im in seq.mm.images
                 if im.start < seq.num_computed_tokens + n
                 and im.start + im.num_tokens > seq.num_computed_tokens]
        if not spans:
            return
        self._encode([im for *_, im in spans])
        rows, embeds, positions, blocks, row = [], [], [], [], 0
        for i, (seq, n) in enumerate(prefills):
            start = seq.num_computed_tokens
            positions.append(seq.mm.rope_positions(start, start + n) if seq.mm is not None
                             else torch.arange(start, start + n).expand(3, -1))
            for s, lo, hi, im in spans:
                if s is seq:
                    a, b = max(lo, im.start), min(hi, im.start + im.num_tokens)
                    rows.append(torch.arange(row + a - lo, row + b - lo))
                    embeds.append(self.cache[im.key][a - im.start:b - im.start])
                    if seq.mm.whole_blocks:  # the scheduler ends no chunk inside a block
                        if b < im.start + im.num_tokens:
                            raise RuntimeError("a prefill chunk ends inside an image block")
                        blocks.append(ImageBlock(i, row + a - lo, b - a, b))
            row += n
        positions.append(torch.tensor(decode_positions, dtype=torch.long).expand(3, -1))
        md.model_inputs = StepImages(upload_host(torch.cat(rows), self.device), torch.cat(embeds),
                                     upload_host(torch.cat(positions, dim=1), self.device))
        md.image_blocks = blocks or None

    def summary(self, wall: float) -> dict[str, float | int | str]:
        """The run summary's image figures: images through the tower (and per second of the
        run), the steps' images taken from the cache, the tower's time (on a GPU its kernels'
        time between two events, read once the run is over) and its share of the run, the
        time the steps waited for pixels, and the tower's attention kernel where the model
        says (and why not FA4)."""
        tower = sum(t if isinstance(t, float) else _elapsed(*t) for t in self._timings)
        attention = getattr(self.model, "vision_attention", None)
        kernel = {} if attention is None else {"vision_attention": attention.kernel + (
            f" ({attention.why})" if attention.why else "")}
        return {**kernel, "images_encoded": self.encoded, "images_encoded_per_s":
                self.encoded / wall if wall else 0.0, "image_cache_hits": self.reused,
                "vision_encoder_s": tower, "vision_encoder_share": tower / wall if wall else 0.0,
                "image_pixel_wait_s": self.pixel_wait_s}

    def _encode(self, images: list) -> None:
        """Run the tower over the images not cached (each once), and mark all as used."""
        todo = {}
        for im in images:
            if im.key in self.cache:
                self.cache.move_to_end(im.key)
                self.reused += 1
            else:
                todo.setdefault(im.key, im)
        for call in self._calls(list(todo.values())):
            t0 = time.perf_counter()
            pixels = [self._pixels(im) for im in call]
            self.pixel_wait_s += time.perf_counter() - t0
            cuda = self.device.type == "cuda"
            start = torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter()
            if cuda:
                start.record()
            out = self.model.encode_images(pixels, [im.grid_thw for im in call])
            if cuda:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self._timings.append((start, end))
            else:  # the CPU ran it in the call
                self._timings.append(time.perf_counter() - start)
            self.encoded += len(call)
            for im, embeds in zip(call, out):
                self.cache[im.key] = embeds
                self.cache_bytes += embeds.nbytes
        for im in images:  # encoded (now or before): its pixels let go
            im.pixel_values = None
        own = len({im.key for im in images})  # this step's, last in the cache: kept
        while self.cache_bytes > self.capacity_bytes and len(self.cache) > own:
            self.cache_bytes -= self.cache.popitem(last=False)[1].nbytes

    def _calls(self, todo: list) -> list[list]:
        """``todo`` in order, cut into the tower's calls of at most ``call_tokens`` tokens."""
        calls, tokens = [], 0
        for im in todo:
            weight = self.prompter.tower_tokens(im)
            if not calls or tokens + weight > self.call_tokens:
                calls.append([])
                tokens = 0
            calls[-1].append(im)
            tokens += weight
        return calls

    def profile(self) -> None:
        """The tower's largest call, for the memory plan's profile."""
        self.model.profile_vision(self.call_tokens, self.prompter.largest_image)

    def _pixels(self, im: Any) -> torch.Tensor:
        """``im``'s patches: prefetched, or made now (an image evicted and needed again)."""
        if isinstance(im.pixel_values, Future):
            return im.pixel_values.result()
        if im.pixel_values is None:
            return self.prompter.pixels(im.source)
        return im.pixel_values


def _elapsed(start: Any, end: Any) -> float:
    """Seconds between two CUDA events, once the later has happened."""
    end.synchronize()
    return start.elapsed_time(end) / 1e3
