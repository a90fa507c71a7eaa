"""The Gemma 2 family: Llama's attention and projections, with what Gemma 2 adds.

* RMSNorm scaled by ``1 + w``: the checkpoint's ``w`` is loaded as ``1 + w`` into our RMSNorm
  (float32 math agrees exactly; in bf16 the weight multiplies the rounded normed value, as for
  Llama, where Gemma multiplies before rounding);
* four norms a layer: before and after attention, before and after the MLP;
* the embedding scaled by ``sqrt(hidden_size)`` (in the activation dtype, as transformers does);
* attention scores scaled by ``query_pre_attn_scalar ** -0.5`` and soft-capped
  (``attn_logit_softcapping``), every other layer (``layer_types``) within a sliding window;
* GeGLU (``gelu_pytorch_tanh``) in the MLP, and the final logits soft-capped.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedgen.attention.backend import AttentionType, LayerSpec
from pagedgen.errors import PagedgenError
from pagedgen.runtime.collectives.parallel import TensorParallel
from pagedgen.runtime.layers.activation import GeluTanhAndMul
from pagedgen.runtime.layers.norm import RMSNorm
from pagedgen.runtime.models.families import llama
from pagedgen.runtime.models.registry import ModelFamily, register
from pagedgen.runtime.quantization.config import QuantConfig

GELU = "gelu_pytorch_tanh"


class MLP(llama.MLP):
    """Llama's fused gate/up and down projections around GeGLU."""

    def __init__(self, config, tp: TensorParallel, quant: QuantConfig | None = None,
                 prefix: str = "", intermediate: int | None = None) -> None:
        super().__init__(config, tp, quant, prefix, intermediate)
        self.act = GeluTanhAndMul()

    def forward(self, x) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config, spec: LayerSpec, tp: TensorParallel,
                 quant: QuantConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        self.self_attn = llama.Attention(config, spec, tp, quant, f"{prefix}.self_attn")
        self.mlp = MLP(config, tp, quant, f"{prefix}.mlp")
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.pre_feedforward_layernorm = RMSNorm(h, eps)
        self.post_feedforward_layernorm = RMSNorm(h, eps)

    def forward(self, cos_sin, x: torch.Tensor, residual: torch.Tensor | None, kv_cache,
                metadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's normed MLP output, the residual stream before it), as Llama's layer:
        the next norm adds the two."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(cos_sin, h, kv_cache, metadata))
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Gemma2ForCausalLM(llama.LlamaForCausalLM):
    """Gemma 2 causal LM (Llama's skeleton and tensor parallel, Gemma's layers)."""

    decoder_layer = DecoderLayer

    def __init__(self, config, tp: TensorParallel | None = None,
                 quant: QuantConfig | None = None) -> None:
        super().__init__(config, tp, quant)
        self.final_soft_cap = config.final_logit_softcapping

    @classmethod
    def layer_specs(cls, config, tp_size: int = 1) -> list[LayerSpec]:
        """Llama's shapes, with Gemma's score scale and soft-cap, and its windows."""
        why = cls.tensor_parallel_error(config, tp_size)
        if why:
            raise ValueError(why)
        kv = llama.num_kv_heads(config)
        return [LayerSpec(num_heads=config.num_attention_heads // tp_size,
                          num_kv_heads=max(1, kv // tp_size), head_size=config.head_dim,
                          scale=config.query_pre_attn_scalar ** -0.5,
                          sliding_window=config.sliding_window if t == "sliding_attention"
                          else None,
                          logits_soft_cap=config.attn_logit_softcapping,
                          attn_type=AttentionType.DECODER)
                for t in config.layer_types]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return scaled(self.model.embed_tokens(input_ids), self.config.hidden_size)

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        # the soft cap's tanh runs in float32 whatever the caller asks
        logits = super().compute_logits(hidden, float32 or bool(self.final_soft_cap))
        if self.final_soft_cap:
            cap = self.final_soft_cap
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Llama's loading; then every norm's ``w`` becomes ``1 + w``."""
        super().load_weights(weights)
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, RMSNorm):
                    m.weight.add_(1.0)


def scaled(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Embeddings ``x`` times ``sqrt(dim)``, the scale rounded to their dtype first, as
    transformers does."""
    return x * torch.tensor(math.sqrt(dim), dtype=x.dtype).item()


_LAYER_TYPES = ("full_attention", "sliding_attention")


def _rules(f: dict[str, Any], model_type: str, where: str) -> None:
    """Gemma 2's layers alternate, the first sliding (transformers' default ``layer_types``)."""
    if f.get("layer_types") is None:
        f["layer_types"] = [_LAYER_TYPES[(i + 1) % 2] for i in range(f["num_hidden_layers"])]
    check(f, where)


def check(f: dict[str, Any], where: str) -> None:
    """The fields Gemma 2 and 3 share: activation, layer types, scales, soft-caps."""
    if f.get("hidden_activation", GELU) != GELU:
        raise PagedgenError(f"{where}: hidden_activation '{f['hidden_activation']}' is not "
                            f"supported ({GELU})")
    types = f["layer_types"]
    if (not isinstance(types, list) or len(types) != f["num_hidden_layers"]
            or any(t not in _LAYER_TYPES for t in types)):
        raise PagedgenError(f"{where}: layer_types must list one of {', '.join(_LAYER_TYPES)} "
                            f"for each of the {f['num_hidden_layers']} layers")
    for key in ("sliding_window", "query_pre_attn_scalar"):
        v = f[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise PagedgenError(f"{where}: {key} must be a positive number, not {v!r}")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        v = f[key]
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
            raise PagedgenError(f"{where}: {key} must be a positive number or null, not {v!r}")


register(ModelFamily(
    name="gemma2",
    model_types={"gemma2": dict(
        vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_act=GELU,
        hidden_activation=GELU, max_position_embeddings=8192, query_pre_attn_scalar=256,
        sliding_window=4096, final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
        tie_word_embeddings=True, bos_token_id=2, eos_token_id=1)},
    model_cls=Gemma2ForCausalLM,
    normalize=_rules,
    activations=(GELU,)))
