"""Image inputs of a multimodal checkpoint (Qwen3.5's): each image's pixels as the checkpoint's
image processor makes them, its placeholder tokens in the prompt, and the multimodal rotary
(M-RoPE) positions of the whole prompt.

A chat template writes one ``<|image_pad|>`` per image; the prompt holds as many as the image
gives the language model (its patch grid over the merge size squared), and its positions run
in three streams: text tokens advance all three together, an image's tokens take the same
temporal position and their row and column in the merged grid, and the text after an image
resumes past the grid's larger side, so token ``i`` past the prompt sits at ``i + delta``.

Hand-written: transformers' ``Qwen3VLProcessor`` expands the placeholders but cannot load
without torchvision (its video processor), and computes the positions inside its model's
forward; both are a few lines here over its image processor (``AutoImageProcessor``), which
does the resizing and patching.
"""

from __future__ import annotations

import base64
import hashlib
import io
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagedgen.errors import PagedgenError
from pagedgen.runtime.models import registry


@dataclass
class ImageInput:
    """One image of a prompt: its patches (``pixel_values`` [patches, channels x temporal x
    patch x patch]: made again from ``source`` shortly before it is encoded, in a thread
    ahead of the engine, and let go once encoded, so a file's images do not all sit in host
    memory at once; a ``Future`` while being made), its patch grid (t, h, w), a hash of its
    pixels (the encoder's cache and the prefix cache key it), and where its placeholders
    sit."""

    pixel_values: Any
    grid_thw: tuple[int, int, int]
    key: bytes
    start: int
    num_tokens: int
    source: Any = None  # its file's bytes, or the PIL image the caller gave


@dataclass
class StepImages:
    """A step's images as the model reads them (``AttentionMetadata.model_inputs``): the
    embeddings ([n, hidden]) of the step rows ``rows`` [n] that are image tokens, and every
    row's M-RoPE positions ([3, tokens])."""

    rows: torch.Tensor
    embeds: torch.Tensor
    positions: torch.Tensor


@dataclass
class MultiModalPrompt:
    """A prompt's images and its M-RoPE positions ([3, prompt length]); a token ``i`` past the
    prompt is at ``i + delta`` in all three streams."""

    images: list[ImageInput]
    positions: torch.Tensor
    delta: int
    embeds: dict[bytes, torch.Tensor] = field(default_factory=dict)  # encoded, by key
    whole_blocks: bool = False  # an image's tokens see each other: one chunk holds them all

    def chunk_end(self, start: int, end: int) -> int:
        """Where a prefill chunk of tokens ``start`` .. ``end`` may end: ``end``, or where
        ``whole_blocks`` holds, the start of an image it would cut (``start`` itself where
        that image begins at or before it: the chunk waits for a budget that holds it)."""
        if self.whole_blocks:
            for im in self.images:
                if im.start < end < im.start + im.num_tokens:
                    return max(start, im.start)
        return end

    def rope_positions(self, start: int, end: int) -> torch.Tensor:
        """[3, end - start] positions of tokens ``start`` to ``end``."""
        n = self.positions.shape[1]
        inside = self.positions[:, start:min(end, n)]
        if end <= n:
            return inside
        after = torch.arange(max(start, n), end).expand(3, -1) + self.delta
        return torch.cat([inside, after], dim=1)


def load_image(ref: Any, where: str = "") -> tuple[Any, Any]:
    """(a PIL image, what to read it from again) from a PIL image, a path, a ``file://`` URL, a
    ``data:`` URL or an ``http(s)`` URL (fetched; a one-line error where the network is not
    reachable). What it is read from again is the image itself or its file's bytes, never the
    URL or the path: patching it again during the run (``ImagePrompter.pixels``) reads nothing
    that can fail (compressed bytes: a 448 x 448 JPEG holds ~50 KB where its pixels take 5 MB)."""
    from PIL import Image

    if isinstance(ref, Image.Image):
        return ref.convert("RGB"), ref
    if isinstance(ref, bytes):
        return Image.open(io.BytesIO(ref)).convert("RGB"), ref
    prefix = f"{where}: " if where else ""
    if not isinstance(ref, (str, Path)):
        raise PagedgenError(f"{prefix}an image must be a URL or a path, not "
                            f"{type(ref).__name__}")
    text, shown = str(ref), _shown(ref)
    try:
        if text.startswith("data:"):
            head, _, payload = text.partition(",")
            raw = base64.b64decode(payload) if head.endswith(";base64") \
                else urllib.parse.unquote_to_bytes(payload)
        elif text.startswith(("http://", "https://")):
            with urllib.request.urlopen(text, timeout=30) as r:
                raw = r.read()
        else:
            path = urllib.parse.unquote(text.removeprefix("file://")) \
                if text.startswith("file://") else text
            raw = Path(path).read_bytes()
        return Image.open(io.BytesIO(raw)).convert("RGB"), raw
    except (OSError, ValueError, Image.DecompressionBombError) as e:  # a bomb: too many pixels
        raise PagedgenError(f"{prefix}cannot read the image {shown}: "
                            f"{type(e).__name__}: {e}") from None


class ImagePrompter:
    """A multimodal checkpoint's image rules: its image processor, placeholder token and merge
    size (``config``: the checkpoint's outer config; ``path``: its directory)."""

    largest_block = 0  # the most tokens of one image a step must hold together (none here)
    before: list[int] = []  # tokens around an image's own (Gemma 4's boi and eoi)
    after: list[int] = []

    def __init__(self, path: str | Path, config: Any) -> None:
        from transformers import AutoImageProcessor

        self.processor = AutoImageProcessor.from_pretrained(path)
        vision = config.vision_config
        vision = vision if isinstance(vision, dict) else vision.to_dict()
        self.merge = int(vision["spatial_merge_size"])
        self.image_token_id = int(config.image_token_id)

    @classmethod
    def of(cls, src: Any, where: str = "") -> ImagePrompter:
        """The prompter of checkpoint ``src`` (a ``ModelSource``); a PagedgenError (starting
        with ``where``) where its model takes no images."""
        if src.checkpoint is None or not registry.takes_images(src.hf_config):
            raise PagedgenError(f"{where + ': ' if where else ''}{src.name} takes no images "
                                "(its language model runs text prompts only)")
        own = registry.family(src.hf_config.model_type).image_prompter  # the family's rules
        return (own or cls)(src.checkpoint, src.hf_config)

    def prompt(self, ids: list[int], images: list[Any], where: str = ""
               ) -> tuple[list[int], MultiModalPrompt]:
        """``ids`` (one placeholder per image, as the chat template writes them) with each
        placeholder repeated as the image asks (between ``before`` and ``after``), and the
        images' inputs and positions."""
        pads = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(pads) != len(images):
            raise PagedgenError(f"{where + ': ' if where else ''}the prompt has {len(pads)} "
                                f"image placeholder(s) for {len(images)} image(s)")
        out, inputs, last = [], [], 0
        for pad, ref in zip(pads, images):
            image, source = load_image(ref, where)
            try:  # its own rules (Qwen's: sides within 200:1)
                made = self.processor(images=[image], return_tensors="pt")
            except Exception as e:  # noqa: BLE001 - whatever it refuses is this image's error
                raise PagedgenError(
                    f"{where + ': ' if where else ''}the image processor refuses the image "
                    f"{_shown(ref, image)}: {type(e).__name__}: {str(e).splitlines()[0]}"
                ) from None
            grid, n = self.size(made)
            out += ids[last:pad] + self.before
            key = hashlib.sha256(made["pixel_values"].numpy().tobytes()).digest()
            inputs.append(ImageInput(None, grid, key, len(out), n, source))
            out += [self.image_token_id] * n + self.after
            last = pad + 1
        out += ids[last:]
        return out, self.multimodal(len(out), inputs)

    @property
    def largest_image(self) -> int:
        """The most tokens one image can take: the processor's pixel bound over the area a
        merged token covers."""
        side = int(self.processor.patch_size) * self.merge
        return int(self.processor.size["longest_edge"]) // side ** 2

    def tower_tokens(self, im: ImageInput) -> int:
        """What ``im`` weighs in a call of the vision tower, in image tokens: its own."""
        return im.num_tokens

    def size(self, made: Any) -> tuple[tuple[int, int, int], int]:
        """An image's patch grid (t, h, w) and its tokens, from the processor's output."""
        t, h, w = (int(x) for x in made["image_grid_thw"][0])
        return (t, h, w), t * h * w // self.merge ** 2

    def multimodal(self, length: int, inputs: list[ImageInput]) -> MultiModalPrompt:
        """The prompt's images and its M-RoPE positions."""
        positions, delta = mrope_positions(length, inputs, self.merge)
        return MultiModalPrompt(inputs, positions, delta)

    def pixels(self, source: Any) -> torch.Tensor:
        """An image's patches, made again from its bytes (or PIL image) read when checked."""
        return self.processor(images=[load_image(source)[0]],
                              return_tensors="pt")["pixel_values"]


def _shown(ref: Any, image: Any = None) -> str:
    """An image as an error names it: its path or URL (cut), else the read ``image``'s size."""
    if isinstance(ref, (str, Path)):
        return repr(str(ref)[:60])
    return f"of {image.width} x {image.height} pixels"


def mrope_positions(length: int, images: list[ImageInput], merge: int
                    ) -> tuple[torch.Tensor, int]:
    """The [3, length] M-RoPE positions of a prompt with these images (transformers'
    ``get_rope_index`` for images), and the delta of the tokens after it."""
    parts, pos, at = [], 0, 0
    for im in images:
        if im.start > at:  # text: the three streams advance together
            parts.append(torch.arange(pos, pos + im.start - at).expand(3, -1))
            pos += im.start - at
        t, h, w = im.grid_thw[0], im.grid_thw[1] // merge, im.grid_thw[2] // merge
        grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w),
                                          indexing="ij")).reshape(3, -1)
        parts.append(grid + pos)
        pos += max(h, w)
        at = im.start + im.num_tokens
    if length > at:
        parts.append(torch.arange(pos, pos + length - at).expand(3, -1))
        pos += length - at
    return torch.cat(parts, dim=1), pos - length
