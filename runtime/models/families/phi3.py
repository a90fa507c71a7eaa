"""The Phi-3 family (``phi3``: Phi-3, Phi-3.5-mini, Phi-4): Llama's layers; the checkpoint
holds q/k/v and gate/up already fused (``qkv_proj``, ``gate_up_proj``), so loading splits
them into the parts our fused parameters shard by (each rank keeps its heads under -tp; the
fused tensor is read whole, then cut). A ``sliding_window`` applies to every layer, as
transformers' Phi-3 attention applies it. LongRoPE (``longrope``, or ``su`` in older files: the
128k Phi-3 and Phi-3.5 variants) runs (``layers/rotary.py``), and so does partial rotary
(Phi-4-mini: ``partial_rotary_factor`` 0.75; the rest of each head passes through).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from pagedgen.runtime.models.families import llama
from pagedgen.runtime.models.registry import ModelFamily, register


class Phi3ForCausalLM(llama.LlamaForCausalLM):
    """Phi-3 causal LM: Llama's, loaded from fused checkpoint tensors."""

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        super().load_weights(self._unfused(weights))

    def _unfused(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """``qkv_proj`` as ``q_proj``/``k_proj``/``v_proj``, ``gate_up_proj`` as
        ``gate_proj``/``up_proj`` (rows; biases too), every other tensor as it is."""
        c = self.config
        d = c.head_dim
        q, kv = c.num_attention_heads * d, llama.num_kv_heads(c) * d
        parts = {".self_attn.qkv_proj.": (("q_proj", q), ("k_proj", kv), ("v_proj", kv)),
                 ".mlp.gate_up_proj.": (("gate_proj", c.intermediate_size),
                                        ("up_proj", c.intermediate_size))}
        for name, tensor in weights:
            fused = next((k for k in parts if k in name), None)
            if fused is None:
                yield name, tensor
                continue
            whole = tensor[:]
            want = sum(n for _, n in parts[fused])
            if whole.shape[0] != want:
                raise ValueError(f"tensor '{name}' has {whole.shape[0]} rows; the config makes "
                                 f"it {want}")
            start = 0
            for part, rows in parts[fused]:
                yield (name.replace(fused, f"{fused.rsplit('.', 2)[0]}.{part}."),
                       whole[start:start + rows])
                start += rows


def _rules(f: dict[str, Any], model_type: str, where: str) -> None:
    """One window for every layer (or none); the rope mapping states its (full) rotary
    fraction and, for a scaled rope, takes the config's own ``original_max_position_embeddings``
    (default 4096) over its own, as transformers' Phi3Config does."""
    f.pop("layer_types", None)
    rope = f["rope_parameters"]
    rope.setdefault("partial_rotary_factor", 1.0)
    if rope["rope_type"] in ("llama3", "yarn", "longrope"):
        rope["original_max_position_embeddings"] = f["original_max_position_embeddings"]
    llama.check_window(f, where)


register(ModelFamily(
    name="phi3",
    model_types={"phi3": dict(
        vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=None, max_position_embeddings=4096,
        original_max_position_embeddings=4096, rms_norm_eps=1e-5, sliding_window=None,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=32000)},
    model_cls=Phi3ForCausalLM,
    normalize=_rules,
    partial_rotary=True))
