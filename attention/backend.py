"""The attention backend interface (after vLLM's ``attention/backends/abstract.py``, simpler).

A backend is one file that implements four small things:

* :class:`AttentionBackend` -- static facts: name, KV-cache shape, head sizes, availability,
  and block swap/copy.
* :class:`AttentionState` -- one per run: owns workspace buffers and the static buffers a CUDA
  graph captures, and is the backend's metadata builder: ``build(metadata)`` plans the step's
  kernels once (not once per layer) and returns the backend's own typed metadata.
* :class:`AttentionImpl` -- one per layer: ``forward(q, k, v, kv_cache, metadata)`` writes the new
  tokens' K/V into the paged cache and returns attention over every cached token.

The step's common metadata (``attention/metadata.py``) is built once from the scheduled
sequences, prefill tokens first, then decode tokens.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from pagedgen.attention.image_blocks import reattend
from pagedgen.attention.metadata import AttentionMetadata
from pagedgen.attention.ops import kv_cache as kv_ops
from pagedgen.errors import PagedgenError


class AttentionType(str, enum.Enum):
    """What a layer attends to: its own causal past (DECODER) or the whole input (ENCODER)."""

    DECODER = "decoder"
    ENCODER = "encoder"


@dataclass
class LayerSpec:
    """The attention shape of one layer, as the model declares it."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    sliding_window: int | None = None  # attend to the last `sliding_window` positions (self too)
    logits_soft_cap: float | None = None  # logits = cap * tanh(logits / cap)
    attn_type: AttentionType = AttentionType.DECODER
    # a learned logit per query head that joins every softmax with a zero value (gpt-oss's
    # attention sinks): the impl reads it from ``AttentionImpl.sinks``
    sinks: bool = False
    # a window layer whose image tokens see their whole block (attention/image_blocks.py)
    image_blocks: bool = False


# layer features a backend may not run: the backend's flag, and whether a layer uses it
LAYER_FEATURES = {
    "sliding window": ("supports_sliding_window", lambda spec: spec.sliding_window is not None),
    "logits soft-cap": ("supports_soft_cap", lambda spec: spec.logits_soft_cap is not None),
    "attention sinks": ("supports_sinks", lambda spec: spec.sinks)}


class AttentionImpl(ABC):
    """One layer's attention computation over the paged cache."""

    def __init__(self, spec: LayerSpec, state: AttentionState) -> None:
        self.spec = spec
        self.state = state
        self.sinks: torch.Tensor | None = None  # [num_heads] float32 where ``spec.sinks``

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] for the step's new tokens → output [T, Hq, D]:
        k/v written into ``kv_cache`` at ``metadata.slot_mapping`` (``write_kv``), then the
        attention over the cache (``attend``). Piecewise CUDA graphs call the two apart: the
        write inside a graph (its slots padded into the scratch block), the attention between
        graphs."""
        self.write_kv(k, v, kv_cache, metadata.slot_mapping)
        return self.attend_step(q, k, v, kv_cache, metadata)

    def attend_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """``attend``, then, on a layer whose image tokens see their whole block, those rows
        again (``image_blocks.reattend``)."""
        out = self.attend(q, k, v, kv_cache, metadata)
        if self.spec.image_blocks and metadata.image_blocks:
            reattend(self, out, q, kv_cache, metadata)
        return out

    @abstractmethod
    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Store the new tokens' k/v [T, Hkv, D] at their cache slots [T]."""

    @abstractmethod
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               metadata: AttentionMetadata) -> torch.Tensor:
        """The attention output [T, Hq, D] of q over the cache, which already holds the new
        tokens' k/v (given too, for a backend that reads them from there)."""


class AttentionState:
    """Per-run backend state: workspace buffers, per-step planning, CUDA-graph buffers.

    The default plans nothing and runs on the common metadata; backends with kernel plans
    override ``build`` and return a subclass of AttentionMetadata with a typed ``plan``.
    """

    def __init__(self, backend: type[AttentionBackend], layer_specs: Sequence[LayerSpec],
                 block_size: int, dtype: torch.dtype, kv_cache_dtype: torch.dtype,
                 device: torch.device) -> None:
        self.backend = backend
        self.layer_specs = list(layer_specs)
        self.block_size = block_size
        self.dtype = dtype  # the model's (query) dtype
        self.kv_cache_dtype = kv_cache_dtype
        self.device = device
        # Whether forward can run a step with ``metadata.cascade`` (attention/cascade.py), and
        # how deep its groups may nest.
        self.supports_cascade = False
        self.max_cascade_levels = 3
        # Whether it can also run ``metadata.cascade`` over the decodes of a step with prefills.
        self.supports_mixed_cascade = False
        # FP8 caches store value / scale; readers multiply back.
        self.k_scale = 1.0
        self.v_scale = 1.0

    def build(self, metadata: AttentionMetadata, graph_batch_size: int | None = None
              ) -> AttentionMetadata:
        """The backend's metadata for a step: the common ``metadata``, with whatever the
        backend plans once per step (not once per layer). ``graph_batch_size``: plan into the
        buffers captured for that CUDA-graph batch size."""
        return metadata

    def warmup(self, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int
               ) -> None:
        """Compile (JIT) every kernel variant a run of these limits can launch, so that neither
        timing nor CUDA-graph capture pays for compiles. Default: nothing to compile."""

    def compile_stats(self) -> dict[str, float | int | str]:
        """Warm-up figures for the run summary (e.g. compile seconds, variants compiled, a
        kernel chosen at warm-up)."""
        return {}

    def make_graph_plan(self, batch_size: int, max_num_pages: int, cascade_levels: int = 0,
                        cascade_segments: int = 0) -> None:
        """Allocate what a CUDA graph of ``batch_size`` decodes captures (backends that declare
        ``supports_cuda_graphs``). ``max_num_pages``: the most page-table entries such a step
        can hold (more than the cache's blocks when sequences share prefix blocks).
        ``cascade_levels``: the graph's steps attend groups' shared pages once, in this many
        levels (``metadata.cascade_levels``) of ``cascade_segments`` segments each
        (``metadata.cascade_segments``)."""
        raise NotImplementedError(f"{self.backend.name} does not support CUDA graphs")


def plan_groups(states: Sequence[AttentionState], metadata: AttentionMetadata,
                graph_batch_size: int | None = None) -> AttentionMetadata:
    """A step's plans by each KV group's state (``build``; a model of one group: one), the
    further groups' in the first's ``kv_groups``, each from ``metadata.kv_groups``'s own."""
    groups = metadata.kv_groups
    out = states[0].build(metadata, graph_batch_size)
    out.kv_groups = [st.build(g, graph_batch_size) for st, g in zip(states[1:], groups)]
    return out


class AttentionBackend(ABC):
    """Static facts about a backend. Subclasses are registered in ``registry.py``."""

    name: ClassVar[str]
    devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    supports_cuda_graphs: ClassVar[bool] = False
    supports_sliding_window: ClassVar[bool] = False
    supports_soft_cap: ClassVar[bool] = False
    supports_sinks: ClassVar[bool] = False
    supports_fp8_kv_cache: ClassVar[bool] = False
    # Whether its kernels read a cache of any strides and page size: it may attend through a
    # view of another backend's KV slabs (a model whose KV groups run two backends)
    reads_any_strides: ClassVar[bool] = False
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float16, torch.bfloat16,
                                                           torch.float32)
    default_block_size: ClassVar[int] = 16

    @staticmethod
    @abstractmethod
    def get_impl_cls() -> type[AttentionImpl]: ...

    @staticmethod
    def get_state_cls() -> type[AttentionState]:
        return AttentionState

    @staticmethod
    def get_supported_head_sizes() -> list[int]:
        return [64, 80, 96, 128, 256]

    @classmethod
    def get_supported_dtypes(cls) -> tuple[torch.dtype, ...]:
        """The query/KV dtypes it runs (asked each time: a backend's may follow the process's
        environment)."""
        return cls.supported_dtypes

    @classmethod
    def get_supported_block_sizes(cls) -> list[int] | None:
        """Page sizes (tokens per KV block) the kernels accept; None: any."""
        return None

    @classmethod
    def resolve_block_size(cls, requested: int | None) -> int:
        """The page size to run with: ``requested``, or the backend's default when None."""
        size = cls.default_block_size if requested is None else requested
        allowed = cls.get_supported_block_sizes()
        if size < 1 or (allowed is not None and size not in allowed):
            raise PagedgenError(f"backend '{cls.name}' cannot use block size {size}; "
                                f"supported: {allowed or 'any >= 1'}")
        return size

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int) -> tuple[int, ...]:
        """One layer's cache: [num_blocks, 2 (K, V), block_size, num_kv_heads, head_size]."""
        return (num_blocks, 2, block_size, num_kv_heads, head_size)

    @staticmethod
    def blocks_view(kv_cache: torch.Tensor) -> torch.Tensor:
        """The cache seen as [num_blocks, 2, block_size, num_kv_heads, head_size] (a view), the
        layout tests and `verify` fill and compare in."""
        return kv_cache

    @staticmethod
    def from_blocks_view(blocks: torch.Tensor) -> torch.Tensor:
        """The inverse of ``blocks_view``: this backend's cache seen in a [num_blocks, 2,
        block_size, num_kv_heads, head_size] tensor of any strides (a view; a layer whose pages
        share another backend's slab)."""
        return blocks

    @classmethod
    def describe(cls, device: torch.device) -> str:
        """What runs when available (flavour, version); shown by `pagedgen backends`."""
        return "available"

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        """None when the backend can run on ``device``; otherwise why not, in one line."""
        if device.type not in cls.devices:
            return f"runs on {'/'.join(cls.devices)} only, not {device.type}"
        return None

    @classmethod
    def check_layer(cls, spec: LayerSpec, dtype: torch.dtype) -> str | None:
        """None when the backend supports this layer shape and dtype; otherwise why not."""
        if spec.head_size not in cls.get_supported_head_sizes():
            return f"head size {spec.head_size} not in {cls.get_supported_head_sizes()}"
        if dtype not in cls.get_supported_dtypes():
            return f"dtype {dtype} not supported"
        for feature, (flag, uses) in LAYER_FEATURES.items():
            if uses(spec) and not getattr(cls, flag):
                return f"{feature} not supported"
        return None

    @classmethod
    def fp8_kv_reason(cls, device: torch.device) -> str | None:
        """None when it runs an FP8 (e4m3) KV cache on ``device``; otherwise why not."""
        return None if cls.supports_fp8_kv_cache else "no FP8 KV cache"

    @classmethod
    def lacks(cls) -> list[str]:
        """The layer features it cannot run (``LAYER_FEATURES``, and an FP8 KV cache)."""
        return [f for f, (flag, _) in LAYER_FEATURES.items() if not getattr(cls, flag)] \
            + ([] if cls.supports_fp8_kv_cache else ["FP8 KV cache"])

    @classmethod
    def swap_blocks(cls, src: torch.Tensor, dst: torch.Tensor, mapping: torch.Tensor) -> None:
        """Copy blocks ``src[mapping[:,0]]`` → ``dst[mapping[:,1]]`` (device <-> host)."""
        kv_ops.swap_blocks(cls.blocks_view(src), cls.blocks_view(dst), mapping)

    @classmethod
    def copy_blocks(cls, kv_caches: list[torch.Tensor], mapping: torch.Tensor) -> None:
        """Within every layer's cache, copy block ``mapping[:,0]`` → ``mapping[:,1]`` (fork)."""
        kv_ops.copy_blocks([cls.blocks_view(c) for c in kv_caches], mapping)
