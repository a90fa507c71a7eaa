"""The FlashInfer backend (after vLLM's): one workspace, a paged prefill wrapper for the prefill
part of a step and a tensor-core paged decode wrapper for the decode part, planned once per step
by ``FlashInferState.build`` (into ``FlashInferMetadata.plan``) and run by every layer.
CUDA-graph decode uses one decode wrapper per captured batch size over fixed
indptr/indices/last-page buffers, re-planned before each replay.

Grouped cascade decode (attention/cascade.py): per level, a paged prefill wrapper attends each
group's queries (sorted) as one non-causal sequence over its pages, the decode wrapper each
sequence's suffix, and ``flashinfer.merge_state_in_place`` merges each level into the suffixes
by their log-sum-exp (masked to the rows a group holds); CUDA graphs of cascade steps hold
their own wrappers (prefill in CUDA-graph mode over fixed buffers).

The prefill kernel is FlashInfer's ``fa2`` by default (first JIT compile about 30 s on an H100);
``PAGEDGEN_FLASHINFER_PREFILL=fa3`` picks the Hopper kernel (about 1.6x faster prefill at 4k,
first JIT compile about 110 s). Compiled kernels are cached in FlashInfer's JIT cache.

Over an FP8 KV cache on Hopper, decode runs FlashInfer's XQA kernel (TensorRT-LLM's FP8 MHA for
SM90, ``xqa_batch_decode_with_kv_cache``) where it takes the layers (no soft-cap; pages of
16-128): it reads the block tables and lengths on the device, so it plans nothing per step, and
CUDA graphs capture it as it is. ``PAGEDGEN_FLASHINFER_DECODE=fa2`` keeps the tensor-core paged
decode; cascade steps keep it too (they merge by log-sum-exp, which XQA does not return).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from itertools import accumulate

import torch

from pagedgen import envs
from pagedgen.attention.backend import AttentionBackend, AttentionImpl, AttentionState, LayerSpec
from pagedgen.attention.cascade import CascadeBuffers
from pagedgen.attention.metadata import AttentionMetadata
from pagedgen.attention.ops.kv_cache import write_kv
from pagedgen.errors import PagedgenError, first_line

WORKSPACE_BYTES = 256 << 20
# XQA's: 8 MiB of semaphores (zero before first use; the kernel leaves them so), then scratch
# for split-KV partials (a few MiB at most: it splits only batches too small to fill the GPU)
XQA_WORKSPACE_BYTES = 40 << 20
INSTALL_HINT = "pip install 'pagedgen[flashinfer]'"
XQA_PAGES = (16, 32, 64, 128)


def xqa_decodes(specs: list[LayerSpec], block_size: int, kv_cache_dtype: torch.dtype,
                device: torch.device) -> bool:
    """Whether decode runs XQA: asked for or left to the code, on Hopper (SM90), over an FP8
    (e4m3) cache, pages of 16-128 tokens, head sizes of multiples of 16 up to 256, no
    soft-cap."""
    asked = envs.FLASHINFER_DECODE.get()
    if asked == "fa2":
        return False
    runs = (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
            and kv_cache_dtype == torch.float8_e4m3fn and block_size in XQA_PAGES
            and all(not s.logits_soft_cap and s.head_size % 16 == 0 and s.head_size <= 256
                    for s in specs))
    if asked == "xqa" and not runs:
        raise PagedgenError(f"{envs.FLASHINFER_DECODE.name}=xqa: XQA decodes on Hopper (SM90) "
                            f"over an FP8 KV cache with pages of {'/'.join(map(str, XQA_PAGES))}"
                            " tokens and no soft-cap")
    return runs


def _key(spec: LayerSpec) -> tuple[int, float]:
    """Layers that share a plan: same window and soft-cap (heads and head size are per model)."""
    return (spec.sliding_window - 1 if spec.sliding_window else -1, spec.logits_soft_cap or 0.0)


@dataclass
class FlashInferPlan:
    """The wrappers planned for one step, by layer key (``groups``: cascade steps' groups, one
    wrapper per level; ``cascade``: their device inputs, ``members`` [L, B] bool by row)."""

    prefill: dict = field(default_factory=dict)
    decode: dict = field(default_factory=dict)
    groups: list[dict] = field(default_factory=list)
    cascade: object = None
    members: torch.Tensor | None = None


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
        self.prefill_backend = envs.FLASHINFER_PREFILL.get() or "fa2"
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.keys = sorted({_key(s) for s in layer_specs})
        self.spec = layer_specs[0]
        self.plan = FlashInferPlan(
            prefill={k: flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                self.workspace, "NHD", backend=self.prefill_backend) for k in self.keys},
            decode={k: flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_tensor_cores=True) for k in self.keys},
            groups=[{k: flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                self.workspace, "NHD", backend=self.prefill_backend) for k in self.keys}
                for _ in range(self.max_cascade_levels)])
        # by cascade levels and segments ((0, 0): plain), then CUDA-graph batch size
        self.graph_plans: dict[tuple[int, int], dict[int, FlashInferPlan]] = {}
        self._graph_buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.cascade_buffers = CascadeBuffers(device)
        # A window would cut into the shared prefix differently per sequence.
        self.supports_cascade = not any(s.sliding_window for s in layer_specs)
        self.xqa = xqa_decodes(layer_specs, block_size, kv_cache_dtype, device)
        self.xqa_failed: str | None = None  # why XQA's warm-up failed, where it did
        self.xqa_workspace = torch.zeros(XQA_WORKSPACE_BYTES, dtype=torch.uint8,
                                         device=device) if self.xqa else None

    # ---- CUDA graphs --------------------------------------------------------------------------

    def make_graph_plan(self, batch_size: int, max_num_pages: int, cascade_levels: int = 0,
                        cascade_segments: int = 0) -> None:
        """Decode wrappers for one captured batch size, over fixed buffers shared by every
        graph (plain graphs capture at start-up, the largest first); a cascade graph's group
        wrappers (one per level) have fixed buffers of their own."""
        i32, dev = torch.int32, self.device
        if self._graph_buffers is None:
            self._graph_buffers = (torch.zeros(batch_size + 1, dtype=i32, device=dev),
                                   torch.zeros(max_num_pages, dtype=i32, device=dev),
                                   torch.zeros(batch_size, dtype=i32, device=dev))
        indptr, indices, last = self._graph_buffers
        plain_xqa = self.xqa and not cascade_levels  # XQA has no plan
        plan = FlashInferPlan(decode={} if plain_xqa else {
            k: self.fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True,
                paged_kv_indptr_buffer=indptr[:batch_size + 1], paged_kv_indices_buffer=indices,
                paged_kv_last_page_len_buffer=last[:batch_size]) for k in self.keys})
        segs = cascade_segments  # as CascadeInputs: fillers and groups, the last one empty
        for _ in range(cascade_levels):
            qo, kv_indptr, kv_last = (torch.zeros(segs + 1, dtype=i32, device=dev),
                                      torch.zeros(segs + 1, dtype=i32, device=dev),
                                      torch.zeros(segs, dtype=i32, device=dev))
            kv_indices = torch.zeros(max_num_pages, dtype=i32, device=dev)
            plan.groups.append({k: self.fi.BatchPrefillWithPagedKVCacheWrapper(
                self.workspace, "NHD", backend=self.prefill_backend, use_cuda_graph=True,
                qo_indptr_buf=qo, paged_kv_indptr_buf=kv_indptr, paged_kv_indices_buf=kv_indices,
                paged_kv_last_page_len_buf=kv_last) for k in self.keys})
        if cascade_levels:
            self.cascade_buffers.allocate(batch_size, cascade_levels, segs, max_num_pages)
            plan.members = torch.zeros(cascade_levels, batch_size, dtype=torch.bool, device=dev)
        self.graph_plans.setdefault((cascade_levels, segs), {})[batch_size] = plan

    def warmup(self, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int
               ) -> None:
        """Compile (JIT) ``merge_state_in_place`` and XQA's variants now, not in the first
        cascade or decode step."""
        if self.xqa:
            s, dev = self.spec, self.device
            cache = torch.zeros(1, 2, self.block_size, s.num_kv_heads, s.head_size,
                                dtype=self.kv_cache_dtype, device=dev)
            q = torch.zeros(1, s.num_heads, s.head_size, dtype=self.dtype, device=dev)
            one = torch.ones(1, dtype=torch.int32, device=dev)
            try:
                for spec in {_key(x): x for x in self.layer_specs}.values():
                    self.xqa_decode(spec, q, cache, one[:, None] - 1, one, torch.empty_like(q))
            except Exception as e:  # its JIT compile, where nvcc or the driver refuses it
                line = first_line(e, "")
                if envs.FLASHINFER_DECODE.get() == "xqa":
                    raise PagedgenError(f"{envs.FLASHINFER_DECODE.name}=xqa: XQA failed: "
                                        f"{type(e).__name__}: {line}")
                self.xqa = False  # the tensor-core decode, and the summary says why
                self.xqa_failed = f"{type(e).__name__}: {line[:200]}"
        if self.supports_cascade and self.device.type == "cuda":
            v = torch.zeros(1, 1, self.spec.head_size, dtype=self.dtype, device=self.device)
            s = torch.zeros(1, 1, dtype=torch.float32, device=self.device)
            self.fi.merge_state_in_place(v, s, v.clone(), s.clone(),
                                         mask=torch.ones(1, dtype=torch.bool, device=self.device))

    # ---- per step -----------------------------------------------------------------------------

    def build(self, metadata: AttentionMetadata, graph_batch_size: int | None = None
              ) -> FlashInferMetadata:
        s, md = self.spec, metadata
        common = dict(q_data_type=self.dtype, kv_data_type=self.kv_cache_dtype)
        plan = self.plan if graph_batch_size is None else \
            self.graph_plans[md.cascade_levels, md.cascade_segments][graph_batch_size]
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
        if md.cascade is not None:  # decode-only: each level's groups, then each suffix
            x = self.cascade_buffers.inputs(md, graph_batch_size)
            for level, wrappers in zip(self._group_arrays(md, x), plan.groups):
                for (_window_left, cap), w in wrappers.items():
                    w.plan(*level, s.num_heads, s.num_kv_heads, s.head_size, md.block_size,
                           causal=False, sm_scale=s.scale, logits_soft_cap=cap or None, **common)
            plan.cascade = x
            members = x.member.index_select(1, x.pos).bool()  # by row
            if graph_batch_size is None:
                plan.members = members
            else:  # the graph reads its own buffer
                plan.members.copy_(members)
            indptr, indices, last = paged_kv_arrays(x.suffix_lens_cpu, x.suffix_lens,
                                                    x.suffix_tables, md.block_size)
        elif md.num_decodes and self.xqa:
            return md.extend(FlashInferMetadata, plan=plan)
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

    def compile_stats(self) -> dict[str, str]:
        """Which kernel decodes over an FP8 cache (and why not XQA, where it failed)."""
        if self.kv_cache_dtype.itemsize != 1:
            return {}
        kernel = "xqa" if self.xqa else "fa2 tensor-core decode"
        return {"attention_decode_kernel": kernel + (f" (XQA failed: {self.xqa_failed})"
                                                     if self.xqa_failed else "")}

    def xqa_decode(self, spec: LayerSpec, q: torch.Tensor, kv_cache: torch.Tensor,
                   block_tables: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor
                   ) -> None:
        """XQA over each sequence's first ``seq_lens`` cached tokens, into ``out`` (query and
        output contiguous, as XQA reads and writes them)."""
        window = spec.sliding_window - 1 if spec.sliding_window else -1
        dst = out if out.is_contiguous() else torch.empty(out.shape, dtype=out.dtype,
                                                          device=out.device)
        self.fi.decode.xqa_batch_decode_with_kv_cache(
            q.contiguous(), kv_cache, self.xqa_workspace, block_tables, seq_lens,
            block_tables.shape[1] * self.block_size, bmm1_scale=spec.scale * self.k_scale,
            bmm2_scale=self.v_scale, window_left=window, out=dst)
        if dst is not out:
            out.copy_(dst)

    @staticmethod
    def _group_arrays(md: AttentionMetadata, x) -> list[tuple[torch.Tensor, ...]]:
        """Per level, the prefill wrapper's qo_indptr, kv_indptr, kv_indices and
        kv_last_page_len over ``x``'s segments (host tensors: planning reads them there; fillers
        and empty segments attend no pages)."""
        lay, i32 = md.cascade, torch.int32
        segs, b = x.kv_lens.shape[1], x.order.shape[0]
        out = []
        for level in lay.levels:
            qo, pages, last, at = [0], [0], [], 0
            for g in level:
                if g.start > at:  # filler
                    qo.append(g.start)
                    pages.append(pages[-1])
                    last.append(0)
                qo.append(g.end)
                pages.append(pages[-1] + len(g.pages))
                last.append(md.block_size)
                at = g.end
            while len(qo) < segs + 1:  # trailing filler, then empty segments
                qo.append(b)
                pages.append(pages[-1])
                last.append(0)
            indices = [p for g in level for p in g.pages] or [0]
            out.append((torch.tensor(qo, dtype=i32), torch.tensor(pages, dtype=i32),
                        torch.tensor(indices, dtype=i32).to(md.block_tables.device,
                                                            non_blocking=True),
                        torch.tensor(last, dtype=i32)))
        return out


class FlashInferImpl(AttentionImpl):
    def __init__(self, spec: LayerSpec, state: FlashInferState) -> None:
        super().__init__(spec, state)
        self.key = _key(spec)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        write_kv(kv_cache, k, v, slot_mapping, self.state.k_scale, self.state.v_scale)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               metadata: FlashInferMetadata) -> torch.Tensor:
        st = self.state
        out = torch.empty_like(q)
        n = metadata.num_prefill_tokens
        scales = dict(k_scale=st.k_scale, v_scale=st.v_scale) if kv_cache.dtype.itemsize == 1 \
            else {}
        if metadata.cascade is not None:  # decode-only
            plan = metadata.plan
            x = plan.cascade
            out, lse = plan.decode[self.key].run(q, kv_cache, return_lse=True, **scales)
            qs = q.index_select(0, x.order)
            for i, wrappers in enumerate(plan.groups[:x.num_levels]):
                o, s = wrappers[self.key].run(qs, kv_cache, return_lse=True, **scales)
                st.fi.merge_state_in_place(out, lse, o.index_select(0, x.pos),
                                           s.index_select(0, x.pos), mask=plan.members[i])
            return out
        if n:
            metadata.plan.prefill[self.key].run(q[:n], kv_cache, out=out[:n], **scales)
        if metadata.num_decode_tokens and st.xqa:
            p = metadata.num_prefills
            st.xqa_decode(self.spec, q[n:], kv_cache, metadata.block_tables[p:],
                          metadata.seq_lens[p:], out[n:])
        elif metadata.num_decode_tokens:
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
