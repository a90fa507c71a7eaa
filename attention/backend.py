"""The attention backend interface (after vLLM's ``attention/backends/abstract.py``, simpler).

A backend is one file that implements four small things:

* :class:`AttentionBackend` -- static facts: name, KV-cache shape, head sizes, availability,
  and block swap/copy.
* :class:`AttentionState` -- one per run: owns workspace buffers, plans kernels once per step
  (``begin_forward``) and keeps the static buffers a CUDA graph captures.
* :class:`AttentionImpl` -- one per layer: ``forward(q, k, v, kv_cache, metadata)`` writes the new
  tokens' K/V into the paged cache and returns attention over every cached token.
* :class:`AttentionMetadata` -- one per step, built by :class:`AttentionMetadataBuilder`:
  prefill tokens first, then decode tokens.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence

import torch

from pagedgen.attention import kv_cache as kv_ops
from pagedgen.errors import PagedgenError
from pagedgen.runtime.transfer import host_tensor, to_device, upload


class AttentionType(str, enum.Enum):
    """What a layer attends to: its own causal past (DECODER) or the whole input (ENCODER)."""

    DECODER = "decoder"
    ENCODER = "encoder"


@dataclass
class AttentionMetadata:
    """Per-step description of a flat token batch over the paged KV cache.

    Sequences ``0 .. num_prefills-1`` are prefills (one or more new tokens, possibly with
    ``context_lens`` tokens already cached); the rest are decodes (exactly one new token).
    Device tensors:

    * ``slot_mapping`` [num_tokens] int64: cache slot (block * block_size + offset) of each new token.
    * ``query_start_loc`` [num_seqs + 1] int32: where each sequence's new tokens start.
    * ``seq_lens`` [num_seqs] int32: cached + new tokens per sequence after this step.
    * ``context_lens`` [num_seqs] int32: tokens already cached before this step.
    * ``block_tables`` [num_seqs, max_blocks] int32: physical block of each logical block (0-padded).

    ``cascade_blocks`` (decode-only steps): the leading block-table entries every sequence
    shares, to be attended once for the batch (attention/cascade.py); 0: no cascade.
    """

    num_prefills: int
    num_prefill_tokens: int
    num_decode_tokens: int
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    block_size: int
    seq_lens_cpu: list[int]
    query_lens_cpu: list[int]
    cascade_blocks: int = 0
    # Backend-private data set by ``AttentionState.begin_forward`` (planned wrappers, buffers).
    plan: Any = None
    _prefill: AttentionMetadata | None = field(default=None, repr=False)
    _decode: AttentionMetadata | None = field(default=None, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_decodes(self) -> int:
        return self.num_seqs - self.num_prefills

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_cpu, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)

    @property
    def prefill_metadata(self) -> AttentionMetadata | None:
        """A view of the prefill sequences only (None when there are none)."""
        if self.num_prefills == 0:
            return None
        if self._prefill is None:
            self._prefill = self._slice(0, self.num_prefills, 0, self.num_prefill_tokens)
        return self._prefill

    @property
    def decode_metadata(self) -> AttentionMetadata | None:
        """A view of the decode sequences only (None when there are none)."""
        if self.num_decodes == 0:
            return None
        if self._decode is None:
            self._decode = self._slice(self.num_prefills, self.num_seqs,
                                       self.num_prefill_tokens, self.num_tokens)
        return self._decode

    def _slice(self, s0: int, s1: int, t0: int, t1: int) -> AttentionMetadata:
        is_prefill = s0 == 0 and self.num_prefills > 0
        return AttentionMetadata(
            num_prefills=s1 - s0 if is_prefill else 0,
            num_prefill_tokens=t1 - t0 if is_prefill else 0,
            num_decode_tokens=0 if is_prefill else t1 - t0,
            slot_mapping=self.slot_mapping[t0:t1],
            query_start_loc=self.query_start_loc[s0:s1 + 1] - t0,
            seq_lens=self.seq_lens[s0:s1],
            context_lens=self.context_lens[s0:s1],
            block_tables=self.block_tables[s0:s1],
            block_size=self.block_size,
            seq_lens_cpu=self.seq_lens_cpu[s0:s1],
            query_lens_cpu=self.query_lens_cpu[s0:s1],
            cascade_blocks=0 if is_prefill else self.cascade_blocks,
            plan=self.plan,
        )


@dataclass
class ScheduledSeq:
    """What the builder needs to know about one sequence in a step."""

    block_table: Sequence[int]
    num_context: int  # tokens already in the cache
    num_new: int  # tokens computed this step


class AttentionMetadataBuilder:
    """Builds :class:`AttentionMetadata` for a step from its scheduled sequences (CPU → device).

    ``cascade``: find the pages every decode of a decode-only step shares (``cascade_blocks``).
    """

    def __init__(self, block_size: int, device: torch.device, cascade: bool = False) -> None:
        self.block_size = block_size
        self.device = device
        self.cascade = cascade

    def build(self, prefills: Sequence[ScheduledSeq], decodes: Sequence[ScheduledSeq]
              ) -> AttentionMetadata:
        seqs = list(prefills) + list(decodes)
        bs = self.block_size
        slots: list[int] = []
        qsl = [0]
        for s in seqs:
            for pos in range(s.num_context, s.num_context + s.num_new):
                slots.append(s.block_table[pos // bs] * bs + pos % bs)
            qsl.append(qsl[-1] + s.num_new)
        max_blocks = max((len(s.block_table) for s in seqs), default=0)
        tables = [list(s.block_table) + [0] * (max_blocks - len(s.block_table)) for s in seqs]
        seq_lens = [s.num_context + s.num_new for s in seqs]
        dev = self.device

        def t(x: list, dtype: torch.dtype) -> torch.Tensor:
            return to_device(x, dtype, dev)

        num_prefill_tokens = sum(s.num_new for s in prefills)
        tables_cpu = host_tensor(tables, torch.int32, dev).reshape(len(seqs), max_blocks)
        shared = 0
        if self.cascade and not prefills:
            from pagedgen.attention.cascade import common_prefix_blocks
            shared = common_prefix_blocks(tables_cpu, min(seq_lens, default=0), bs)
        return AttentionMetadata(
            num_prefills=len(prefills),
            num_prefill_tokens=num_prefill_tokens,
            num_decode_tokens=qsl[-1] - num_prefill_tokens,
            slot_mapping=t(slots, torch.int64),
            query_start_loc=t(qsl, torch.int32),
            seq_lens=t(seq_lens, torch.int32),
            context_lens=t([s.num_context for s in seqs], torch.int32),
            block_tables=upload(tables_cpu, dev),
            block_size=bs,
            seq_lens_cpu=seq_lens,
            query_lens_cpu=[s.num_new for s in seqs],
            cascade_blocks=shared,
        )


@dataclass
class LayerSpec:
    """The attention shape of one layer, as the model declares it."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    sliding_window: int | None = None  # attend to the last `sliding_window` positions, self included
    logits_soft_cap: float | None = None  # logits = cap * tanh(logits / cap)
    attn_type: AttentionType = AttentionType.DECODER


class AttentionImpl(ABC):
    """One layer's attention computation over the paged cache."""

    def __init__(self, spec: LayerSpec, state: AttentionState) -> None:
        self.spec = spec
        self.state = state

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] for the step's new tokens → output [T, Hq, D].

        Writes k/v into ``kv_cache`` at ``metadata.slot_mapping`` first.
        """


class AttentionState:
    """Per-run backend state: workspace buffers, per-step planning, CUDA-graph buffers.

    The default plans nothing; backends with kernel plans (FlashInfer) override ``begin_forward``.
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
        # Whether forward can run a step with ``metadata.cascade_blocks`` (attention/cascade.py).
        self.supports_cascade = False
        # FP8 caches store value / scale; readers multiply back.
        self.k_scale = 1.0
        self.v_scale = 1.0

    def begin_forward(self, metadata: AttentionMetadata, graph_batch_size: int | None = None
                      ) -> None:
        """Plan the step's kernels once (not once per layer); store the plan in metadata.plan.

        ``graph_batch_size``: plan into the buffers captured for that CUDA-graph batch size.
        """

    def warmup(self, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int
               ) -> None:
        """Compile (JIT) every kernel variant a run of these limits can launch, so that neither
        timing nor CUDA-graph capture pays for compiles. Default: nothing to compile."""

    def compile_stats(self) -> dict[str, float | int]:
        """Warm-up figures for the run summary (e.g. compile seconds, variants compiled)."""
        return {}

    def make_graph_plan(self, batch_size: int, max_num_pages: int, cascade: bool = False
                        ) -> None:
        """Allocate what a CUDA graph of ``batch_size`` decodes captures (backends that declare
        ``supports_cuda_graphs``). ``max_num_pages``: the most page-table entries such a step
        can hold (more than the cache's blocks when sequences share prefix blocks).
        ``cascade``: the graph's steps attend shared pages once (``cascade_blocks`` > 0)."""
        raise NotImplementedError(f"{self.backend.name} does not support CUDA graphs")


class AttentionBackend(ABC):
    """Static facts about a backend. Subclasses are registered in ``registry.py``."""

    name: ClassVar[str]
    devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    supports_cuda_graphs: ClassVar[bool] = False
    supports_sliding_window: ClassVar[bool] = False
    supports_soft_cap: ClassVar[bool] = False
    supports_fp8_kv_cache: ClassVar[bool] = False
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
        if dtype not in cls.supported_dtypes:
            return f"dtype {dtype} not supported"
        if spec.sliding_window is not None and not cls.supports_sliding_window:
            return "sliding window not supported"
        if spec.logits_soft_cap is not None and not cls.supports_soft_cap:
            return "logits soft-cap not supported"
        return None

    @classmethod
    def swap_blocks(cls, src: torch.Tensor, dst: torch.Tensor, mapping: torch.Tensor) -> None:
        """Copy blocks ``src[mapping[:,0]]`` → ``dst[mapping[:,1]]`` (device <-> host)."""
        kv_ops.swap_blocks(cls.blocks_view(src), cls.blocks_view(dst), mapping)

    @classmethod
    def copy_blocks(cls, kv_caches: list[torch.Tensor], mapping: torch.Tensor) -> None:
        """Within every layer's cache, copy block ``mapping[:,0]`` → ``mapping[:,1]`` (fork)."""
        kv_ops.copy_blocks([cls.blocks_view(c) for c in kv_caches], mapping)
