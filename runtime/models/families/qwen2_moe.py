"""The Qwen2-MoE family (``qwen2_moe``: Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention
(biased q/k/v, ``qkv_bias``), and in each sparse layer (Qwen3-MoE's rule: every
``decoder_sparse_step``-th layer outside ``mlp_only_layers``) ``num_experts`` routed SwiGLU
experts of ``moe_intermediate_size``, ``num_experts_per_tok`` a token (renormalized when
``norm_topk_prob``), beside a shared expert of ``shared_expert_intermediate_size`` scaled by
its sigmoid gate (``layers/moe/shared.py``). Sliding windows follow Qwen2-MoE's own rule: the
even layers below ``max_window_layers`` when ``use_sliding_window``, unless ``layer_types``
lists them. FP8 quantizes the routed and the shared experts; the router and the shared
expert's gate stay in the model's dtype.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from pagedgen.errors import PagedgenError
from pagedgen.runtime.collectives.parallel import TensorParallel
from pagedgen.runtime.layers.moe.shared import SharedExpertMoeBlock
from pagedgen.runtime.models.families import llama
from pagedgen.runtime.models.families.qwen3_moe import (
    MoeForCausalLM,
    check_experts,
    is_sparse,
    layer_index,
)
from pagedgen.runtime.models.hf_config import check_int
from pagedgen.runtime.models.registry import ModelFamily, register
from pagedgen.runtime.quantization.config import QuantConfig


def shared_expert_moe(config, tp: TensorParallel, quant: QuantConfig | None, prefix: str,
                      renormalize: bool) -> SharedExpertMoeBlock:
    """The routed experts under ``prefix`` (``model.layers.{i}.mlp``) beside their shared
    expert (the families with Qwen2-MoE's block use it too)."""
    experts, top_k, width = (getattr(config, f) for f in MoeForCausalLM.moe_fields)
    names = [f"{prefix}.experts.{e}.{n}" for e in range(experts)
             for n in MoeForCausalLM.expert_names.values()]
    shared = llama.MLP(config, tp, quant, f"{prefix}.shared_expert",
                       config.shared_expert_intermediate_size, "shared_expert_intermediate_size")
    return SharedExpertMoeBlock(config.hidden_size, experts, top_k, width, renormalize, tp=tp,
                                method=quant.moe_method_for(names) if quant else None,
                                shared_expert=shared)


class DecoderLayer(llama.DecoderLayer):
    def make_mlp(self, config, tp: TensorParallel, quant: QuantConfig | None,
                 prefix: str) -> nn.Module:
        if not is_sparse(config, layer_index(prefix)):
            return llama.MLP(config, tp, quant, prefix)
        return shared_expert_moe(config, tp, quant, prefix, bool(config.norm_topk_prob))


class Qwen2MoeForCausalLM(MoeForCausalLM):
    decoder_layer = DecoderLayer

    @classmethod
    def tensor_parallel_error(cls, config, tp_size: int) -> str | None:
        width = config.shared_expert_intermediate_size
        if width % tp_size:
            return (f"shared_expert_intermediate_size {width} cannot be split over {tp_size} "
                    "tensor-parallel ranks")
        return super().tensor_parallel_error(config, tp_size)


def _rules(f: dict[str, Any], model_type: str, where: str) -> None:
    """Windows by Qwen2-MoE's rule; expert fields checked (the shared expert's width too)."""
    check_int(f, "max_window_layers", where, zero=True)
    if f.get("layer_types") is None:
        on = bool(f.get("use_sliding_window"))
        f["layer_types"] = ["sliding_attention" if on and i % 2 == 0
                            and i < f["max_window_layers"] else "full_attention"
                            for i in range(f["num_hidden_layers"])]
    if not f.get("use_sliding_window"):
        f["sliding_window"] = None
    if f["sliding_window"] is None:
        f["layer_types"] = ["full_attention"] * f["num_hidden_layers"]
    llama.check_window(f, where)
    check_shared_experts(f, where)


def check_shared_experts(f: dict[str, Any], where: str) -> None:
    """The expert fields of Qwen2-MoE's layout (Qwen3-Next's too): counts and widths, the
    shared expert's, which layers are sparse."""
    check_experts(f, where)
    check_int(f, "moe_intermediate_size", where)
    check_int(f, "shared_expert_intermediate_size", where)
    check_int(f, "decoder_sparse_step", where)
    only = f["mlp_only_layers"] if f.get("mlp_only_layers") is not None else []
    if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int)
                                         for i in only):
        raise PagedgenError(f"{where}: mlp_only_layers must be a list of layer indices")
    f["mlp_only_layers"] = only


register(ModelFamily(
    name="qwen2_moe",
    model_types={"qwen2_moe": dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
        num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=32768,
        use_sliding_window=False, sliding_window=4096, max_window_layers=28,
        decoder_sparse_step=1, moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632, num_experts_per_tok=4, num_local_experts=60,
        norm_topk_prob=False, mlp_only_layers=None, qkv_bias=True, bos_token_id=None,
        eos_token_id=None)},
    model_cls=Qwen2MoeForCausalLM,
    normalize=_rules))
