"""The gpt-oss family (``gpt_oss``: gpt-oss-20b, gpt-oss-120b), as transformers'
``GptOssForCausalLM`` defines it: Llama's skeleton with biases on q/k/v/o, a learned attention
sink per query head (``LayerSpec.sinks``: the backends that take them), layers alternating a
sliding window and full attention (``layer_types``), YaRN rope, and in every layer a mixture of
``num_local_experts`` experts of ``intermediate_size``: a router with a bias, softmax over each
token's top ``num_experts_per_tok`` logits, and experts with biases and a clamped SwiGLU
(``moe_act.clamped_swiglu``).

Checkpoints stack the experts transposed with gate and up interleaved
(``experts.gate_up_proj`` [E, H, 2I], columns gate, up, gate, ...; ``experts.down_proj``
[E, I, H]) and name the router ``mlp.router``; ``load_weights`` turns them into ``FusedMoE``'s
layout. The published checkpoints hold the experts 4-bit (their ``quantization_config`` names
the format; ``runtime/quantization/registry.py`` gives the experts its method, which keeps them
4-bit: gpt-oss-20b's experts take 10 GB and 120b's 61 GB).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedgen.attention.backend import LayerSpec
from pagedgen.errors import PagedgenError
from pagedgen.runtime.collectives.parallel import TensorParallel
from pagedgen.runtime.layers.moe.act import clamped_swiglu
from pagedgen.runtime.layers.moe.layer import SparseMoeBlock
from pagedgen.runtime.models.families import llama
from pagedgen.runtime.models.families.qwen3_moe import MoeForCausalLM, check_experts
from pagedgen.runtime.models.hf_config import check_int
from pagedgen.runtime.models.registry import ModelFamily, register
from pagedgen.runtime.quantization import registry
from pagedgen.runtime.quantization.config import QuantConfig

LAYER_TYPES = ("sliding_attention", "full_attention")


class DecoderLayer(llama.DecoderLayer):
    def make_mlp(self, config, tp: TensorParallel, quant: QuantConfig | None,
                 prefix: str) -> nn.Module:
        experts, top_k, width = (getattr(config, f) for f in GptOssForCausalLM.moe_fields)
        names = [f"{prefix}.experts.{n}" for n in ("gate_up_proj", "down_proj")]
        method = quant.moe_method_for(names) if quant else None
        return SparseMoeBlock(config.hidden_size, experts, top_k, width, True, tp,
                              method=method, bias=True,
                              act=clamped_swiglu(config.swiglu_alpha, config.swiglu_limit))


def _deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Columns gate, up, gate, up, ... along ``dim`` → every gate, then every up."""
    gate, up = t.unflatten(dim, (-1, 2)).unbind(dim + 1)
    return torch.cat([gate, up], dim)


def checkpoint_tensor(name: str, tensor) -> tuple[str, Any]:
    """A gpt-oss checkpoint tensor as our layers hold it (name and layout): dense experts
    [E, in, out] transposed to rows first; packed ones (uint8 codes, rows first already) as
    they are; gate/up rows interleaved split into every gate, then every up."""
    name = name.replace(".mlp.router.", ".mlp.gate.").replace(".self_attn.sinks",
                                                              ".self_attn.attn.sinks")
    packed = isinstance(tensor, torch.Tensor) and tensor.dtype == torch.uint8
    if name.endswith(".experts.gate_up_proj"):  # [E, H, 2I] interleaved → [E, 2I, H]
        if packed:  # [E, 2I, H / 2] codes
            return name, _deinterleave(tensor, 1)
        return name, _deinterleave(tensor[:], 2).transpose(1, 2)
    if name.endswith((".experts.gate_up_proj_bias", ".experts.gate_up_proj_scales")):
        return name, _deinterleave(tensor[:], 1)  # [E, 2I(, groups)] interleaved
    if name.endswith(".experts.down_proj") and not packed:  # [E, I, H] → [E, H, I]
        return name, tensor[:].transpose(1, 2)
    return name, tensor


class GptOssForCausalLM(MoeForCausalLM):
    decoder_layer = DecoderLayer
    moe_fields = ("num_local_experts", "num_experts_per_tok", "intermediate_size")

    @classmethod
    def tensor_parallel_error(cls, config, tp_size: int) -> str | None:
        return (registry.experts_split_error(config, config.intermediate_size, tp_size)
                or super().tensor_parallel_error(config, tp_size))

    @classmethod
    def layer_specs(cls, config, tp_size: int = 1) -> list[LayerSpec]:
        return [dataclasses.replace(s, sinks=True)
                for s in super().layer_specs(config, tp_size)]

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        super().load_weights(checkpoint_tensor(name, t) for name, t in weights)


def _rules(f: dict[str, Any], model_type: str, where: str) -> None:
    """Windows on the layers ``layer_types`` names (default: sliding, full, sliding, ...);
    expert fields and the SwiGLU clamp checked."""
    check_experts(f, where)
    check_int(f, "sliding_window", where)
    if f.get("layer_types") is None:
        f["layer_types"] = [LAYER_TYPES[i % 2] for i in range(f["num_hidden_layers"])]
    types = f["layer_types"]
    if not isinstance(types, list) or len(types) != f["num_hidden_layers"] \
            or any(t not in LAYER_TYPES for t in types):
        raise PagedgenError(f"{where}: layer_types must list sliding_attention or "
                            f"full_attention for each of the {f['num_hidden_layers']} layers")
    for key in ("swiglu_alpha", "swiglu_limit"):
        if isinstance(f[key], bool) or not isinstance(f[key], (int, float)) or f[key] <= 0:
            raise PagedgenError(f"{where}: {key} must be a positive number")


register(ModelFamily(
    name="gpt_oss",
    model_types={"gpt_oss": dict(
        vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=36,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, sliding_window=128,
        max_position_embeddings=131072, rms_norm_eps=1e-5, attention_bias=True,
        num_local_experts=128, num_experts_per_tok=4, swiglu_alpha=1.702, swiglu_limit=7.0,
        layer_types=None, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
        rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096, "rope_theta": 150000.0})},
    model_cls=GptOssForCausalLM,
    normalize=_rules))
