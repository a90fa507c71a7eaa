"""The Qwen3-MoE family (``qwen3_moe``: Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention
(per-head q/k norms) and, in every ``decoder_sparse_step``-th layer not listed in
``mlp_only_layers``, a mixture of ``num_experts`` SwiGLU experts of ``moe_intermediate_size``,
``num_experts_per_tok`` per token (their softmax weights renormalized when
``norm_topk_prob``); the other layers keep a dense MLP of ``intermediate_size``. A
``sliding_window`` (with ``use_sliding_window``) applies to every layer, as transformers'
Qwen3-MoE attention applies it.

``MoeForCausalLM`` is the skeleton the MoE families share: Llama's, with the MLP each layer's
config asks for; under FP8 (a checkpoint's or ``--quantization fp8``) the experts are FP8 unless
the checkpoint leaves them dense, and the router stays in the model's dtype.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from pagedgen.errors import PagedgenError
from pagedgen.runtime.collectives.parallel import TensorParallel
from pagedgen.runtime.layers.moe.layer import HF_NAMES, SparseMoeBlock
from pagedgen.runtime.models.families import llama
from pagedgen.runtime.models.hf_config import check_int
from pagedgen.runtime.models.registry import ModelFamily, register
from pagedgen.runtime.quantization.config import QuantConfig


def layer_index(prefix: str) -> int:
    """The layer index in a prefix under it (``model.layers.{i}.mlp``)."""
    return int(prefix.split(".layers.", 1)[1].split(".", 1)[0])


class MoeForCausalLM(llama.LlamaForCausalLM):
    """Llama's skeleton for MoE families: ``moe_fields`` names the config's expert count,
    top-k and expert width; a family's layer decides which layers are sparse."""

    moe_fields = ("num_local_experts", "num_experts_per_tok", "moe_intermediate_size")
    expert_names = HF_NAMES  # the checkpoint's per-expert tensor names

    @classmethod
    def tensor_parallel_error(cls, config, tp_size: int) -> str | None:
        width = getattr(config, cls.moe_fields[2])
        if width % tp_size:
            return (f"{cls.moe_fields[2]} {width} cannot be split over {tp_size} "
                    f"tensor-parallel ranks")
        return super().tensor_parallel_error(config, tp_size)

    @classmethod
    def moe_block(cls, config, tp: TensorParallel, quant: QuantConfig | None,
                  prefix: str) -> SparseMoeBlock:
        """The layer's experts under ``prefix`` (``model.layers.{i}.mlp``), FP8 as ``quant``
        says for the checkpoint's expert tensors."""
        experts, top_k, width = (getattr(config, f) for f in cls.moe_fields)
        names = [f"{prefix}.experts.{e}.{n}" for e in range(experts)
                 for n in cls.expert_names.values()]
        return SparseMoeBlock(config.hidden_size, experts, top_k, width,
                              bool(getattr(config, "norm_topk_prob", True)), tp,
                              cls.expert_names, quant.moe_method_for(names) if quant else None)


def is_sparse(config, i: int) -> bool:
    """Whether layer ``i`` holds experts (transformers' Qwen3-MoE rule)."""
    return (i not in config.mlp_only_layers and config.num_local_experts > 0
            and (i + 1) % config.decoder_sparse_step == 0)


class DecoderLayer(llama.DecoderLayer):
    def make_mlp(self, config, tp: TensorParallel, quant: QuantConfig | None,
                 prefix: str) -> nn.Module:
        if is_sparse(config, layer_index(prefix)):
            return Qwen3MoeForCausalLM.moe_block(config, tp, quant, prefix)
        return llama.MLP(config, tp, quant, prefix)


class Qwen3MoeForCausalLM(MoeForCausalLM):
    decoder_layer = DecoderLayer


def check_experts(f: dict[str, Any], where: str) -> None:
    """The expert count as ``num_local_experts`` (files name it so or ``num_experts``, which
    transformers maps onto it; may be 0: no sparse layer), top-k within it."""
    if "num_experts" in f:  # the defaults hold num_local_experts: this came from the file
        f["num_local_experts"] = f.pop("num_experts")
    n = check_int(f, "num_local_experts", where, zero=True)
    k = check_int(f, "num_experts_per_tok", where)
    if n and k > n:
        raise PagedgenError(f"{where}: num_experts_per_tok ({k}) exceeds the number of "
                            f"experts ({n})")


def _rules(f: dict[str, Any], model_type: str, where: str) -> None:
    """One window for every layer when ``use_sliding_window``; expert fields checked; shared
    experts (Qwen2-MoE's) are not part of this family."""
    f.pop("layer_types", None)
    if not f.get("use_sliding_window"):
        f["sliding_window"] = None
    llama.check_window(f, where)
    check_experts(f, where)
    check_int(f, "moe_intermediate_size", where)
    check_int(f, "decoder_sparse_step", where)
    if f.get("shared_expert_intermediate_size"):
        raise PagedgenError(f"{where}: shared_expert_intermediate_size: shared experts are "
                            f"not supported for {model_type}")
    only = f["mlp_only_layers"] if f.get("mlp_only_layers") is not None else []
    if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int)
                                         for i in only):
        raise PagedgenError(f"{where}: mlp_only_layers must be a list of layer indices")
    f["mlp_only_layers"] = only


register(ModelFamily(
    name="qwen3_moe",
    model_types={"qwen3_moe": dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
        num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=32768,
        use_sliding_window=False, sliding_window=4096, decoder_sparse_step=1,
        moe_intermediate_size=768, num_experts_per_tok=8, num_local_experts=128,
        norm_topk_prob=False, mlp_only_layers=None, bos_token_id=None, eos_token_id=None)},
    model_cls=Qwen3MoeForCausalLM,
    normalize=_rules))
