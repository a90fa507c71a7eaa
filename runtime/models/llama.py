"""The Llama family (Llama 2/3, Mistral, Qwen2/2.5, Qwen3) over a flat token batch.

Module and parameter names follow Hugging Face's, except that q/k/v and gate/up projections are
fused (``qkv_proj``, ``gate_up_proj``) as in vLLM; ``load_weights`` maps checkpoint names onto them.
Attention goes through the selected backend's AttentionImpl (bound by the model runner).
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagedgen.attention.backend import (AttentionImpl, AttentionMetadata, AttentionType,
                                        LayerSpec)
from pagedgen.runtime.profiling import scope

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with scope("normalization"):
            dtype = x.dtype
            x = x.float()
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
            return self.weight * x.to(dtype)


class RotaryEmbedding:
    """Neox-style rotary embedding with cos/sin tables from transformers' own rope init
    (so rope_scaling types such as Llama 3's are computed exactly as Hugging Face does)."""

    def __init__(self, config, head_dim: int, max_positions: int, device: torch.device) -> None:
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        rope = LlamaRotaryEmbedding(config)
        inv_freq = rope.inv_freq.to(device, torch.float32)
        t = torch.arange(max_positions, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos() * rope.attention_scaling  # [max_positions, head_dim]
        self.sin = emb.sin() * rope.attention_scaling
        assert self.cos.shape[-1] == head_dim, "partial rotary is not supported"

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, head_dim] for a step's positions (looked up once, used by every layer)."""
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos_sin
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)


def layer_specs(config) -> list[LayerSpec]:
    """The attention shape of every layer, including per-layer sliding windows."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    layer_types = getattr(config, "layer_types", None)
    specs = []
    for i in range(config.num_hidden_layers):
        if layer_types:
            window = config.sliding_window if layer_types[i] == "sliding_attention" else None
        else:  # Mistral: one window for every layer
            window = getattr(config, "sliding_window", None)
        specs.append(LayerSpec(
            num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_size=head_dim, scale=head_dim ** -0.5, sliding_window=window,
            logits_soft_cap=getattr(config, "attn_logit_softcapping", None),
            attn_type=AttentionType.DECODER))
    return specs


class Attention(nn.Module):
    def __init__(self, config, spec: LayerSpec) -> None:
        super().__init__()
        self.spec = spec
        h, d = config.hidden_size, spec.head_size
        self.q_size, self.kv_size = spec.num_heads * d, spec.num_kv_heads * d
        bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = bias or config.model_type == "qwen2"
        self.qkv_proj = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, h, bias=bias and config.model_type != "qwen2")
        self.qk_norm = config.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.impl: AttentionImpl | None = None  # bound by the model runner

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        s = self.spec
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, s.num_heads, s.head_size)
        k = k.reshape(-1, s.num_kv_heads, s.head_size)
        v = v.reshape(-1, s.num_kv_heads, s.head_size)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        with scope("rotary"):
            q, k = apply_rotary(q, k, cos_sin)
        with scope("attention"):
            o = self.impl.forward(q, k, v, kv_cache, metadata)
        return self.o_proj(o.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        with scope("activation"):
            h = F.silu(gate) * up
        return self.down_proj(h)


class DecoderLayer(nn.Module):
    def __init__(self, config, spec: LayerSpec) -> None:
        super().__init__()
        self.self_attn = Attention(config, spec)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, cos_sin, x, kv_cache, metadata) -> torch.Tensor:
        x = x + self.self_attn(cos_sin, self.input_layernorm(x), kv_cache, metadata)
        return x + self.mlp(self.post_attention_layernorm(x))


class Model(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, s) for s in layer_specs(config))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM: ``forward`` → hidden states, ``compute_logits`` → float32 logits."""

    # checkpoint name → (our fused parameter, shard id)
    STACKED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
               "v_proj": ("qkv_proj", "v"), "gate_proj": ("gate_up_proj", 0),
               "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config) -> None:
        super().__init__()
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type '{config.model_type}' is not supported "
                             f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        self.config = config
        self.model = Model(config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary: RotaryEmbedding | None = None

    def setup_rotary(self, max_positions: int, device: torch.device) -> None:
        spec = self.model.layers[0].self_attn.spec
        self.rotary = RotaryEmbedding(self.config, spec.head_size, max_positions, device)

    def bind_attention(self, impls: list[AttentionImpl]) -> None:
        for layer, impl in zip(self.model.layers, impls, strict=True):
            layer.self_attn.impl = impl

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], metadata: AttentionMetadata) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        with scope("rotary"):
            cos_sin = self.rotary.lookup(positions)
        for layer, cache in zip(self.model.layers, kv_caches):
            x = layer(cos_sin, x, cache, metadata)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        return F.linear(hidden, w).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors into our (partly fused) parameters; fail on missing ones."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            target, shard = name, None
            for ckpt, (fused, shard_id) in self.STACKED.items():
                if f".{ckpt}." in name:
                    target, shard = name.replace(ckpt, fused), shard_id
                    break
            if target not in params:
                raise ValueError(f"unexpected weight '{name}' in checkpoint")
            param = params[target]
            with torch.no_grad():
                self._shard(param, target, shard).copy_(tensor)
            loaded.add(f"{target}:{shard}")
        expected = set()
        for pname in params:
            fused = [s for c, (f, s) in self.STACKED.items() if f".{f}." in pname]
            expected |= {f"{pname}:{s}" for s in fused} if fused else {f"{pname}:None"}
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weight(s), e.g. {missing[0]}")

    def _shard(self, param: torch.Tensor, name: str, shard) -> torch.Tensor:
        if shard is None:
            return param.data
        if shard in ("q", "k", "v"):
            attn = self.get_submodule(name.rsplit(".qkv_proj", 1)[0])
            q, kv = attn.q_size, attn.kv_size
            start, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard]
            return param.data.narrow(0, start, size)
        half = param.shape[0] // 2
        return param.data.narrow(0, shard * half, half)
