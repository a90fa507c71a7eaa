"""The Qwen3-Next family (``qwen3_next``: Qwen3-Next-80B-A3B) and the hybrid skeleton Qwen3.5
shares (``qwen3_5.py``): ``layer_types`` interleaves Gated DeltaNet linear attention
(``layers/gated_deltanet.py``: a recurrent state per sequence) with gated full attention over
the paged KV cache (three to one by default).

Full attention: ``q_proj`` gives each head's query and an output gate ([q | gate] per head), q
and k are RMS-normed per head, a quarter of each head's features rotate
(``partial_rotary_factor``), and the attention output is scaled by ``sigmoid(gate)``. Every
RMSNorm but the delta rule's scales by ``1 + w`` (loaded so, in float32). MLPs: Qwen2-MoE's
routed experts beside a gated shared expert in the sparse layers (``decoder_sparse_step``,
``mlp_only_layers``), a dense SwiGLU elsewhere. Checkpoint tensors of multi-token prediction
(``mtp.*``) are not used. Under ``-tp`` each rank holds a share of the full-attention heads and
of the linear-attention key heads with the value heads they serve.
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
from pagedgen.runtime.collectives.sharding import split
from pagedgen.runtime.layers.attention import PagedAttention
from pagedgen.runtime.layers.embedding import VocabParallelEmbedding
from pagedgen.runtime.layers.gated_deltanet import SSM_DTYPES, GatedDeltaNet, spec_of, ungroup
from pagedgen.runtime.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedgen.runtime.layers.norm import RMSNorm
from pagedgen.runtime.layers.rotary import ApplyRotary, RotaryEmbedding, rotary_dim
from pagedgen.runtime.models.families import llama
from pagedgen.runtime.models.families.qwen2_moe import check_shared_experts, shared_expert_moe
from pagedgen.runtime.models.families.qwen3_moe import MoeForCausalLM, is_sparse, layer_index
from pagedgen.runtime.models.hf_config import check_int
from pagedgen.runtime.models.registry import ModelFamily, register
from pagedgen.runtime.quantization.config import QuantConfig, linear_method

LINEAR, FULL = "linear_attention", "full_attention"


def offset_norm(dim: int, eps: float) -> RMSNorm:
    """An RMSNorm whose checkpoint weight ``w`` scales by ``1 + w``: held as ``1 + w`` in
    float32 (``w`` is small: ``1 + w`` in bfloat16 would round most of it away)."""
    norm = RMSNorm(dim, eps)
    norm.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
    return norm


class GatedAttention(nn.Module):
    """Full attention with per-head q/k norms, partial rotary and a sigmoid output gate."""

    def __init__(self, config, spec: LayerSpec, tp: TensorParallel,
                 quant: QuantConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        self.spec = spec
        h, d = config.hidden_size, spec.head_size
        self.q_size, self.kv_size = spec.num_heads * d, spec.num_kv_heads * d
        bias = bool(config.attention_bias)
        # q_proj: each head's query then its gate, so a rank's heads are one row range
        q = split(2 * config.num_attention_heads * d, tp, "query features")
        kv = llama.kv_segment(config, spec, tp)
        self.qkv_proj = ColumnParallelLinear(
            h, [("q", q), ("k", kv), ("v", kv)], bias,
            linear_method(quant, prefix, ["q_proj", "k_proj", "v_proj"]))
        self.o_proj = RowParallelLinear(config.num_attention_heads * d, h, bias, tp,
                                        linear_method(quant, prefix, ["o_proj"]))
        self.q_norm = offset_norm(d, config.rms_norm_eps)
        self.k_norm = offset_norm(d, config.rms_norm_eps)
        self.rotary = ApplyRotary()
        self.attn = PagedAttention(spec)

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        s, t = self.spec, x.shape[0]
        qg, k, v = self.qkv_proj(x).split([2 * self.q_size, self.kv_size, self.kv_size], -1)
        q, gate = qg.reshape(t, s.num_heads, 2 * s.head_size).chunk(2, -1)
        norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        q, k = self.rotary(q, k.reshape(t, s.num_kv_heads, s.head_size), cos_sin, norms)
        o = self.attn(q, k, v.reshape(t, s.num_kv_heads, s.head_size), kv_cache, metadata)
        return self.o_proj((o * torch.sigmoid(gate)).reshape(t, self.q_size))


class DecoderLayer(nn.Module):
    """A linear-attention layer (``spec`` None) or a full-attention one; the MLP as the family
    says (``HybridForCausalLM.make_mlp``)."""

    def __init__(self, config, spec: LayerSpec | None, tp: TensorParallel,
                 quant: QuantConfig | None, prefix: str, lm_cls) -> None:
        super().__init__()
        self.linear = spec is None
        if self.linear:
            self.linear_attn = GatedDeltaNet(config, tp, quant, f"{prefix}.linear_attn")
        else:
            self.self_attn = GatedAttention(config, spec, tp, quant, f"{prefix}.self_attn")
        self.mlp = lm_cls.make_mlp(config, tp, quant, f"{prefix}.mlp")
        self.input_layernorm = offset_norm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = offset_norm(config.hidden_size, config.rms_norm_eps)

    def forward(self, cos_sin, x: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: torch.Tensor | None, metadata: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it), as Llama's layer."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        if self.linear:
            h = self.linear_attn(h, metadata)
        else:
            h = self.self_attn(cos_sin, h, kv_cache, metadata)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class HybridModel(nn.Module):
    def __init__(self, config, tp: TensorParallel, quant: QuantConfig | None, lm_cls) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            DecoderLayer(config, s, tp, quant, f"model.layers.{i}", lm_cls)
            for i, s in enumerate(lm_cls.decoder_specs(config, tp.size)))
        self.norm = offset_norm(config.hidden_size, config.rms_norm_eps)


class HybridForCausalLM(MoeForCausalLM):
    """Linear-attention and full-attention layers; paged KV caches for the latter only."""

    # in_proj_qkv is read as its three row ranges (``_renamed``), each rank's share of each
    STACKED = {**llama.LlamaForCausalLM.STACKED,
               "in_proj_q": ("in_proj_qkvz", "q"), "in_proj_k": ("in_proj_qkvz", "k"),
               "in_proj_v": ("in_proj_qkvz", "v"), "in_proj_z": ("in_proj_qkvz", "z"),
               "in_proj_b": ("in_proj_ba", "b"), "in_proj_a": ("in_proj_ba", "a")}

    def __init__(self, config, tp: TensorParallel | None = None,
                 quant: QuantConfig | None = None) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.tp = tp or TensorParallel()
        why = self.tensor_parallel_error(config, self.tp.size)
        if why:
            raise ValueError(why)
        self.model = HybridModel(config, self.tp, quant, type(self))
        self.tie_word_embeddings = bool(config.tie_word_embeddings)
        if not self.tie_word_embeddings:
            self.lm_head = VocabParallelEmbedding(config.vocab_size, config.hidden_size, self.tp)
        self.rotary = None

    takes_images = False  # a vision tower's images go into the prompt (Qwen3.5)

    @classmethod
    def make_mlp(cls, config, tp: TensorParallel, quant: QuantConfig | None,
                 prefix: str) -> nn.Module:
        """Qwen3-Next: experts with a shared one in the sparse layers, else a dense MLP."""
        if config.num_local_experts and is_sparse(config, layer_index(prefix)):
            return shared_expert_moe(config, tp, quant, prefix, bool(config.norm_topk_prob))
        return llama.MLP(config, tp, quant, prefix)

    @classmethod
    def tensor_parallel_error(cls, config, tp_size: int) -> str | None:
        fields = ["linear_num_key_heads", "num_attention_heads"]
        fields += (["moe_intermediate_size", "shared_expert_intermediate_size"]
                   if getattr(config, "num_local_experts", None) else ["intermediate_size"])
        for field in fields:
            if getattr(config, field) % tp_size:
                return (f"{field} {getattr(config, field)} cannot be split over {tp_size} "
                        "tensor-parallel ranks")
        return None

    @classmethod
    def decoder_specs(cls, config, tp_size: int = 1) -> list[LayerSpec | None]:
        why = cls.tensor_parallel_error(config, tp_size)
        if why:
            raise ValueError(why)
        d = config.head_dim
        return [None if kind == LINEAR else LayerSpec(
            num_heads=config.num_attention_heads // tp_size,
            num_kv_heads=max(1, config.num_key_value_heads // tp_size),
            head_size=d, scale=d ** -0.5, attn_type=AttentionType.DECODER)
            for kind in config.layer_types]

    @classmethod
    def layer_specs(cls, config, tp_size: int = 1) -> list[LayerSpec]:
        return [s for s in cls.decoder_specs(config, tp_size) if s is not None]

    @classmethod
    def state_specs(cls, config, tp_size: int = 1) -> list:
        return [spec_of(config, tp_size) for kind in config.layer_types if kind == LINEAR]

    def _layers(self, linear: bool) -> list[nn.Module]:
        return [layer for layer in self.model.layers if layer.linear == linear]

    def bind_attention(self, impls: list[AttentionImpl]) -> None:
        for layer, impl in zip(self._layers(False), impls, strict=True):
            layer.self_attn.attn.impl = impl

    def bind_recurrent(self, impls: list, states: list) -> None:
        for layer, impl, state in zip(self._layers(True), impls, states, strict=True):
            layer.linear_attn.impl, layer.linear_attn.state = impl, state

    def defer_all_reduces(self) -> None:
        """Each row-parallel projection reduces its own partial sums (not yet left to the
        norm after it)."""

    def setup_rotary(self, max_positions: int, device: torch.device) -> None:
        dim = rotary_dim(self.config.rope_parameters, self.config.head_dim)
        self.rotary = RotaryEmbedding(self.config, dim, max_positions, device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], metadata: AttentionMetadata) -> torch.Tensor:
        x, cos_sin = self.inputs(input_ids, positions, metadata)
        residual = None
        caches = iter(kv_caches)
        for layer in self.model.layers:
            cache = None if layer.linear else next(caches)
            x, residual = layer(cos_sin, x, residual, cache, metadata)
        return self.model.norm(x, residual)[0]

    def inputs(self, input_ids: torch.Tensor, positions: torch.Tensor,
               metadata: AttentionMetadata | None) -> tuple[torch.Tensor, tuple]:
        """The step's input embeddings and cos/sin (a family with images adds theirs)."""
        return self.embed(input_ids), self.rotary.lookup(positions)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """The checkpoint's tensors (a multimodal checkpoint's language model's; per-group
        projections reordered), then every offset norm's ``w`` becomes ``1 + w``."""
        super().load_weights(self._renamed(weights))
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, RMSNorm):
                    m.weight.add_(1.0)

    def _renamed(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        spec = spec_of(self.config)
        key, rep = spec.head_k, spec.num_v_heads // spec.num_k_heads
        for name, tensor in weights:
            if name.startswith("mtp.") or (name.startswith("model.visual.")
                                            and not self.takes_images):
                continue
            if name.startswith("model.visual."):  # the vision tower's (images)
                yield name.removeprefix("model."), tensor
                continue
            name = name.replace("model.language_model.", "model.", 1)
            if name.endswith("linear_attn.in_proj_qkvz.weight"):
                q, k, v, z = _ungrouped(name, tensor, spec,
                                        [key, key, rep * spec.head_v, rep * spec.head_v])
                stem = name.removesuffix("in_proj_qkvz.weight")
                yield from ((stem + f"in_proj_{p}.weight", t)
                            for p, t in zip("qkvz", (q, k, v, z)))
            elif ".linear_attn.in_proj_qkv." in name:
                yield from _split_qkv(name, tensor, spec)
            elif name.endswith("linear_attn.in_proj_ba.weight"):
                b, a = _ungrouped(name, tensor, spec, [rep, rep])
                stem = name.removesuffix("in_proj_ba.weight")
                yield stem + "in_proj_b.weight", b
                yield stem + "in_proj_a.weight", a
            else:
                yield name, tensor


def _split_qkv(name: str, tensor, spec) -> Iterable[tuple[str, Any]]:
    """``in_proj_qkv``'s weight (or its FP8 scales: rows in blocks, or one per tensor) as its
    q, k and v row ranges (``in_proj_q``, ``in_proj_k``, ``in_proj_v``)."""
    sizes = [spec.num_k_heads * spec.head_k] * 2 + [spec.num_v_heads * spec.head_v]
    whole = tensor if isinstance(tensor, torch.Tensor) else tensor[...]
    stem, tail = name.split(".in_proj_qkv.")
    if whole.dim() == 0 or whole.numel() == 1:  # a per-tensor scale: each part's
        yield from ((f"{stem}.in_proj_{p}.{tail}", whole) for p in "qkv")
        return
    per, rest = divmod(sum(sizes), whole.shape[0])
    if rest or any(n % per for n in sizes):
        raise ValueError(f"tensor '{name}' has {whole.shape[0]} rows: its q, k and v parts "
                         f"({', '.join(map(str, sizes))} rows) do not fall on them")
    for p, part in zip("qkv", whole.split([n // per for n in sizes])):
        yield f"{stem}.in_proj_{p}.{tail}", part


def _ungrouped(name: str, tensor, spec, sizes: list[int]) -> list[torch.Tensor]:
    """``ungroup`` of a checkpoint tensor, its shape checked first."""
    shape = tuple(tensor.get_shape() if hasattr(tensor, "get_shape") else tensor.shape)
    rows = spec.num_k_heads * sum(sizes)
    if len(shape) != 2 or shape[0] != rows:
        raise ValueError(f"tensor '{name}' has shape {list(shape)}; the config makes it "
                         f"[{rows}, hidden_size]")
    return ungroup(tensor[:], spec, sizes)


def check_hybrid(f: dict[str, Any], where: str) -> None:
    """``layer_types`` (default: every ``full_attention_interval``-th layer full, the rest
    linear) and the linear-attention fields; partial rotary from the top level too."""
    for key in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                "linear_value_head_dim", "linear_conv_kernel_dim"):
        check_int(f, key, where)
    if f["linear_num_value_heads"] % f["linear_num_key_heads"]:
        raise PagedgenError(f"{where}: linear_num_value_heads ({f['linear_num_value_heads']}) "
                            f"must be a multiple of linear_num_key_heads "
                            f"({f['linear_num_key_heads']})")
    if f["linear_conv_kernel_dim"] < 2:
        raise PagedgenError(f"{where}: linear_conv_kernel_dim must be at least 2")
    if f.get("mamba_ssm_dtype") not in (None, *SSM_DTYPES):
        raise PagedgenError(f"{where}: mamba_ssm_dtype must be one of {', '.join(SSM_DTYPES)}, "
                            f"not {f['mamba_ssm_dtype']!r}")
    if f.get("layer_types") is None:
        every = f.pop("full_attention_interval", 4)
        f["layer_types"] = [FULL if (i + 1) % every == 0 else LINEAR
                            for i in range(f["num_hidden_layers"])]
    types = f["layer_types"]
    if (not isinstance(types, list) or len(types) != f["num_hidden_layers"]
            or any(t not in (LINEAR, FULL) for t in types)):
        raise PagedgenError(f"{where}: layer_types must list {LINEAR} or {FULL} for each of "
                            f"the {f['num_hidden_layers']} layers")
    if FULL not in types:
        raise PagedgenError(f"{where}: layer_types has no {FULL} layer")


def _rules(f: dict[str, Any], model_type: str, where: str) -> None:
    check_hybrid(f, where)
    check_shared_experts(f, where)


# transformers' Qwen3NextConfig defaults (Qwen3-Next-80B-A3B's shape but its vocabulary)
HYBRID = dict(head_dim=256, num_key_value_heads=2, max_position_embeddings=32768,
              linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
              linear_num_key_heads=16, linear_num_value_heads=32, partial_rotary_factor=0.25,
              layer_types=None, bos_token_id=None, eos_token_id=None)

register(ModelFamily(
    name="qwen3_next",
    model_types={"qwen3_next": dict(
        HYBRID, vocab_size=151936, hidden_size=2048, intermediate_size=5632,
        num_hidden_layers=48, num_attention_heads=16, decoder_sparse_step=1,
        moe_intermediate_size=512, shared_expert_intermediate_size=512, num_experts_per_tok=10,
        num_local_experts=512, norm_topk_prob=True, mlp_only_layers=None)},
    model_cls=HybridForCausalLM,
    normalize=_rules,
    partial_rotary=True))
