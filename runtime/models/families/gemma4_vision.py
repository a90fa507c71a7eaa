"""Gemma 4's images (multimodal ``gemma4`` checkpoints): the vision tower, the prompt's image
tokens, and an image's tokens seeing each other.

* The tower is transformers' ``Gemma4VisionModel`` (patches embedded with learned 2D
  positions, bidirectional blocks, pooled k x k into soft tokens) and its
  ``Gemma4MultimodalEmbedder`` (an unweighted RMSNorm and a projection to the language model's
  width), run as transformers defines them, on the checkpoint's ``model.vision_tower.*`` and
  ``model.embed_vision.*``; only the language model runs on pagedgen's paged layers.
* The image processor (transformers', loaded with ``AutoImageProcessor``: its PIL variant needs
  no torchvision) resizes an image to at most ``max_soft_tokens`` soft tokens; the chat
  template writes one image token per image, which becomes ``boi``, that many image tokens and
  ``eoi`` (``Gemma4Processor``'s expansion, hand-written here as for Qwen: the processor itself
  loads a video processor that needs torchvision). Positions stay plain (no M-RoPE).
* The language model reads an image token as the pad token (its embedding, and its per-layer
  inputs' token part) with the tower's embedding written over it.
* With ``use_bidirectional_attention: "vision"`` (the published 26B and 31B configs) an image's
  tokens see their whole block on the window layers: ``MultiModalPrompt.whole_blocks`` keeps a
  block in one prefill chunk and those layers' ``LayerSpec.image_blocks`` attend its rows again
  (``attention/image_blocks.py``).
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from pagedgen.profiling import scope
from pagedgen.runtime.models.multimodal import (
    ImageInput,
    ImagePrompter,
    MultiModalPrompt,
    load_image,
)
from pagedgen.transfer import upload_host


def sees_blocks(config: Any) -> bool:
    """Whether an image's tokens see their whole block (on the window layers)."""
    return getattr(config, "use_bidirectional_attention", None) == "vision"


def buffers_as_parameters(module: nn.Module) -> None:
    """The persistent buffers of ``module`` (a tower's standardization statistics and
    clipping bounds, which its checkpoint holds) made parameters, which the loader fills."""
    for mod in module.modules():
        for name, buf in list(mod._buffers.items()):
            if buf is not None and name not in mod._non_persistent_buffers_set:
                del mod._buffers[name]
                mod.register_parameter(name, nn.Parameter(buf, requires_grad=False))


class Gemma4Vision(nn.Module):
    """The vision tower and its projection into the language model (``hidden`` wide)."""

    def __init__(self, vision: dict[str, Any], hidden: int) -> None:
        super().__init__()
        from transformers.models.gemma4.configuration_gemma4 import Gemma4VisionConfig
        from transformers.models.gemma4.modeling_gemma4 import (
            Gemma4MultimodalEmbedder,
            Gemma4VisionModel,
        )

        cfg = Gemma4VisionConfig(**{k: v for k, v in vision.items() if k != "model_type"})
        cfg._attn_implementation = "sdpa"
        self.vision_tower = Gemma4VisionModel(cfg)
        self.embed_vision = Gemma4MultimodalEmbedder(cfg, SimpleNamespace(hidden_size=hidden))
        buffers_as_parameters(self.vision_tower)

    def setup_rotary(self, device: torch.device) -> None:
        """The tower's rotary frequencies, computed (a buffer no checkpoint holds)."""
        encoder = self.vision_tower.encoder
        with torch.device(device):
            encoder.rotary_emb = type(encoder.rotary_emb)(encoder.rotary_emb.config)

    def encode(self, pixels: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """Each image's soft tokens' embeddings [tokens, hidden], the images in one call
        (``pixels``: each one's patches [1, patches, 3 p p] and patch positions [1, patches,
        2], (-1, -1) for padding)."""
        weight = self.embed_vision.embedding_projection.weight
        values = upload_host(torch.cat([p for p, _ in pixels]), weight.device).to(weight.dtype)
        where = torch.cat([w for _, w in pixels])
        k2 = self.vision_tower.config.pooling_kernel_size ** 2
        sizes = ((where != -1).all(-1).sum(-1) // k2).tolist()  # on the host: no wait
        with scope("vision_encoder"):
            hidden = self.vision_tower(pixel_values=values,
                                       pixel_position_ids=upload_host(where, weight.device))
            out = self.embed_vision(hidden.last_hidden_state)
        return list(out.split(sizes))

    def profile(self, images: int, patches: int) -> None:
        """The tower over ``images`` images of ``patches`` patches each (the memory
        profile's): a square grid of whole pooling windows, padded as the processor pads."""
        cfg = self.vision_tower.config
        k = cfg.pooling_kernel_size
        side = max(1, math.isqrt(patches // k ** 2)) * k
        grid = torch.stack(torch.meshgrid(torch.arange(side), torch.arange(side),
                                          indexing="xy"), -1).reshape(1, -1, 2)
        grid = torch.cat([grid, grid.new_full((1, patches - side * side, 2), -1)], 1)
        self.encode([(torch.zeros(1, patches, 3 * cfg.patch_size ** 2), grid)] * images)


class Gemma4ImagePrompter(ImagePrompter):
    """Gemma 4's image rules: its image processor, the image, ``boi`` and ``eoi`` tokens
    (``config``: the language model's, with the checkpoint's vision fields)."""

    def __init__(self, path: Any, config: Any) -> None:
        from transformers import AutoImageProcessor

        self.processor = AutoImageProcessor.from_pretrained(path)
        self.image_token_id = int(config.image_token_id)
        self.before, self.after = [int(config.boi_token_id)], [int(config.eoi_token_id)]
        self.whole_blocks = sees_blocks(config)
        # the most tokens one image takes: a step computes them together where they see
        # each other
        self.largest_block = self.largest_image if self.whole_blocks else 0

    @property
    def largest_image(self) -> int:
        return int(self.processor.max_soft_tokens)

    def tower_tokens(self, im: ImageInput) -> int:
        """The largest image's: the processor pads every image's patches to its size."""
        return self.largest_image

    def size(self, made: Any) -> tuple[tuple[int, int, int], int]:
        n = int(made["num_soft_tokens_per_image"][0])
        return (1, 1, n), n

    def multimodal(self, length: int, inputs: list[ImageInput]) -> MultiModalPrompt:
        """The images, plain positions, and whether a chunk must hold each whole."""
        return MultiModalPrompt(inputs, torch.arange(length).expand(3, -1), 0,
                                whole_blocks=self.whole_blocks)

    def pixels(self, source: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """An image's patches and their positions, made again from what it was read from."""
        made = self.processor(images=[load_image(source)[0]], return_tensors="pt")
        return made["pixel_values"], made["image_position_ids"]
