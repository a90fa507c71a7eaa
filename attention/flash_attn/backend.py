"""The FlashAttention backend (after vLLM's): paged prefill (with prior cached context) and paged
decode straight from the block tables, over the flash-attn family's own kernels (the flavour:
``flavours.py``; their calls: ``fa4.py``, ``fa2_fa3.py``).

The backend owns its page size and cache layout: separate K and V caches ``[num_pages,
page_size, kv_heads, head_dim]`` stacked as one tensor ``[2, num_pages, ...]`` per layer.
"""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass
from functools import partial

import torch

from pagedgen.attention.backend import AttentionBackend, AttentionImpl, AttentionState
from pagedgen.attention.cascade import CascadeBuffers, CascadeInputs
from pagedgen.attention.cascade_layout import MIN_SEQS, CascadeLayout, Group
from pagedgen.attention.fa4_import import import_fa4
from pagedgen.attention.flash_attn.fa2_fa3 import fa2_calls, fa3_calls
from pagedgen.attention.flash_attn.fa4 import (
    cascade_suffix_kernel,
    fa4_calls,
    fa4_decode_tile,
    fa4_group_tile,
    fa4_prefill_tiles,
)
from pagedgen.attention.flash_attn.flavours import (
    FLAVOURS,
    INSTALL_HINT,
    Flavour,
    default_page_size,
    installed,
    select_flavour,
    version,
)
from pagedgen.attention.metadata import AttentionMetadata
from pagedgen.attention.ops.kv_cache import write_kv_split
from pagedgen.errors import PagedgenError

_CALLS = {"fa4": fa4_calls, "fa3": fa3_calls, "fa2": fa2_calls}


def _compiled_variants(mod) -> int:
    """FA4's compiled forward kernels so far (in-memory and on-disk caches both keep ``cache``)."""
    fwd = getattr(getattr(mod, "interface", None), "_flash_attn_fwd", None)
    return len(getattr(getattr(fwd, "compile_cache", None), "cache", {}))


@dataclass
class FlashAttnCascadeMetadata(AttentionMetadata):
    """A cascade step's metadata: its groups' and suffixes' device inputs."""

    cascade_inputs: CascadeInputs | None = None


class FlashAttnState(AttentionState):
    """Holds the chosen flavour's kernel calls; plans nothing (the kernels read the metadata's
    device tensors directly), so CUDA graphs need no buffers of their own."""

    def __init__(self, backend, layer_specs, block_size, dtype, kv_cache_dtype, device,
                 flavour: Flavour | None = None) -> None:
        super().__init__(backend, layer_specs, block_size, dtype, kv_cache_dtype, device)
        self.flavour = flavour or FlashAttnBackend.flavour(device)
        self.module = import_fa4() if self.flavour.name == "fa4" \
            else importlib.import_module(self.flavour.module)
        # FA4 splits the KV of long decodes on SM100 only ("SplitKV not supported on SM 9.0").
        split_kv = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 10
        calls, self.decode_tile, self.prefill_tiles = _CALLS[self.flavour.name], None, None
        if self.flavour.name == "fa4":
            self.decode_tile = fa4_decode_tile(device)
            self.cascade_suffix = cascade_suffix_kernel()
            self.prefill_tiles = fa4_prefill_tiles(device, block_size)
            calls = partial(calls, decode_tile=self.decode_tile,
                            prefill_tiles=self.prefill_tiles, suffix=self.cascade_suffix,
                            group_tile=fa4_group_tile(device))
        self.prefill, self.decode, self.cascade = calls(self.module, split_kv)
        # A window would cut into the shared prefix differently per sequence.
        self.supports_cascade = self.cascade is not None and not any(
            s.sliding_window for s in layer_specs)
        self.supports_mixed_cascade = self.supports_cascade
        self.cascade_buffers = CascadeBuffers(device)
        self.warmup_s = 0.0
        self.compiled_at_warmup = 0
        self._compiled_before = _compiled_variants(self.module)

    def make_graph_plan(self, batch_size: int, max_num_pages: int, cascade_levels: int = 0,
                        cascade_segments: int = 0) -> None:
        """Plain graphs capture the runner's block tables and lengths; cascade graphs also
        their own group and suffix buffers."""
        if cascade_levels:
            self.cascade_buffers.allocate(batch_size, cascade_levels, cascade_segments,
                                          max_num_pages)

    def build(self, metadata: AttentionMetadata, graph_batch_size: int | None = None
              ) -> AttentionMetadata:
        """Cascade steps only: the groups' and the suffixes' inputs (of the decode rows)."""
        md = metadata
        if md.cascade is None:
            return md
        return md.extend(FlashAttnCascadeMetadata,
                         cascade_inputs=self.cascade_buffers.inputs(md, graph_batch_size))

    def warmup(self, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int
               ) -> None:
        """Launch each kernel variant a run of these limits can select, on a 1-page cache.

        FA4 specialises on: decode with or without a KV split (the split count follows from
        batch x KV heads against the SM count, and from the page-table width), prefill whose
        query rows fit one tile or not, more than 256 prefills at once, and each layer's window
        and soft-cap.
        """
        t0 = time.perf_counter()
        wide = -(-max_model_len // self.block_size)
        decodes = [(1, 1, wide), (max_num_seqs, 1, 1)]
        prefills = []
        for n in sorted({1, min(max_num_seqs, 257)}):
            longest = min(max_num_batched_tokens // n, max_model_len, 256)
            prefills += [(n, q_len, -(-q_len // self.block_size)) for q_len in {1, longest}]
        for spec in {(s.sliding_window, s.logits_soft_cap): s for s in self.layer_specs}.values():
            cache = torch.zeros(2, 1, self.block_size, spec.num_kv_heads, spec.head_size,
                                dtype=self.dtype, device=self.device)
            for run, shapes in ((self.decode, decodes), (self.prefill, prefills)):
                for n, q_len, width in shapes:
                    q = torch.zeros(n * q_len, spec.num_heads, spec.head_size, dtype=self.dtype,
                                    device=self.device)
                    run(q, cache[0], cache[1], self._scratch_metadata(n, q_len, width), spec)
            for n in sorted({MIN_SEQS, max_num_seqs}) if self.supports_cascade else ():
                md = self._scratch_metadata(n, 1, max(wide, 2))  # a suffix page too
                md.cascade = CascadeLayout(list(range(n)), [[Group(0, n, 0, 1, (0,))]],
                                           [1] * n, self.block_size)
                q = torch.zeros(n, spec.num_heads, spec.head_size, dtype=self.dtype,
                                device=self.device)
                self.cascade(q, cache, CascadeInputs.for_step(md), spec)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.warmup_s = time.perf_counter() - t0
        self.compiled_at_warmup = _compiled_variants(self.module) - self._compiled_before

    def _scratch_metadata(self, n: int, q_len: int, width: int) -> AttentionMetadata:
        """``n`` sequences of ``q_len`` new tokens (no context) whose ``width``-entry block
        tables all point at page 0."""
        dev, i32 = self.device, torch.int32
        prefill = q_len > 1
        return AttentionMetadata(
            num_prefills=n if prefill else 0, num_prefill_tokens=n * q_len if prefill else 0,
            num_decode_tokens=0 if prefill else n,
            slot_mapping=torch.zeros(n * q_len, dtype=torch.long, device=dev),
            query_start_loc=torch.arange(0, n * q_len + 1, q_len, dtype=i32, device=dev),
            seq_lens=torch.full((n,), q_len, dtype=i32, device=dev),
            context_lens=torch.zeros(n, dtype=i32, device=dev),
            block_tables=torch.zeros(n, width, dtype=i32, device=dev),
            block_size=self.block_size, seq_lens_cpu=[q_len] * n, query_lens_cpu=[q_len] * n)

    def compile_stats(self) -> dict[str, float | int]:
        out: dict[str, float | int] = {"attention_warmup_s": self.warmup_s}
        if self.flavour.name == "fa4":
            out["attention_kernels_compiled_at_warmup"] = self.compiled_at_warmup
            out["attention_kernels_compiled_later"] = (
                _compiled_variants(self.module) - self._compiled_before - self.compiled_at_warmup)
        return out


class FlashAttnImpl(AttentionImpl):
    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        write_kv_split(kv_cache[0], kv_cache[1], k, v, slot_mapping)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               metadata: AttentionMetadata) -> torch.Tensor:
        st, spec = self.state, self.spec
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        t0 = metadata.num_prefill_tokens
        if t0 == q.shape[0]:
            return st.prefill(q, k_cache, v_cache, metadata.prefill_metadata, spec)
        # with prefills, the decodes write their rows of the same tensor (no concatenation)
        out = torch.empty_like(q) if t0 else None
        if t0:
            st.prefill(q[:t0], k_cache, v_cache, metadata.prefill_metadata, spec, out=out[:t0])
        rows = None if out is None else out[t0:]
        if metadata.cascade is not None:  # the decodes, grouped
            dec = st.cascade(q[t0:], kv_cache, metadata.cascade_inputs, spec, out=rows)
        else:
            dec = st.decode(q[t0:], k_cache, v_cache, metadata.decode_metadata, spec, out=rows)
        return dec if out is None else out


class FlashAttnBackend(AttentionBackend):
    name = "flash-attn"
    devices = ("cuda",)
    supports_cuda_graphs = True
    supports_sliding_window = True
    supports_soft_cap = True
    supported_dtypes = (torch.float16, torch.bfloat16)

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return FlashAttnImpl

    @staticmethod
    def get_state_cls() -> type[AttentionState]:
        return FlashAttnState

    @staticmethod
    def get_supported_head_sizes() -> list[int]:
        return [64, 128, 256]

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int) -> tuple[int, ...]:
        """[2 (K, V), num_blocks, block_size, num_kv_heads, head_size]: K and V caches apart."""
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def blocks_view(kv_cache: torch.Tensor) -> torch.Tensor:
        return kv_cache.transpose(0, 1)

    @staticmethod
    def from_blocks_view(blocks: torch.Tensor) -> torch.Tensor:
        return blocks.transpose(0, 1)

    @classmethod
    def flavour(cls, device: torch.device | None = None) -> Flavour:
        device = device or torch.device("cuda")
        f, why = select_flavour(device)
        if f is None:
            raise PagedgenError(f"backend 'flash-attn' cannot run on {device}: {why}")
        return f

    @classmethod
    def get_supported_block_sizes(cls) -> list[int] | None:
        f, _ = select_flavour(torch.device("cuda"))
        return list(f.block_sizes) if f is not None and f.block_sizes else None

    @classmethod
    def resolve_block_size(cls, requested: int | None) -> int:
        f, _ = select_flavour(torch.device("cuda"))
        if requested is None and f is not None:
            return default_page_size(f, torch.device("cuda"))
        return super().resolve_block_size(requested)

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        f, why = select_flavour(device)
        if f is not None:
            return None
        if not any(installed(x) for x in FLAVOURS):
            return f"no flash-attn flavour is installed ({INSTALL_HINT}): {why}"
        return why

    @classmethod
    def describe(cls, device: torch.device) -> str:
        f, notes = select_flavour(device)
        tile, page = "", default_page_size(f, device)
        if f.name == "fa4":
            shown = lambda t: "x".join(map(str, t)) if t else "FA4 own"  # noqa: E731
            try:
                tile = (f", decode tile {shown(fa4_decode_tile(device))}, prefill tile over head "
                        f"size 128 {shown(fa4_prefill_tiles(device, page)[1])}")
            except PagedgenError as e:
                tile = f", {e}"
        return f"runs {f.name} {version(f)}, page size {page}{tile} ({notes})"
