"""The Qwen3.5 families: ``qwen3_5_text`` (dense: Qwen3.5-9B, 27B) and ``qwen3_5_moe_text``
(Qwen3.5-35B-A3B, 122B-A10B, 397B-A17B) on Qwen3-Next's hybrid skeleton (``qwen3_next.py``:
three Gated DeltaNet layers to one gated full-attention layer). The dense model's every layer
has a SwiGLU MLP; the MoE model's every layer has routed experts (top-k weights always
renormalized) beside a gated shared expert. Their checkpoints hold the linear-attention
projections apart (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``).

The published checkpoints are multimodal (``qwen3_5`` / ``qwen3_5_moe``:
``Qwen3_5ForConditionalGeneration``): the language model is read from ``text_config`` and the
``model.language_model.*`` tensors, the vision tower from ``vision_config`` and
``model.visual.*``. An image's embeddings (the tower's patch merger's output) replace its
placeholder tokens' in the prompt (``runtime/models/multimodal.py``), and a step with image
tokens turns each rotary column by its stream's position (``mrope_section``, interleaved);
elsewhere every stream has the same position, which is plain rotary.

The vision tower is transformers' ``Qwen3_5VisionModel`` (patch embedding, learned positions
resampled to the image's grid, 2D rotary, blocks attending within each image, patch merger):
pagedgen runs it as transformers defines it, on its weights, once per image; only the language
model runs on pagedgen's paged layers. Its attention runs on ``PackedAttention``
(``VisionAttention``): SDPA an image at a time without cuDNN's kernel, which builds an
execution plan for every new image size, or, asked, one FlashAttention-4 varlen call for all
of a call's images (``benchmarks/vision_tower.py`` measures the choices); its rotary turns q
and k in the language model's fused kernel where the fused kernels run.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagedgen.attention.packed import PackedAttention
from pagedgen.profiling import scope
from pagedgen.runtime.collectives.parallel import TensorParallel
from pagedgen.runtime.layers import fused_ops
from pagedgen.runtime.layers.rotary import mrope_sections
from pagedgen.runtime.models.families import llama
from pagedgen.runtime.models.families.qwen2_moe import shared_expert_moe
from pagedgen.runtime.models.families.qwen3_moe import check_experts
from pagedgen.runtime.models.families.qwen3_next import HYBRID, HybridForCausalLM, check_hybrid
from pagedgen.runtime.models.hf_config import check_int
from pagedgen.runtime.models.multimodal import StepImages
from pagedgen.runtime.models.registry import ModelFamily, register
from pagedgen.runtime.quantization.config import QuantConfig
from pagedgen.transfer import upload_host

PROFILE_IMAGE_TOKENS = 4096  # the memory profile's images: 16,384 patches, a 2,048² image


class Qwen3_5ForCausalLM(HybridForCausalLM):
    def __init__(self, config, tp: TensorParallel | None = None,
                 quant: QuantConfig | None = None) -> None:
        super().__init__(config, tp, quant)
        vision = getattr(config, "vision_config", None)
        self.visual = vision_tower(vision) if isinstance(vision, dict) else None
        self.sections: torch.Tensor | None = None  # each rotary column's position stream
        self.vision_attention: PackedAttention | None = None

    @property
    def takes_images(self) -> bool:
        return self.visual is not None

    def setup_rotary(self, max_positions: int, device: torch.device) -> None:
        super().setup_rotary(max_positions, device)
        if self.visual is not None:  # its rotary's frequencies: computed, not loaded
            with torch.device(device):
                rotary = self.visual.rotary_pos_emb
                self.visual.rotary_pos_emb = type(rotary)(rotary.config)
            self.vision_attention = packed_attention(self.visual, device)
            rope = self.config.rope_parameters
            self.sections = mrope_sections(rope.get("mrope_section", [11, 11, 10]),
                                           self.rotary.cos.shape[1],
                                           rope.get("mrope_interleaved", True)).to(device)

    def encode_images(self, pixel_values: list[torch.Tensor],
                      grids: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """Each image's embeddings [tokens, hidden], the images encoded in one call. The
        tower's index tensors are made on the host from the grids (``host_indices``) and
        every input is uploaded without waiting for the GPU: made on the device, the tower
        reads them back (``tolist``) and its copies from pageable memory wait for the queue."""
        weight = self.visual.patch_embed.proj.weight
        device, dtype = weight.device, weight.dtype
        pixels = upload_host(torch.cat(pixel_values), device).to(dtype)
        grid = torch.tensor(grids)
        indices = {k: v if k == "cu_seqlens" else upload_host(v, device)  # read on the host
                   for k, v in host_indices(self.visual, grid).items()}
        with scope("vision_encoder"):  # profile's kernel group of its own
            out = self.visual(pixels, grid_thw=grid, **indices).pooler_output
        merge = self.visual.spatial_merge_size ** 2
        return list(out.split([t * h * w // merge for t, h, w in grids]))

    def profile_vision(self, tokens: int, largest: int) -> None:
        """The vision tower's largest call, at least ``tokens`` merged tokens, so the memory
        profile's peak counts it: square images of at most ``PROFILE_IMAGE_TOKENS`` each (its
        activations grow with the call's patches whatever the images; its attention's memory
        with an image's, which SDPA's and FA4's kernels keep linear, and its time with their
        square: one image of 16,384 tokens would add seconds to the start-up); ``largest``,
        the largest image's tokens, is within ``tokens``."""
        cfg = self.visual.config
        side = math.ceil(math.sqrt(min(tokens, PROFILE_IMAGE_TOKENS))) * cfg.spatial_merge_size
        width = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
        n = -(-tokens * cfg.spatial_merge_size ** 2 // side ** 2)
        self.encode_images([torch.zeros(side * side, width)] * n, [(1, side, side)] * n)

    def inputs(self, input_ids: torch.Tensor, positions: torch.Tensor,
               metadata) -> tuple[torch.Tensor, tuple]:
        images = getattr(metadata, "model_inputs", None)
        if not isinstance(images, StepImages):
            return super().inputs(input_ids, positions, metadata)
        x = self.embed(input_ids)
        x[images.rows] = images.embeds.to(x.dtype)
        return x, self.rotary.lookup_mrope(images.positions, self.sections)

    @classmethod
    def make_mlp(cls, config, tp: TensorParallel, quant: QuantConfig | None,
                 prefix: str) -> nn.Module:
        if config.model_type == "qwen3_5_moe_text":
            return shared_expert_moe(config, tp, quant, prefix, renormalize=True)
        return llama.MLP(config, tp, quant, prefix)


def host_indices(tower: nn.Module, grid: torch.Tensor) -> dict[str, torch.Tensor]:
    """The index tensors transformers' vision tower computes from its images' grids
    (``transformers.vision_utils``), made from a host ``grid``: passed to its forward, it
    takes them instead of computing them."""
    from transformers import vision_utils

    merge = tower.config.spatial_merge_size
    interp, weights = vision_utils.get_vision_interpolation_indices_and_weights(
        grid, num_grid_per_side=tower.num_grid_per_side, mode=tower.interpolation_mode,
        align_corners=tower.interpolation_align_corners, spatial_merge_size=merge)
    return {"interp_indices": interp, "interp_weights": weights,
            "position_ids": vision_utils.get_vision_position_ids(grid, merge),
            "cu_seqlens": vision_utils.get_vision_cu_seqlens(grid)}


class VisionAttention(nn.Module):
    """transformers' Qwen3.5 vision attention (its ``qkv`` and ``proj``, 2D rotary as its
    ``apply_rotary_pos_emb_vision`` turns q and k) over a ``PackedAttention`` shared by the
    tower's layers. ``fused`` (``use_fused_kernels``): the rotary in one Triton kernel, not
    transformers' ten float32 passes over q and k (about a tenth of the tower's time)."""

    def __init__(self, attn: nn.Module, packed: PackedAttention) -> None:
        super().__init__()
        self.qkv, self.proj = attn.qkv, attn.proj
        self.num_heads, self.scaling = attn.num_heads, attn.scaling
        self.packed = packed
        self.fused = False

    def forward(self, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor,
                position_embeddings: tuple[torch.Tensor, torch.Tensor], **_) -> torch.Tensor:
        n = hidden_states.shape[0]
        q, k, v = self.qkv(hidden_states).reshape(n, 3, self.num_heads, -1).unbind(1)
        if self.fused:  # cos, sin [n, head_dim] float32: both halves alike (neox)
            q, k = fused_ops.rotary_fused(q, k, *position_embeddings)
        else:
            from transformers.models.qwen3_5.modeling_qwen3_5 import (
                apply_rotary_pos_emb_vision,
            )

            q, k = apply_rotary_pos_emb_vision(q, k, *position_embeddings)
        return self.proj(self.packed(q, k, v, cu_seqlens.cpu(), self.scaling).reshape(n, -1))


def packed_attention(tower: nn.Module, device: torch.device, **choice) -> PackedAttention:
    """The tower's blocks' attention as ``VisionAttention`` over one ``PackedAttention``
    (``choice``: its ``kernel`` and ``sdpa_backends``), returned."""
    attn = tower.blocks[0].attn
    packed = PackedAttention(device, attn.qkv.out_features // 3 // attn.num_heads,
                             attn.qkv.weight.dtype, **choice)
    for block in tower.blocks:
        block.attn = VisionAttention(block.attn, packed)
    return packed


def vision_tower(vision: dict[str, Any]) -> nn.Module:
    """transformers' Qwen3.5 vision tower for this ``vision_config`` (SDPA attention)."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    cfg = Qwen3_5VisionConfig(**{k: v for k, v in vision.items() if k != "model_type"})
    cfg._attn_implementation = "sdpa"
    return Qwen3_5VisionModel(cfg)


def _rules(f: dict[str, Any], model_type: str, where: str) -> None:
    check_hybrid(f, where)
    if model_type == "qwen3_5_moe_text":
        check_experts(f, where)
        check_int(f, "moe_intermediate_size", where)
        check_int(f, "shared_expert_intermediate_size", where)
        f["intermediate_size"] = f["moe_intermediate_size"]  # no dense MLP: for the summary


# transformers' Qwen3_5TextConfig and Qwen3_5MoeTextConfig defaults (Qwen3.5-9B's and
# Qwen3.5-35B-A3B's shapes)
_QWEN3_5 = dict(HYBRID, vocab_size=248320, num_attention_heads=16, head_dim=256)
register(ModelFamily(
    name="qwen3_5",
    model_types={
        "qwen3_5_text": dict(_QWEN3_5, hidden_size=4096, intermediate_size=12288,
                             num_hidden_layers=32, num_key_value_heads=4),
        "qwen3_5_moe_text": dict(_QWEN3_5, hidden_size=2048, intermediate_size=512,
                                 num_hidden_layers=40, num_key_value_heads=2,
                                 moe_intermediate_size=512, shared_expert_intermediate_size=512,
                                 num_experts_per_tok=8, num_local_experts=256),
    },
    model_cls=Qwen3_5ForCausalLM,
    normalize=_rules,
    partial_rotary=True,
    multimodal={"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"},
    images=True))
