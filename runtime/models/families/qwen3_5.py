"""The Qwen3.5 families: ``qwen3_5_text`` (dense: Qwen3.5-9B, 27B) and ``qwen3_5_moe_text``
(Qwen3.5-35B-A3B, 122B-A10B, 397B-A17B) on Qwen3-Next's hybrid skeleton (``qwen3_next.py``:
three Gated DeltaNet layers to one gated full-attention layer). The dense model's every layer
has a SwiGLU MLP; the MoE model's every layer has routed experts (top-k weights always
renormalized) beside a gated shared expert. Their checkpoints hold the linear-attention
projections apart (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``).

The published checkpoints are multimodal (``qwen3_5`` / ``qwen3_5_moe``:
``Qwen3_5ForConditionalGeneration``): pagedgen runs their language model on text prompts, read
from ``text_config`` and the ``model.language_model.*`` tensors (the vision tower's are not
read). The multimodal rotary (``mrope_section``) turns every section by the same text position,
which is plain rotary.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from pagedgen.runtime.collectives.parallel import TensorParallel
from pagedgen.runtime.models.families import llama
from pagedgen.runtime.models.families.qwen2_moe import shared_expert_moe
from pagedgen.runtime.models.families.qwen3_moe import check_experts
from pagedgen.runtime.models.families.qwen3_next import HYBRID, HybridForCausalLM, check_hybrid
from pagedgen.runtime.models.hf_config import check_int
from pagedgen.runtime.models.registry import ModelFamily, register
from pagedgen.runtime.quantization.config import QuantConfig


class Qwen3_5ForCausalLM(HybridForCausalLM):
    @classmethod
    def make_mlp(cls, config, tp: TensorParallel, quant: QuantConfig | None,
                 prefix: str) -> nn.Module:
        if config.model_type == "qwen3_5_moe_text":
            return shared_expert_moe(config, tp, quant, prefix, renormalize=True)
        return llama.MLP(config, tp, quant, prefix)


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
    multimodal={"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}))
