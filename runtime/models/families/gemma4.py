"""The Gemma 4 text family (``gemma4_text``; the language model of multimodal ``gemma4``
checkpoints): Gemma 3's layers of five local (sliding-window) layers to one global layer, with
what Gemma 4 changes, as transformers' ``modeling_gemma4`` defines it:

* global layers of their own shape: heads of ``global_head_dim`` (512) and, where
  ``attention_k_eq_v``, ``num_global_key_value_heads`` KV heads whose values are the keys'
  projection (before the key norm and rotary); rotary on them is *proportional* (a quarter of
  the head's frequencies turn, the rest are zero);
* per-head q and k RMSNorms (weight ``w``, not Gemma 2's ``1 + w``), values RMS-normed without
  a weight, scores unscaled (``scaling`` 1.0); every norm of the model weighs by ``w``;
* per-layer inputs (``hidden_size_per_layer_input``): a second embedding table gives each layer
  a token's own vector, mixed with a projection of the input embedding, gated into that layer's
  output;
* ``layer_scalar``: each layer's output scaled by a learned number;
* KV sharing: the last ``num_kv_shared_layers`` layers compute no K/V and hold no pages: each
  reads the K/V of the last earlier layer of its kind (that layer's cache and this step's K/V);
* the MoE block (``enable_moe_block``): routed GeGLU experts beside the dense MLP, fed the
  layer's residual stream (the router: an unweighted RMSNorm, a learned scale, softmax top-k
  renormalized, times a learned per-expert scale), the two outputs normed and summed;
* the final logits soft-capped (Gemma 2's);
* images (a multimodal checkpoint's vision tower): ``gemma4_vision.py``.

Layers of two KV shapes plan their KV groups as ``kv_groups.py`` says (a tensor per layer).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedgen.attention.backend import AttentionImpl, AttentionType, LayerSpec
from pagedgen.errors import PagedgenError
from pagedgen.runtime.collectives.parallel import TensorParallel
from pagedgen.runtime.collectives.sharding import Segment, split
from pagedgen.runtime.layers.attention import PagedAttention
from pagedgen.runtime.layers.embedding import VocabParallelEmbedding
from pagedgen.runtime.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedgen.runtime.layers.moe import route as moe_route
from pagedgen.runtime.layers.moe.act import geglu
from pagedgen.runtime.layers.moe.layer import FusedMoE
from pagedgen.runtime.layers.norm import RMSNorm
from pagedgen.runtime.layers.rotary import ApplyRotary, RotaryEmbedding
from pagedgen.runtime.models.families import gemma2, gemma3, llama
from pagedgen.runtime.models.families.gemma4_vision import (
    Gemma4ImagePrompter,
    Gemma4Vision,
    sees_blocks,
)
from pagedgen.runtime.models.hf_config import check_int
from pagedgen.runtime.models.multimodal import StepImages
from pagedgen.runtime.models.registry import ModelFamily, register
from pagedgen.runtime.models.weights import load_checkpoint
from pagedgen.runtime.quantization.config import QuantConfig, linear_method
from pagedgen.runtime.quantization.unquantized import Unquantized

SLIDING, FULL = "sliding_attention", "full_attention"
TOWERS = ("vision_tower", "audio_tower", "embed_vision", "embed_audio")  # multimodal


def first_shared(config) -> int:
    """The first layer that reads an earlier layer's K/V (every later one does too)."""
    return config.num_hidden_layers - config.num_kv_shared_layers


def layer_shape(config, i: int) -> tuple[int, int]:
    """Layer ``i``'s (KV heads, head size), unsharded."""
    if config.layer_types[i] == FULL:
        return config.num_global_key_value_heads, config.global_head_dim
    return config.num_key_value_heads, config.head_dim


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight, in float32 (the values', and the router's input)."""
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def replicated(inputs: int, outputs: int) -> ColumnParallelLinear:
    """A small dense projection every rank holds whole (per-layer inputs, the router)."""
    return ColumnParallelLinear(inputs, [(None, Segment(None, outputs, 0, outputs, 0))], False,
                                Unquantized())


class Attention(nn.Module):
    """One layer's attention: q (and, unless it reads another layer's K/V, k and v)
    projected, q/k normed and rotated, v normed; over the paged cache."""

    def __init__(self, config, spec: LayerSpec, tp: TensorParallel, quant: QuantConfig | None,
                 prefix: str, index: int) -> None:
        super().__init__()
        self.spec, self.kind = spec, config.layer_types[index]
        self.eps = config.rms_norm_eps
        kv_heads, d = layer_shape(config, index)
        self.q_size, self.kv_size = spec.num_heads * d, spec.num_kv_heads * d
        self.reads_shared = index >= first_shared(config)
        self.k_is_v = bool(config.attention_k_eq_v) and self.kind == FULL
        bias = bool(config.attention_bias)
        parts = [("q", split(config.num_attention_heads * d, tp, "query features"))]
        if not self.reads_shared:
            kv = Segment(None, kv_heads * d, (tp.rank * kv_heads // tp.size) * d,
                         spec.num_kv_heads * d, 0)
            parts += [("k", kv)] + ([] if self.k_is_v else [("v", kv)])
        names = ["q_proj", "k_proj", "v_proj"][:len(parts)]
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, parts, bias,
                                             linear_method(quant, prefix, names))
        self.o_proj = RowParallelLinear(config.num_attention_heads * d, config.hidden_size,
                                        bias, tp, linear_method(quant, prefix, ["o_proj"]))
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        if not self.reads_shared:
            self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.rotary = ApplyRotary()
        # a layer that reads another's K/V holds no pages: it attends through that layer's
        self.attn = None if self.reads_shared else PagedAttention(spec)

    def forward(self, cos_sin, x: torch.Tensor, kv_cache, metadata, shared: dict) -> torch.Tensor:
        s = self.spec
        out = self.qkv_proj(x)
        q = out[:, :self.q_size].reshape(-1, s.num_heads, s.head_size)
        if self.reads_shared:  # q alone (the kernel's K head: one of q's, its result unused)
            q, _ = self.rotary(q, q[:, :1], cos_sin, (self.q_norm.weight, self.q_norm.weight,
                                                      self.eps))
            attn, k, v, cache = shared[self.kind]
            o = attn.impl.attend_step(q, k, v, cache, metadata.group(attn.kv_group))
        else:
            k = out[:, self.q_size:self.q_size + self.kv_size].reshape(-1, s.num_kv_heads,
                                                                        s.head_size)
            v = k if self.k_is_v else out[:, self.q_size + self.kv_size:].reshape(
                -1, s.num_kv_heads, s.head_size)
            v = unweighted_rms_norm(v, self.eps)
            q, k = self.rotary(q, k, cos_sin, (self.q_norm.weight, self.k_norm.weight,
                                               self.eps))
            o = self.attn(q, k, v, kv_cache, metadata)
            shared[self.kind] = (self.attn, k, v, kv_cache)  # for the layers that read it
        return self.o_proj(o.reshape(-1, self.q_size))


class Router(nn.Module):
    """Each token's experts and their weights from the layer's residual stream."""

    def __init__(self, config) -> None:
        super().__init__()
        h, n = config.hidden_size, config.num_experts
        self.top_k, self.eps = config.top_k_experts, config.rms_norm_eps
        self.proj = replicated(h, n)
        self.scale = nn.Parameter(torch.ones(h), requires_grad=False)
        self.per_expert_scale = nn.Parameter(torch.ones(n), requires_grad=False)
        self.root = h ** -0.5

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = unweighted_rms_norm(x, self.eps) * self.scale * self.root
        weights, ids = moe_route.route(self.proj(h), self.top_k, renormalize=True)
        return weights * self.per_expert_scale[ids].float(), ids


class DecoderLayer(nn.Module):
    def __init__(self, config, spec: LayerSpec, tp: TensorParallel, quant: QuantConfig | None,
                 prefix: str, index: int) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Attention(config, spec, tp, quant, f"{prefix}.self_attn", index)
        wide = config.use_double_wide_mlp and index >= first_shared(config)
        self.mlp = gemma2.MLP(config, tp, quant, f"{prefix}.mlp",
                              config.intermediate_size * (2 if wide else 1))
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, RMSNorm(h, eps))
        self.tp = tp
        self.moe = bool(config.enable_moe_block)
        if self.moe:
            self.router = Router(config)
            names = [f"{prefix}.experts.{e}.{n}" for e in range(config.num_experts)
                     for n in ("gate_proj", "up_proj", "down_proj")]
            self.experts = FusedMoE(config.num_experts, config.top_k_experts, h,
                                    config.moe_intermediate_size, tp,
                                    method=quant.moe_method_for(names) if quant else None,
                                    act=geglu)
            for name in ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
                         "pre_feedforward_layernorm_2"):
                setattr(self, name, RMSNorm(h, eps))
        self.per_layer = config.hidden_size_per_layer_input
        if self.per_layer:
            self.per_layer_input_gate = replicated(h, self.per_layer)
            self.per_layer_projection = replicated(self.per_layer, h)
            self.post_per_layer_input_norm = RMSNorm(h, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)

    def forward(self, cos_sin, x: torch.Tensor, per_layer_input: torch.Tensor | None, kv_cache,
                metadata, shared: dict) -> torch.Tensor:
        """The layer's output (the whole residual stream: ``layer_scalar`` scales all of it)."""
        h = self.self_attn(cos_sin, self.input_layernorm(x), kv_cache, metadata, shared)
        h, x = self.pre_feedforward_layernorm(self.post_attention_layernorm(h), x)
        h = self.mlp(h)
        if self.moe:
            weights, ids = self.router(x)
            inp = self.pre_feedforward_layernorm_2(x)
            routed = self.tp.reduce_partial(self.tp.partial_output(
                x.shape[0], x.shape[1], x.dtype,
                lambda out: self.experts(inp, weights, ids, out)))
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(routed)
        x = x + self.post_feedforward_layernorm(h)
        if self.per_layer:
            g = F.gelu(self.per_layer_input_gate(x), approximate="tanh") * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(g))
        return x * self.layer_scalar


class Model(nn.Module):
    def __init__(self, config, tp: TensorParallel, quant: QuantConfig | None, specs) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, h, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, s, tp, quant, f"model.layers.{i}", i)
                                    for i, s in enumerate(specs))
        self.norm = RMSNorm(h, eps)
        p = config.hidden_size_per_layer_input
        if p:
            n = config.num_hidden_layers * p
            self.embed_tokens_per_layer = VocabParallelEmbedding(
                config.vocab_size_per_layer_input, n, tp)
            self.per_layer_model_projection = replicated(h, n)
            self.per_layer_projection_norm = RMSNorm(p, eps)


class Gemma4ForCausalLM(gemma3.Gemma3ForCausalLM):
    """Gemma 4 text causal LM (Gemma 2's embedding scale, soft-capped logits and tied head;
    Gemma 3's rotary table per layer type, each at its kind's head size)."""

    DUMMY_ONES = ("layer_scalar", "router.scale", "router.per_expert_scale")

    def __init__(self, config, tp: TensorParallel | None = None,
                 quant: QuantConfig | None = None) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.tp = tp or TensorParallel()
        self.model = Model(config, self.tp, quant, self.decoder_specs(config, self.tp.size))
        self.tie_word_embeddings = bool(config.tie_word_embeddings)
        if not self.tie_word_embeddings:
            self.lm_head = VocabParallelEmbedding(config.vocab_size, config.hidden_size, self.tp)
        self.final_soft_cap = config.final_logit_softcapping
        self.rotaries: dict[str, RotaryEmbedding] = {}
        self.kv_shared_layers = config.num_kv_shared_layers
        vision = getattr(config, "vision_config", None)
        self.vision = Gemma4Vision(vision, config.hidden_size) \
            if isinstance(vision, dict) else None

    @property
    def takes_images(self) -> bool:
        return self.vision is not None

    def setup_rotary(self, max_positions: int, device: torch.device) -> None:
        super().setup_rotary(max_positions, device)
        if self.vision is not None:
            self.vision.setup_rotary(device)

    def encode_images(self, pixels: list, grids: list) -> list[torch.Tensor]:
        """Each image's embeddings [tokens, hidden] (``Gemma4Vision.encode``)."""
        return self.vision.encode(pixels)

    def profile_vision(self, tokens: int, largest: int) -> None:
        """The tower over ``tokens`` soft tokens in images of the ``largest`` size (each
        attends within itself), so the memory profile's peak counts its largest call."""
        k2 = self.vision.vision_tower.config.pooling_kernel_size ** 2
        self.vision.profile(-(-tokens // largest), largest * k2)

    @classmethod
    def tensor_parallel_error(cls, config, tp_size: int) -> str | None:
        """Llama's rules (query heads, the local layers' KV heads, the MLP), then the global
        layers' KV heads and the experts' width."""
        why = super().tensor_parallel_error(config, tp_size)
        heads = config.num_global_key_value_heads
        if why is None and heads % tp_size and tp_size % heads:
            why = (f"{heads} KV heads cannot be split over (or replicated on) {tp_size} "
                   f"tensor-parallel ranks")
        width = config.moe_intermediate_size
        if why is None and config.enable_moe_block and width % tp_size:
            why = (f"moe_intermediate_size {width} cannot be split over {tp_size} "
                   f"tensor-parallel ranks")
        return why

    @classmethod
    def decoder_specs(cls, config, tp_size: int = 1) -> list[LayerSpec]:
        """Every decoder layer's attention shape on one of ``tp_size`` ranks."""
        why = cls.tensor_parallel_error(config, tp_size)
        if why:
            raise ValueError(why)
        specs = []
        for i, kind in enumerate(config.layer_types):
            kv, d = layer_shape(config, i)
            specs.append(LayerSpec(num_heads=config.num_attention_heads // tp_size,
                                   num_kv_heads=max(1, kv // tp_size), head_size=d, scale=1.0,
                                   sliding_window=config.sliding_window if kind == SLIDING
                                   else None, attn_type=AttentionType.DECODER,
                                   image_blocks=kind == SLIDING and sees_blocks(config)))
        return specs

    @classmethod
    def layer_specs(cls, config, tp_size: int = 1) -> list[LayerSpec]:
        """The layers that hold K/V of their own (those that read another's hold none)."""
        return cls.decoder_specs(config, tp_size)[:first_shared(config)]

    def bind_attention(self, impls: list[AttentionImpl]) -> None:
        owners = [layer.self_attn.attn for layer in self.model.layers
                  if layer.self_attn.attn is not None]
        for attn, impl in zip(owners, impls, strict=True):
            attn.impl = impl

    def defer_all_reduces(self) -> None:
        """Each layer reduces its own outputs (its norms follow them before the residual)."""

    def rotary_head(self, kind: str) -> int:
        return layer_shape(self.config, self.config.layer_types.index(kind))[1]

    def per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[T, layers, P]: each layer's own vector of each token, mixed with a projection of
        its input embedding ``x`` (transformers' ``get_per_layer_inputs`` and
        ``project_per_layer_inputs``)."""
        m, p = self.model, self.config.hidden_size_per_layer_input
        shape = (x.shape[0], self.config.num_hidden_layers, p)
        own = m.embed_tokens_per_layer(input_ids)
        own = gemma2.scaled(own, p).reshape(shape)
        mixed = m.per_layer_model_projection(x) * self.config.hidden_size ** -0.5
        mixed = m.per_layer_projection_norm(mixed.reshape(shape))
        return (mixed + own) * 2 ** -0.5

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], metadata) -> torch.Tensor:
        images = getattr(metadata, "model_inputs", None)
        if isinstance(images, StepImages):  # an image token reads as the pad token, then
            # its embedding is the tower's (the per-layer inputs' token part stays the pad's)
            input_ids = input_ids.clone()
            input_ids[images.rows] = self.config.pad_token_id
        x = self.embed(input_ids)
        if isinstance(images, StepImages):
            x[images.rows] = images.embeds.to(x.dtype)
        per_layer = self.per_layer_inputs(input_ids, x) \
            if self.config.hidden_size_per_layer_input else None
        shared: dict = {}  # layer kind → (attention, k, v, cache) of its last K/V layer
        for i, (layer, cos_sin) in enumerate(zip(self.model.layers,
                                                 self.rotary_tables(positions))):
            # the layers that keep K/V come first: layer i's cache is the i-th
            cache = kv_caches[i] if i < len(kv_caches) else None
            x = layer(cos_sin, x, None if per_layer is None else per_layer[:, i], cache,
                      metadata, shared)
        return self.model.norm(x)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """The checkpoint's tensors as they are (every norm weighs by ``w``): a multimodal
        checkpoint's language model (``model.language_model.*``) and vision tower (its audio
        tower not read); the
        K/V projections some checkpoints keep for layers that read another's are skipped."""
        reads_shared = {f"model.layers.{i}.self_attn.{n}"
                        for i in range(first_shared(self.config), self.config.num_hidden_layers)
                        for n in ("k_proj", "v_proj", "k_norm", "v_norm")}
        tied = self.tie_word_embeddings

        def renamed():
            for name, tensor in weights:
                name = name.replace("model.language_model.", "model.", 1)
                tower = name.split(".")[1] if name.startswith("model.") else ""
                if tower in ("vision_tower", "embed_vision") and self.vision is not None:
                    yield "vision." + name.removeprefix("model."), tensor
                elif tower not in TOWERS:
                    yield name, tensor

        load_checkpoint(self, renamed(), self.STACKED, lambda name: "rotary_emb" in name
                        or (tied and name == "lm_head.weight")
                        or name.rsplit(".", 1)[0] in reads_shared)


def _rules(f: dict[str, Any], model_type: str, where: str) -> None:
    """Layer types (five local to one global by default, the last global), each kind's shape
    (``global_head_dim`` and ``num_global_key_value_heads``, or a transformers-written
    ``per_layer_config``), the shared-KV layers, the MoE block's fields."""
    n = f["num_hidden_layers"]
    if f.get("hidden_activation", gemma2.GELU) != gemma2.GELU:
        raise PagedgenError(f"{where}: hidden_activation '{f['hidden_activation']}' is not "
                            f"supported ({gemma2.GELU})")
    if f.get("use_bidirectional_attention") == "all":
        raise PagedgenError(f"{where}: use_bidirectional_attention 'all' is not supported "
                            "(pagedgen generates causally)")
    if f.get("layer_types") is None:
        f["layer_types"] = [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(n)]
    types = f["layer_types"]
    if not isinstance(types, list) or len(types) != n or any(t not in (SLIDING, FULL)
                                                             for t in types):
        raise PagedgenError(f"{where}: layer_types must list one of {SLIDING}, {FULL} for "
                            f"each of the {n} layers")
    f["layer_types"] = types = [*types[:-1], FULL]  # as transformers forces the last one
    llama.check_window(f, where)
    per_layer = f.pop("per_layer_config", None) or {}
    full = next((v for k, v in per_layer.items() if types[int(k)] == FULL), None) \
        if isinstance(per_layer, dict) else None
    if full is not None:  # written by transformers: the global layers' shape
        f["global_head_dim"] = full.get("head_dim", f["head_dim"])
        f["num_global_key_value_heads"] = full.get("num_key_value_heads")
    check_int(f, "global_head_dim", where)
    glob = f.get("num_global_key_value_heads")
    f["num_global_key_value_heads"] = glob if f["attention_k_eq_v"] and glob is not None \
        else f["num_key_value_heads"]
    check_int(f, "num_global_key_value_heads", where)
    for heads in (f["num_key_value_heads"], f["num_global_key_value_heads"]):
        if f["num_attention_heads"] % heads:
            raise PagedgenError(f"{where}: num_attention_heads ({f['num_attention_heads']}) "
                                f"must be a multiple of every layer's KV heads ({heads})")
    shared = check_int(f, "num_kv_shared_layers", where, zero=True)
    if shared >= n or set(types[n - shared:]) - set(types[:n - shared]):
        raise PagedgenError(f"{where}: num_kv_shared_layers {shared}: every layer that reads "
                            "another's K/V needs an earlier layer of its kind that keeps them")
    if not f.get("hidden_size_per_layer_input"):
        f["hidden_size_per_layer_input"] = 0
    else:
        check_int(f, "hidden_size_per_layer_input", where)
        check_int(f, "vocab_size_per_layer_input", where)
    if f["enable_moe_block"]:
        for key in ("num_experts", "top_k_experts", "moe_intermediate_size"):
            check_int(f, key, where)
        if f["top_k_experts"] > f["num_experts"]:
            raise PagedgenError(f"{where}: top_k_experts ({f['top_k_experts']}) exceeds "
                                f"num_experts ({f['num_experts']})")
    cap = f["final_logit_softcapping"]
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float))
                            or cap <= 0):
        raise PagedgenError(f"{where}: final_logit_softcapping must be a positive number or "
                            f"null, not {cap!r}")


register(ModelFamily(
    name="gemma4",
    model_types={"gemma4_text": dict(  # transformers' Gemma4TextConfig defaults
        vocab_size=262144, hidden_size=2304, intermediate_size=9216, num_hidden_layers=30,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_act=gemma2.GELU,
        hidden_activation=gemma2.GELU, max_position_embeddings=131072, sliding_window=512,
        final_logit_softcapping=None, use_bidirectional_attention=None,
        vocab_size_per_layer_input=262144, hidden_size_per_layer_input=256,
        attention_k_eq_v=False, num_kv_shared_layers=0, enable_moe_block=False,
        use_double_wide_mlp=False, num_experts=None, top_k_experts=None,
        moe_intermediate_size=None, global_head_dim=512, num_global_key_value_heads=None,
        tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0,
        rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                         FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                "rope_theta": 1_000_000.0}})},
    model_cls=Gemma4ForCausalLM,
    normalize=_rules,
    activations=(gemma2.GELU,),
    partial_rotary=True,
    multimodal={"gemma4": "gemma4_text"},
    images=True,
    image_prompter=Gemma4ImagePrompter))
