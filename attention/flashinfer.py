"""The FlashInfer backend (after vLLM's): one workspace, a paged prefill wrapper for the prefill
part of a step and a tensor-core paged decode wrapper for the decode part, planned once per step
by ``FlashInferState.build`` (into ``FlashInferMetadata.plan``) and run by every layer.
CUDA-graph decode uses one decode wrapper per captured batch size over fixed
indptr/indices/last-page buffers, re-planned before each replay.

Cascade decode (attention/cascade.py): a paged prefill wrapper attends the B decode queries as
one non-causal sequence over the shared pages, the decode wrapper each sequence's suffix, and
``flashinfer.merge_state`` merges the two by their log-sum-exp; CUDA graphs of cascade steps
hold their own wrappers (prefill in CUDA-graph mode over fixed buffers).

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

from pagedgen.attention.backend import AttentionBackend, AttentionImpl, AttentionState, LayerSpec
from pagedgen.attention.cascade import CascadeInputs
from pagedgen.attention.metadata import AttentionMetadata
from pagedgen.attention.ops.kv_cache import write_kv

WORKSPACE_BYTES = 256 << 20
INSTALL_HINT = "pip install 'pagedgen[flashinfer]'"


def _key(spec: LayerSpec) -> tuple[int, float]:
    """Layers that share a plan: same window and soft-cap (heads and head size are per model)."""
    return (spec.sliding_window - 1 if spec.sliding_window else -1, spec.logits_soft_cap or 0.0)


@dataclass
class FlashInferPlan:
    """The wrappers planned for one step, by layer key (``prefix``: cascade steps' shared
    pages)."""

    prefill: dict = field(default_factory=dict)
    decode: dict = field(default_factory=dict)
    prefix: dict = field(default_factory=dict)


@dataclass
class FlashInferMetadata(AttentionMetadata):
    """A step's metadata with the wrappers planned for it."""

    plan: FlashInferPlan = field(default_factory=FlashInferPlan)


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
                self.workspace, "NHD", use_tensor_cores=True) for k in self.keys},
            prefix={k: flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                self.workspace, "NHD", backend=self.prefill_backend) for k in self.keys})
        # by cascade (False / True), then CUDA-graph batch size
        self.graph_plans: dict[bool, dict[int, FlashInferPlan]] = {False: {}, True: {}}
        self._graph_buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._prefix_buffers: tuple[torch.Tensor, ...] | None = None
        # A window would cut into the shared prefix differently per sequence.
        self.supports_cascade = not any(s.sliding_window for s in layer_specs)

    # ---- CUDA graphs --------------------------------------------------------------------------

    def make_graph_plan(self, batch_size: int, max_num_pages: int, cascade: bool = False
                        ) -> None:
        """Decode wrappers for one captured batch size, over fixed buffers shared by every
        graph (plain graphs capture at start-up, the largest first); a cascade graph's prefix
        wrappers have fixed buffers of their own."""
        i32, dev = torch.int32, self.device
        if self._graph_buffers is None:
            self._graph_buffers = (torch.zeros(batch_size + 1, dtype=i32, device=dev),
                                   torch.zeros(max_num_pages, dtype=i32, device=dev),
                                   torch.zeros(batch_size, dtype=i32, device=dev))
        indptr, indices, last = self._graph_buffers
        plan = FlashInferPlan(decode={
            k: self.fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True,
                paged_kv_indptr_buffer=indptr[:batch_size + 1], paged_kv_indices_buffer=indices,
                paged_kv_last_page_len_buffer=last[:batch_size]) for k in self.keys})
        if cascade:
            if self._prefix_buffers is None:  # one sequence: the batch over the shared pages
                self._prefix_buffers = (torch.zeros(2, dtype=i32, device=dev),
                                        torch.zeros(2, dtype=i32, device=dev),
                                        torch.zeros(max_num_pages // batch_size, dtype=i32,
                                                    device=dev),
                                        torch.zeros(1, dtype=i32, device=dev))
            qo, kv_indptr, kv_indices, kv_last = self._prefix_buffers
            plan.prefix = {k: self.fi.BatchPrefillWithPagedKVCacheWrapper(
                self.workspace, "NHD", backend=self.prefill_backend, use_cuda_graph=True,
                qo_indptr_buf=qo, paged_kv_indptr_buf=kv_indptr,
                paged_kv_indices_buf=kv_indices, paged_kv_last_page_len_buf=kv_last)
                for k in self.keys}
        self.graph_plans[cascade][batch_size] = plan

    def warmup(self, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int
               ) -> None:
        """Compile (JIT) ``merge_state`` now, not in the first cascade step."""
        if self.supports_cascade and self.device.type == "cuda":
            v = torch.zeros(1, 1, self.spec.head_size, dtype=self.dtype, device=self.device)
            s = torch.zeros(1, 1, dtype=torch.float32, device=self.device)
            self.fi.merge_state(v, s, v, s)

    # ---- per step -----------------------------------------------------------------------------

    def build(self, metadata: AttentionMetadata, graph_batch_size: int | None = None
              ) -> FlashInferMetadata:
        s, md = self.spec, metadata
        common = dict(q_data_type=self.dtype, kv_data_type=self.kv_cache_dtype)
        plan = self.plan if graph_batch_size is None else \
            self.graph_plans[md.cascade_blocks > 0][graph_batch_size]
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
        if md.cascade_blocks:  # decode-only: the shared pages, then each suffix
            x = CascadeInputs.for_step(md)
            pages = md.cascade_blocks
            qo = torch.tensor([0, md.num_decodes], dtype=torch.int32)
            kv_indptr = torch.tensor([0, pages], dtype=torch.int32)
            kv_last = torch.tensor([md.block_size], dtype=torch.int32)
            for (window_left, cap), w in plan.prefix.items():
                w.plan(qo, kv_indptr, x.prefix_table[0, :pages], kv_last, s.num_heads,
                       s.num_kv_heads, s.head_size, md.block_size, causal=False, sm_scale=s.scale,
                       logits_soft_cap=cap or None, **common)
            indptr, indices, last = paged_kv_arrays(x.suffix_lens_cpu, x.suffix_lens,
                                                    x.suffix_tables, md.block_size)
        elif md.num_decodes:
            p = md.num_prefills
            indptr, indices, last = paged_kv_arrays(md.seq_lens_cpu[p:], md.seq_lens[p:],
                                                    md.block_tables[p:], md.block_size)
        if md.num_decodes:
            for (window_left, cap), w in plan.decode.items():
                w.plan(indptr, indices, last, s.num_heads, s.num_kv_heads, s.head_size,
                       md.block_size, sm_scale=s.scale, window_left=window_left,
                       logits_soft_cap=cap or None, **common)
        return md.extend(FlashInferMetadata, plan=plan)


class FlashInferImpl(AttentionImpl):
    def __init__(self, spec: LayerSpec, state: FlashInferState) -> None:
        super().__init__(spec, state)
        self.key = _key(spec)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: FlashInferMetadata) -> torch.Tensor:
        st = self.state
        write_kv(kv_cache, k, v, metadata.slot_mapping, st.k_scale, st.v_scale)
        out = torch.empty_like(q)
        n = metadata.num_prefill_tokens
        scales = dict(k_scale=st.k_scale, v_scale=st.v_scale) if kv_cache.dtype.itemsize == 1 \
            else {}
        if metadata.cascade_blocks:  # decode-only
            plan = metadata.plan
            pre, pre_lse = plan.prefix[self.key].run(q, kv_cache, return_lse=True, **scales)
            suf, suf_lse = plan.decode[self.key].run(q, kv_cache, return_lse=True, **scales)
            return st.fi.merge_state(pre, pre_lse, suf, suf_lse)[0]
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
