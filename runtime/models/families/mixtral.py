"""The Mixtral family (``mixtral``: Mixtral-8x7B, 8x22B): Mistral's attention and, in every
layer, ``num_local_experts`` SwiGLU experts of ``intermediate_size``, ``num_experts_per_tok``
per token with their softmax weights always renormalized. The checkpoint names the block
``block_sparse_moe`` and the experts' tensors ``w1`` (gate), ``w3`` (up), ``w2`` (down); we
hold it as ``mlp`` (as transformers 5 does) and name it as the checkpoint does in errors.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from pagedgen.runtime.collectives.parallel import TensorParallel
from pagedgen.runtime.layers.moe.layer import MIXTRAL_NAMES
from pagedgen.runtime.models.families import llama
from pagedgen.runtime.models.families.qwen3_moe import MoeForCausalLM, check_experts
from pagedgen.runtime.models.registry import ModelFamily, register
from pagedgen.runtime.quantization.config import QuantConfig

BLOCK, OURS = ".block_sparse_moe.", ".mlp."


class DecoderLayer(llama.DecoderLayer):
    def make_mlp(self, config, tp: TensorParallel, quant: QuantConfig | None,
                 prefix: str) -> nn.Module:
        return MixtralForCausalLM.moe_block(config, tp, quant,
                                             prefix.replace(OURS[:-1], BLOCK[:-1]))


class MixtralForCausalLM(MoeForCausalLM):
    decoder_layer = DecoderLayer
    moe_fields = ("num_local_experts", "num_experts_per_tok", "intermediate_size")
    expert_names = MIXTRAL_NAMES

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        try:
            super().load_weights((name.replace(BLOCK, OURS), t) for name, t in weights)
        except ValueError as e:
            raise ValueError(str(e).replace(OURS, BLOCK)) from None


def _rules(f: dict[str, Any], model_type: str, where: str) -> None:
    """Mistral's one window for every layer (or none); expert fields checked."""
    f.pop("layer_types", None)
    llama.check_window(f, where)
    check_experts(f, where)


register(ModelFamily(
    name="mixtral",
    model_types={"mixtral": dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096 * 32,
        rms_norm_eps=1e-5, sliding_window=None, num_experts_per_tok=2, num_local_experts=8,
        rope_theta=1_000_000.0, bos_token_id=1, eos_token_id=2)},
    model_cls=MixtralForCausalLM,
    normalize=_rules))
