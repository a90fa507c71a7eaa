"""The Llama family (Llama 2/3, Mistral, Qwen2/2.5, Qwen3) over a flat token batch.

Module and parameter names follow Hugging Face's, except that q/k/v and gate/up projections are
fused (``qkv_proj``, ``gate_up_proj``) as in vLLM; ``load_weights`` maps checkpoint names onto them.
Registered for model types llama, mistral, qwen2 and qwen3, with the defaults of transformers'
config classes and each one's sliding-window rules.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedgen.attention.backend import AttentionImpl, AttentionType, LayerSpec
from pagedgen.attention.metadata import AttentionMetadata
from pagedgen.errors import PagedgenError
from pagedgen.runtime.collectives.parallel import TensorParallel
from pagedgen.runtime.collectives.sharding import Segment, split
from pagedgen.runtime.layers.activation import SiluAndMul
from pagedgen.runtime.layers.attention import PagedAttention
from pagedgen.runtime.layers.embedding import VocabParallelEmbedding
from pagedgen.runtime.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedgen.runtime.layers.norm import RMSNorm
from pagedgen.runtime.layers.rotary import ApplyRotary, RotaryEmbedding, rotary_dim
from pagedgen.runtime.models.registry import ModelFamily, register
from pagedgen.runtime.models.weights import load_checkpoint
from pagedgen.runtime.quantization.config import QuantConfig, linear_method


def num_kv_heads(config) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def kv_segment(config, spec: LayerSpec, tp: TensorParallel) -> Segment:
    """This rank's rows of k_proj (or v_proj): its KV heads, or the one it replicates when
    there are fewer heads than ranks."""
    d = spec.head_size
    first = (tp.rank * num_kv_heads(config) // tp.size) * d
    return Segment(None, num_kv_heads(config) * d, first, spec.num_kv_heads * d, 0)


class Attention(nn.Module):
    def __init__(self, config, spec: LayerSpec, tp: TensorParallel,
                 quant: QuantConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        self.spec = spec
        h, d = config.hidden_size, spec.head_size
        self.q_size, self.kv_size = spec.num_heads * d, spec.num_kv_heads * d
        bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = bias or config.model_type == "qwen2" or bool(getattr(config, "qkv_bias",
                                                                        False))
        q = split(config.num_attention_heads * d, tp, "query features")
        kv = kv_segment(config, spec, tp)
        self.qkv_proj = ColumnParallelLinear(
            h, [("q", q), ("k", kv), ("v", kv)], qkv_bias,
            linear_method(quant, prefix, ["q_proj", "k_proj", "v_proj"]))
        self.o_proj = RowParallelLinear(config.num_attention_heads * d, h,
                                        bias and config.model_type != "qwen2", tp,
                                        linear_method(quant, prefix, ["o_proj"]))
        self.qk_norm = config.model_type in ("qwen3", "qwen3_moe")
        if self.qk_norm:  # per-head RMSNorm of q and k before rotary (applied by the rotary op)
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.rotary = ApplyRotary()
        self.attn = PagedAttention(spec)
        if spec.sinks:  # one per query head: this rank's heads' sinks
            self.attn.shards = {"sinks": (0, [split(config.num_attention_heads, tp,
                                                    "attention heads")])}

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        s = self.spec
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, s.num_heads, s.head_size)
        k = k.reshape(-1, s.num_kv_heads, s.head_size)
        v = v.reshape(-1, s.num_kv_heads, s.head_size)
        norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else ()
        q, k = self.rotary(q, k, cos_sin, norms)
        o = self.attn(q, k, v, kv_cache, metadata)
        return self.o_proj(o.reshape(-1, self.q_size))


class MLP(nn.Module):
    """SwiGLU of ``intermediate`` features (default: the config's ``intermediate_size``)."""

    def __init__(self, config, tp: TensorParallel, quant: QuantConfig | None = None,
                 prefix: str = "", intermediate: int | None = None,
                 field: str = "intermediate_size") -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        width = intermediate or config.intermediate_size
        inter = split(width, tp, field)
        self.gate_up_proj = ColumnParallelLinear(
            config.hidden_size, [(0, inter), (1, inter)], bias,
            linear_method(quant, prefix, ["gate_proj", "up_proj"]))
        self.down_proj = RowParallelLinear(width, config.hidden_size, bias, tp,
                                           linear_method(quant, prefix, ["down_proj"]))
        self.act = SiluAndMul()

    def takes_quantized_input(self, m: int) -> bool:
        """Whether the norm before it should hand it FP8 activations (at ``m`` rows)."""
        return self.gate_up_proj.quant_method.takes_quantized_input(self.gate_up_proj, m)

    def forward(self, x) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        down = self.down_proj
        quant = self.act.fused and down.quant_method.takes_quantized_input(down, gate_up.shape[0])
        return down(self.act(gate_up, quant))

    def partial_sums(self, gate_up: torch.Tensor) -> torch.Tensor:
        """This rank's partial sums of the MLP's output from its gate/up projection's output
        (``gate_up_proj(x)``, or its rows of a merged GEMM's): not reduced, not in the
        symmetric buffer (a block that adds them to another output reduces the sum once)."""
        down = self.down_proj
        return down.quant_method.apply(down, self.act(gate_up), None)


class DecoderLayer(nn.Module):
    def __init__(self, config, spec: LayerSpec, tp: TensorParallel,
                 quant: QuantConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        self.self_attn = Attention(config, spec, tp, quant, f"{prefix}.self_attn")
        self.mlp = self.make_mlp(config, tp, quant, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def make_mlp(self, config, tp: TensorParallel, quant: QuantConfig | None,
                 prefix: str) -> nn.Module:
        """This layer's MLP (a MoE family's layers make theirs: ``prefix`` ends with the
        layer's index)."""
        return MLP(config, tp, quant, prefix)

    def forward(self, cos_sin, x: torch.Tensor, residual: torch.Tensor | None, kv_cache,
                metadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it); the next layer's input norm
        adds the two (so each residual add shares a kernel with a norm)."""
        qkv = self.self_attn.qkv_proj
        quant = self.input_layernorm.fused and qkv.quant_method.takes_quantized_input(
            qkv, x.shape[0])  # the norm's output quantized for an FP8 layer, in its kernel
        if residual is None:
            h, residual = self.input_layernorm(x, None, quant), x
        else:
            h, residual = self.input_layernorm(x, residual, quant)
        h = self.self_attn(cos_sin, h, kv_cache, metadata)
        quant = self.post_attention_layernorm.fused and self.mlp.takes_quantized_input(h.shape[0])
        h, residual = self.post_attention_layernorm(h, residual, quant)
        return self.mlp(h), residual


class Model(nn.Module):
    """Embedding, ``lm_cls.decoder_layer`` per layer (shaped by ``lm_cls.layer_specs``), final
    norm: the families built on Llama's share it."""

    def __init__(self, config, tp: TensorParallel, quant: QuantConfig | None, lm_cls) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            lm_cls.decoder_layer(config, s, tp, quant, f"model.layers.{i}")
            for i, s in enumerate(lm_cls.decoder_specs(config, tp.size)))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM: ``forward`` → hidden states, ``compute_logits`` → logits.
    With a tensor-parallel group of more than one rank, this is one rank's shard
    (runtime/collectives/sharding.py); logits are gathered in full on every rank."""

    decoder_layer = DecoderLayer  # a family on Llama's skeleton names its own layer
    # checkpoint name → (our fused parameter, shard id)
    STACKED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
               "v_proj": ("qkv_proj", "v"), "gate_proj": ("gate_up_proj", 0),
               "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config, tp: TensorParallel | None = None,
                 quant: QuantConfig | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp or TensorParallel()
        self.model = Model(config, self.tp, quant, type(self))
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:  # the same vocabulary split as the embedding
            self.lm_head = VocabParallelEmbedding(config.vocab_size, config.hidden_size, self.tp)
        self.rotary: RotaryEmbedding | None = None

    @classmethod
    def tensor_parallel_error(cls, config, tp_size: int) -> str | None:
        """Why the model cannot be sharded over ``tp_size`` ranks, or None."""
        heads, kv_heads = config.num_attention_heads, num_kv_heads(config)
        if heads % tp_size:
            return f"{heads} attention heads cannot be split over {tp_size} tensor-parallel ranks"
        if kv_heads % tp_size and tp_size % kv_heads:
            return (f"{kv_heads} KV heads cannot be split over (or replicated on) {tp_size} "
                    f"tensor-parallel ranks")
        if config.intermediate_size % tp_size:
            return (f"intermediate_size {config.intermediate_size} cannot be split over "
                    f"{tp_size} tensor-parallel ranks")
        return None

    @classmethod
    def layer_specs(cls, config, tp_size: int = 1) -> list[LayerSpec]:
        """The attention shape of every layer on one of ``tp_size`` tensor-parallel ranks (its
        share of the query heads; of the KV heads, or one replicated KV head when there are
        fewer KV heads than ranks), including per-layer sliding windows."""
        why = cls.tensor_parallel_error(config, tp_size)
        if why:
            raise ValueError(why)
        head_dim = getattr(config, "head_dim", None) \
            or config.hidden_size // config.num_attention_heads
        heads, kv_heads = config.num_attention_heads, num_kv_heads(config)
        layer_types = getattr(config, "layer_types", None)
        specs = []
        for i in range(config.num_hidden_layers):
            if layer_types:
                window = config.sliding_window if layer_types[i] == "sliding_attention" else None
            else:  # Mistral: one window for every layer
                window = getattr(config, "sliding_window", None)
            specs.append(LayerSpec(
                num_heads=heads // tp_size, num_kv_heads=max(1, kv_heads // tp_size),
                head_size=head_dim, scale=head_dim ** -0.5, sliding_window=window,
                logits_soft_cap=getattr(config, "attn_logit_softcapping", None),
                attn_type=AttentionType.DECODER))
        return specs

    @classmethod
    def decoder_specs(cls, config, tp_size: int = 1) -> list[LayerSpec | None]:
        """Each decoder layer's attention spec, None for a layer whose token mixer keeps a
        recurrent state instead of paged K/V (a hybrid family's linear attention)."""
        return cls.layer_specs(config, tp_size)

    @classmethod
    def state_specs(cls, config, tp_size: int = 1) -> list:
        """The recurrent-state shape of each linear-attention layer (none here)."""
        return []

    def bind_recurrent(self, impls: list, states: list) -> None:
        """Each linear-attention layer's core and its state slots (none here)."""

    def use_fused_kernels(self, enabled: bool) -> None:
        """Norms, rotary and activation as fused Triton kernels (True) or torch ops (False)."""
        for m in self.modules():
            if hasattr(m, "fused"):
                m.fused = enabled

    def defer_all_reduces(self) -> None:
        """Under -tp: each row-parallel projection (o_proj, a dense MLP's down_proj) that a
        residual RMSNorm follows leaves its partial sums to that norm, which reduces them in
        the same step (``TensorParallel.all_reduce_add_rms_norm``: one kernel where the fused
        all-reduce runs); so does a MoE block. Layers of other shapes (Gemma's norms) keep
        theirs."""
        if self.tp.size == 1:
            return
        layers = list(self.model.layers)
        follows = [layer.input_layernorm for layer in layers[1:]] + [self.model.norm]
        for layer, next_norm in zip(layers, follows):
            if type(layer).forward is not DecoderLayer.forward:
                continue
            o_proj = layer.self_attn.o_proj
            if o_proj.bias is None:
                o_proj.defer_reduce = True
                layer.post_attention_layernorm.reduce = self.tp
            mlp = layer.mlp
            last = mlp.down_proj if isinstance(mlp, MLP) else mlp  # a MoE block: itself
            if hasattr(last, "defer_reduce") and getattr(last, "bias", None) is None:
                last.defer_reduce = True
                next_norm.reduce = self.tp

    def setup_rotary(self, max_positions: int, device: torch.device) -> None:
        spec = self.model.layers[0].self_attn.spec
        dim = rotary_dim(self.config.rope_parameters, spec.head_size)  # Phi-4-mini: 3/4
        self.rotary = RotaryEmbedding(self.config, dim, max_positions, device)

    def bind_attention(self, impls: list[AttentionImpl]) -> None:
        for layer, impl in zip(self.model.layers, impls, strict=True):
            layer.self_attn.attn.impl = impl

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The step's input embeddings (a family may scale them)."""
        return self.model.embed_tokens(input_ids)

    def rotary_tables(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's cos/sin for the step (one table for every layer here)."""
        return [self.rotary.lookup(positions)] * len(self.model.layers)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], metadata: AttentionMetadata) -> torch.Tensor:
        x = self.embed(input_ids)
        residual = None
        for layer, cache, cos_sin in zip(self.model.layers, kv_caches,
                                         self.rotary_tables(positions)):
            x, residual = layer(cos_sin, x, residual, cache, metadata)
        return self.model.norm(x, residual)[0]

    def step_weight_bytes(self, tokens: int = 1) -> int:
        """Weight bytes a forward of ``tokens`` tokens reads: every parameter but the embedding
        table, of which a step reads only its tokens' rows (a tied table is read in full as
        the LM head); of a MoE layer's experts, those its tokens are expected to choose."""
        skip = None if self.tie_word_embeddings else self.model.embed_tokens.weight
        total = sum(p.numel() * p.element_size() for p in self.parameters() if p is not skip)
        for m in self.modules():
            if hasattr(m, "expected_expert_bytes"):
                total += m.expected_expert_bytes(tokens) - sum(
                    p.numel() * p.element_size() for p in m.parameters())
        return int(total)

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        head = self.model.embed_tokens if self.tie_word_embeddings else self.lm_head
        return head.logits(hidden, float32)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Checkpoint tensors into our parameters (``weights.load_checkpoint``)."""
        tied = self.tie_word_embeddings
        load_checkpoint(self, weights, self.STACKED, lambda name: "rotary_emb" in name
                        or (tied and name == "lm_head.weight"))


# ---- registration: config defaults (as transformers' config classes give them) and rules ----

_QWEN = dict(vocab_size=151936, intermediate_size=22016, num_key_value_heads=32,
             max_position_embeddings=32768, use_sliding_window=False, sliding_window=4096,
             max_window_layers=28, bos_token_id=None, eos_token_id=None)
_LAYER_TYPES = ("full_attention", "sliding_attention")


def _windows(f: dict[str, Any], model_type: str, where: str) -> None:
    """Sliding windows as each model type's modeling code applies them: none for Llama, one
    for every layer for Mistral, per ``layer_types`` for Qwen2/Qwen3."""
    if model_type == "llama":
        f.pop("sliding_window", None)
        f.pop("layer_types", None)
    elif model_type == "mistral":
        f.pop("layer_types", None)
    else:
        f["sliding_window"] = f["sliding_window"] if f["use_sliding_window"] else None
        if f.get("layer_types") is None:
            f["layer_types"] = [
                "sliding_attention" if f["sliding_window"] is not None
                and i >= f["max_window_layers"] else "full_attention"
                for i in range(f["num_hidden_layers"])]
        types = f["layer_types"]
        if (not isinstance(types, list) or len(types) != f["num_hidden_layers"]
                or any(t not in _LAYER_TYPES for t in types)):
            raise PagedgenError(f"{where}: layer_types must list one of "
                                f"{', '.join(_LAYER_TYPES)} for each of the "
                                f"{f['num_hidden_layers']} layers")
    check_window(f, where)


def check_window(f: dict[str, Any], where: str) -> None:
    """``sliding_window``: a positive integer or null."""
    window = f.get("sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window <= 0):
        raise PagedgenError(f"{where}: sliding_window must be a positive integer or null, "
                            f"not {window!r}")


register(ModelFamily(
    name="llama",
    model_types={
        "llama": dict(vocab_size=32000, intermediate_size=11008, num_key_value_heads=None,
                      max_position_embeddings=2048, bos_token_id=1, eos_token_id=2),
        "mistral": dict(vocab_size=32000, intermediate_size=14336, num_key_value_heads=8,
                        max_position_embeddings=131072, sliding_window=4096, bos_token_id=1,
                        eos_token_id=2),
        "qwen2": _QWEN,
        "qwen3": {**_QWEN, "head_dim": 128},
    },
    model_cls=LlamaForCausalLM,
    normalize=_windows))
