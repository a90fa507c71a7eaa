"""Image workloads (issue 96): each request one image and a short question, the same token ids
and the same pixels in every system (and in vLLM's process, which imports this module without
pagedgen), made from a seed.

  i: 2,000 requests, each one image of 448 x 448 to 1,280 x 960 pixels (sides drawn apart,
     multiples of 32), a question of 8-32 tokens, 64-256 output tokens
  ir: i with a quarter of the requests showing an image an earlier request showed

A prompt is ``<|vision_start|> <|image_pad|> <|vision_end|>`` then the question's ids: one
placeholder, which each system repeats as many times as the image has merged patches (Qwen's
processors). An image is a small random grid scaled up smoothly (a photograph's gradients,
not white noise), so its bytes differ per image and nothing about it is special to either
system.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Any

# Qwen3.5's image tokens (transformers' Qwen3_5Config defaults, the published checkpoints')
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = 248053, 248054, 248056, 248057
SPECIAL = {"<|vision_start|>": VISION_START, "<|vision_end|>": VISION_END,
           "<|image_pad|>": IMAGE_PAD, "<|video_pad|>": VIDEO_PAD}


@dataclass(frozen=True)
class ImageWorkload:
    num_prompts: int = 2000
    smallest: tuple[int, int] = (448, 448)  # (width, height)
    largest: tuple[int, int] = (1280, 960)
    repeat_share: float = 0.0  # requests that show an image an earlier one showed
    question_len: tuple[int, int] = (8, 32)
    output_len: tuple[int, int] = (64, 256)
    seed: int = 0

    def requests(self, vocab: int) -> tuple[list[list[int]], list[int], list[int]]:
        """Each request's prompt ids (one image placeholder, then its question), output
        length, and image number (``image``'s argument; a repeat reuses an earlier number).
        Question ids avoid the image tokens."""
        rng = random.Random(self.seed)
        top = min(vocab, VISION_START)
        prompts, outs, images = [], [], []
        for i in range(self.num_prompts):
            q = [rng.randrange(top) for _ in range(rng.randint(*self.question_len))]
            prompts.append([VISION_START, IMAGE_PAD, VISION_END, *q])
            outs.append(rng.randint(*self.output_len))
            repeat = images and rng.random() < self.repeat_share
            images.append(rng.choice(images) if repeat else i)
        return prompts, outs, images

    def size(self, number: int) -> tuple[int, int]:
        """Image ``number``'s (width, height): each side drawn in its range, a multiple of 32."""
        rng = random.Random(f"{self.seed}/{number}/size")
        return tuple(32 * rng.randint(lo // 32, hi // 32)
                     for lo, hi in zip(self.smallest, self.largest))

    def image(self, number: int) -> Any:
        """Image ``number`` (a PIL image, RGB), the same in every process."""
        from PIL import Image

        rng = random.Random(f"{self.seed}/{number}/pixels")
        grid = Image.frombytes("RGB", (8, 6), bytes(rng.randrange(256) for _ in range(144)))
        return grid.resize(self.size(number), Image.BILINEAR)


IMAGE_WORKLOADS = {
    "i": ImageWorkload(),
    "ir": ImageWorkload(repeat_share=0.25),
}


def image_workload(name: str, num_prompts: int | None = None) -> ImageWorkload:
    """Workload ``name``, with ``num_prompts`` requests where given."""
    wl = IMAGE_WORKLOADS[name]
    return replace(wl, num_prompts=num_prompts) if num_prompts else wl
