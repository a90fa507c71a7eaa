"""The Gemma 3 text family (``gemma3_text``): Gemma 2's layers with per-head q/k norms, local
and global layers with rope of their own (``rope_parameters`` per layer type: the local base
and the global one with its scaling), and no soft-caps by default.

Older config files give ``rope_theta`` (+ ``rope_scaling``) for the global layers and
``rope_local_base_freq`` for the local ones; both forms read alike.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from pagedgen.errors import PagedgenError
from pagedgen.runtime.collectives.parallel import TensorParallel
from pagedgen.runtime.layers.norm import RMSNorm
from pagedgen.runtime.layers.rotary import RotaryEmbedding
from pagedgen.runtime.models.families import gemma2, llama
from pagedgen.runtime.models.registry import ModelFamily, register
from pagedgen.runtime.quantization.config import QuantConfig

SLIDING, FULL = "sliding_attention", "full_attention"


class Attention(llama.Attention):
    """Llama's attention with Qwen3-style per-head q/k RMSNorm before rotary (Gemma's norms:
    loaded as ``1 + w`` by the model)."""

    def __init__(self, config, spec, tp: TensorParallel, quant: QuantConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__(config, spec, tp, quant, prefix)
        self.qk_norm = True
        self.q_norm = RMSNorm(spec.head_size, config.rms_norm_eps)
        self.k_norm = RMSNorm(spec.head_size, config.rms_norm_eps)


class DecoderLayer(gemma2.DecoderLayer):
    def __init__(self, config, spec, tp: TensorParallel, quant: QuantConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__(config, spec, tp, quant, prefix)
        self.self_attn = Attention(config, spec, tp, quant, f"{prefix}.self_attn")


class Gemma3ForCausalLM(gemma2.Gemma2ForCausalLM):
    """Gemma 3 text causal LM: a rotary table per layer type."""

    decoder_layer = DecoderLayer

    def __init__(self, config, tp: TensorParallel | None = None,
                 quant: QuantConfig | None = None) -> None:
        super().__init__(config, tp, quant)
        self.rotaries: dict[str, RotaryEmbedding] = {}

    def rotary_head(self, kind: str) -> int:
        """The head size the layers of ``kind`` rotate (one for every layer here)."""
        return self.model.layers[0].self_attn.spec.head_size

    def setup_rotary(self, max_positions: int, device: torch.device) -> None:
        """A table per layer type the layers use."""
        for kind, rope in self.config.rope_parameters.items():
            if kind not in self.config.layer_types:
                continue
            view = SimpleNamespace(rope_parameters=rope,
                                   max_position_embeddings=self.config.max_position_embeddings)
            self.rotaries[kind] = RotaryEmbedding(view, self.rotary_head(kind), max_positions,
                                                  device)

    def rotary_tables(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's cos/sin from its type's table (each table looked up once)."""
        tables = {kind: r.lookup(positions) for kind, r in self.rotaries.items()}
        return [tables[kind] for kind in self.config.layer_types]


def _rules(f: dict[str, Any], model_type: str, where: str) -> None:
    """Rope per layer type (from either form), then Gemma 2's rules (layer_types default: five
    local layers, then a global one, as transformers' Gemma3TextConfig fills it in)."""
    rope = f["rope_parameters"]
    local = f.pop("rope_local_base_freq", None)
    if "rope_type" in rope:  # one mapping: the global layers'; the local ones' base apart
        f["rope_parameters"] = {SLIDING: {"rope_type": "default",
                                          "rope_theta": local if local is not None else 10000.0},
                                FULL: rope}
    missing = {SLIDING, FULL} - set(f["rope_parameters"])
    if missing:
        raise PagedgenError(f"{where}: rope_parameters has no {', '.join(sorted(missing))}")
    if f.get("layer_types") is None:
        pattern = f.get("sliding_window_pattern") or 6
        f["layer_types"] = [FULL if (i + 1) % pattern == 0 else SLIDING
                            for i in range(f["num_hidden_layers"])]
    gemma2.check(f, where)


register(ModelFamily(
    name="gemma3",
    model_types={"gemma3_text": dict(
        vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_act=gemma2.GELU,
        hidden_activation=gemma2.GELU, max_position_embeddings=131072,
        query_pre_attn_scalar=256, sliding_window=4096, final_logit_softcapping=None,
        attn_logit_softcapping=None, tie_word_embeddings=True, bos_token_id=2, eos_token_id=1,
        rope_theta=1_000_000.0)},
    model_cls=Gemma3ForCausalLM,
    normalize=_rules,
    activations=(gemma2.GELU,)))
