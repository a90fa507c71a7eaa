"""The FlashInfer backend (after vLLM's): one workspace, a paged prefill wrapper for the prefill
part of a step and a tensor-core paged decode wrapper for the decode part, planned once per step
by ``FlashInferState.begin_forward`` and run by every layer. CUDA-graph decode uses one decode
wrapper per captured batch size over fixed indptr/indices/last-page buffers, re-planned before
each replay.

The prefill kernel is FlashInfer's ``fa2`` by default (first JIT compile about 30 s on an H100);
``PAGEDGEN_FLASHINFER_PREFILL=fa3`` picks the Hopper kernel (about 1.6x faster prefill at 4k,
first JIT compile about 110 s). Compiled kernels are cached in FlashInfer's JIT cache.
"""

from __future__ import annotations

import importlib.util
import os
from itertools import accumulate
from dataclasses import dataclass, field

import torch

from pagedgen.attention.backend import (AttentionBackend, AttentionImpl, AttentionMetadata,
                                        AttentionState, LayerSpec)
from pagedgen.attention.kv_cache import write_kv

WORKSPACE_BYTES = 256 << 20
INSTALL_HINT = "pip install 'pagedgen[flashinfer]'"


def _key(spec: LayerSpec) -> tuple[int, float]:
    """Layers that share a plan: same window and soft-cap (heads and head size are per model)."""
    return (spec.sliding_window - 1 if spec.sliding_window else -1, spec.logits_soft_cap or 0.0)


@dataclass
class FlashInferPlan:
    """The wrappers planned for one step, by layer key."""

    prefill: dict = field(default_factory=dict)
    decode: dict = field(default_factory=dict)


def paged_kv_arrays(seq_lens: list[int], seq_lens_dev: torch.Tensor,
                    block_tables: torch.Tensor, block_size: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's kv_indptr and kv_last_page_len (int32, CPU: plan reads them on the host) and
    kv_indices (int32, gathered from the block tables on the device)."""
    pages = [-(-n // block_size) for n in seq_lens]
    indptr = [0, *accumulate(pages)]
    last = [n - (p - 1) * block_size for n, p in zip(seq_lens, pages)]
    pages_dev = (seq_lens_dev + block_size - 1) // block_size
    dev = block_tables.device
    rows = torch.repeat_interleave(torch.arange(len(pages), device=dev), pages_dev,
                                   output_size=indptr[-1])
    starts = torch.cumsum(pages_dev, 0) - pages_dev
    cols = torch.arange(indptr[-1], device=dev) - starts[rows]
    i32 = torch.int32
    return (torch.tensor(indptr, dtype=i32), block_tables[rows, cols].to(i32),
            torch.tensor(last, dtype=i32))


class FlashInferState(AttentionState):
    def __init__(self, backend, layer_specs, block_size, dtype, kv_cache_dtype, device) -> None:
        super().__init__(backend, layer_specs, block_size, dtype, kv_cache_dtype, device)
        import flashinfer

        self.fi = flashinfer
        self.prefill_backend = os.environ.get("PAGEDGEN_FLASHINFER_PREFILL", "fa2")
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.keys = sorted({_key(s) for s in layer_specs})
        self.spec = layer_specs[0]
        self.plan = FlashInferPlan(
            prefill={k: flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                self.workspace, "NHD", backend=self.prefill_backend) for k in self.keys},
            decode={k: flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_tensor_cores=True) for k in self.keys})
        self.graph_plans: dict[int, FlashInferPlan] = {}
        self._graph_buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    # ---- CUDA graphs --------------------------------------------------------------------------

    def make_graph_plan(self, batch_size: int, max_num_pages: int) -> None:
        """Decode wrappers for one captured batch size, over fixed (shared) buffers."""
        if self._graph_buffers is None:
            self._graph_buffers = (
                torch.zeros(batch_size + 1, dtype=torch.int32, device=self.device),
                torch.zeros(max_num_pages, dtype=torch.int32, device=self.device),
                torch.zeros(batch_size, dtype=torch.int32, device=self.device))
        indptr, indices, last = self._graph_buffers
        self.graph_plans[batch_size] = FlashInferPlan(decode={
            k: self.fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True,
                paged_kv_indptr_buffer=indptr[:batch_size + 1], paged_kv_indices_buffer=indices,
                paged_kv_last_page_len_buffer=last[:batch_size]) for k in self.keys})

    # ---- per step -----------------------------------------------------------------------------

    def begin_forward(self, metadata: AttentionMetadata, graph_batch_size: int | None = None
                      ) -> None:
        s, md = self.spec, metadata
        common = dict(q_data_type=self.dtype, kv_data_type=self.kv_cache_dtype)
        plan = self.plan if graph_batch_size is None else self.graph_plans[graph_batch_size]
        if md.num_prefills:
            p = md.num_prefills
            indptr, indices, last = paged_kv_arrays(md.seq_lens_cpu[:p], md.seq_lens[:p],
                                                    md.block_tables[:p], md.block_size)
            qo = torch.tensor([0] + md.query_lens_cpu[:p], dtype=torch.int32).cumsum(0,
                                                                                 dtype=torch.int32)
            for (window_left, cap), w in plan.prefill.items():
                w.plan(qo, indptr, indices, last, s.num_heads, s.num_kv_heads, s.head_size,
                       md.block_size, causal=True, sm_scale=s.scale, window_left=window_left,
                       logits_soft_cap=cap or None, **common)
        if md.num_decodes:
            p = md.num_prefills
            indptr, indices, last = paged_kv_arrays(md.seq_lens_cpu[p:], md.seq_lens[p:],
                                                    md.block_tables[p:], md.block_size)
            for (window_left, cap), w in plan.decode.items():
                w.plan(indptr, indices, last, s.num_heads, s.num_kv_heads, s.head_size,
                       md.block_size, sm_scale=s.scale, window_left=window_left,
                       logits_soft_cap=cap or None, **common)
        md.plan = plan


class FlashInferImpl(AttentionImpl):
    def __init__(self, spec: LayerSpec, state: FlashInferState) -> None:
        super().__init__(spec, state)
        self.key = _key(spec)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        st = self.state
        write_kv(kv_cache, k, v, metadata.slot_mapping, st.k_scale, st.v_scale)
        out = torch.empty_like(q)
        n = metadata.num_prefill_tokens
        scales = dict(k_scale=st.k_scale, v_scale=st.v_scale) if kv_cache.dtype.itemsize == 1 \
            else {}
        if n:
            metadata.plan.prefill[self.key].run(q[:n], kv_cache, out=out[:n], **scales)
        if metadata.num_decode_tokens:
            metadata.plan.decode[self.key].run(q[n:], kv_cache, out=out[n:], **scales)
        return out


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"
    devices = ("cuda",)
    supports_cuda_graphs = True
    supports_sliding_window = True
    supports_soft_cap = True
    supports_fp8_kv_cache = True
    supported_dtypes = (torch.float16, torch.bfloat16)

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return FlashInferImpl

    @staticmethod
    def get_state_cls() -> type[AttentionState]:
        return FlashInferState

    @staticmethod
    def get_supported_head_sizes() -> list[int]:
        return [64, 128, 256]

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        if importlib.util.find_spec("flashinfer") is None:
            return f"flashinfer-python is not installed ({INSTALL_HINT})"
        if device.type != "cuda":
            return f"needs a CUDA GPU, not {device.type}"
        if torch.cuda.get_device_capability(device) < (8, 0):
            return "needs an NVIDIA GPU of compute capability 8.0 or newer"
        return None
