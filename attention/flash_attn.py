"""The FlashAttention backend (after vLLM's): paged prefill (with prior cached context) and paged
decode straight from the block tables, over the flash-attn family's own kernels.

Flavours, detected in this order (``PAGEDGEN_FLASH_ATTN=fa4|fa3|fa2`` picks one):

* ``fa4`` -- FlashAttention-4 (``flash_attn.cute``, CuTe DSL; SM90 and SM100). Kernels compile at
  first use (a few seconds per variant), so :meth:`FlashAttnState.warmup` launches every variant
  a run can need before timing or CUDA-graph capture; compiled kernels are also kept on disk
  (``FLASH_ATTENTION_CUTE_DSL_CACHE_*``) for the next run.
* ``fa3`` -- FlashAttention-3 (``flash_attn_interface.flash_attn_with_kvcache``; SM90).
* ``fa2`` -- FlashAttention-2 (``flash_attn``; SM80+); pages of a multiple of 256 tokens.

The backend owns its page size and cache layout: separate K and V caches ``[num_pages,
page_size, kv_heads, head_dim]`` stacked as one tensor ``[2, num_pages, ...]`` per layer.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import time
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Callable

import torch
import torch.nn.functional as F

from pagedgen.attention.backend import AttentionBackend, AttentionImpl, AttentionState, LayerSpec
from pagedgen.attention.cascade import CascadeBuffers, CascadeInputs, merge
from pagedgen.attention.cascade_layout import MIN_SEQS, CascadeLayout, Group
from pagedgen.attention.metadata import AttentionMetadata
from pagedgen.attention.fa4_import import import_quack_lean
from pagedgen.attention.ops import paged_decode
from pagedgen.attention.ops.kv_cache import write_kv_split
from pagedgen.errors import PagedgenError

INSTALL_HINT = "pip install 'pagedgen[flash-attn]'"
ENV_FLAVOUR = "PAGEDGEN_FLASH_ATTN"
ENV_DECODE_TILE = "PAGEDGEN_FA4_DECODE_TILE"
ENV_CASCADE_SUFFIX = "PAGEDGEN_FA4_CASCADE_SUFFIX"
ENV_GROUP_TILE = "PAGEDGEN_FA4_GROUP_TILE"


@dataclass(frozen=True)
class Flavour:
    """One member of the flash-attn family: how to find it and what it accepts."""

    name: str
    module: str  # imported by the state; its presence is probed without importing it
    dists: tuple[str, ...]  # distribution names, for the version
    cc_majors: tuple[int, ...]  # compute-capability majors it runs on
    block_sizes: tuple[int, ...] | None  # page sizes its paged kernels accept (None: any)
    default_block_size: int
    probe: str | None = None  # a module whose presence proves the flavour (default: module)


FLAVOURS = (
    # Page 128 = FA4's key tile (hdim 64/128): pages load by TMA (SM90: default_page_size).
    Flavour("fa4", "flash_attn.cute", ("flash-attn-4",), (9, 10, 11), None, 128),
    Flavour("fa3", "flash_attn_interface", ("flash_attn_3", "flash-attn-3"), (9,), None, 16),
    Flavour("fa2", "flash_attn", ("flash-attn",), (8, 9, 10, 11, 12), (256, 512), 256,
            probe="flash_attn_2_cuda"),
)
_BY_NAME = {f.name: f for f in FLAVOURS}


def _installed(f: Flavour) -> bool:
    try:
        return importlib.util.find_spec(f.probe or f.module) is not None
    except (ImportError, ValueError):  # a parent package that is missing or broken
        return False


def _version(f: Flavour) -> str:
    for dist in f.dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "version unknown"


def flavour_reason(f: Flavour, device: torch.device) -> str | None:
    """None when flavour ``f`` can run on ``device``; otherwise why not."""
    if not _installed(f):
        return f"{f.module} is not installed"
    if device.type != "cuda":
        return f"needs a CUDA GPU, not {device.type}"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in f.cc_majors:
        return f"runs on SM{'/SM'.join(f'{m}x' for m in f.cc_majors)}, not SM{major}{minor}"
    return None


@lru_cache(maxsize=None)
def select_flavour(device: torch.device) -> tuple[Flavour | None, str]:
    """The flavour to run on ``device`` (``$PAGEDGEN_FLASH_ATTN`` or the first that runs), and a
    one-line account of every flavour."""
    reasons = {f.name: flavour_reason(f, device) for f in FLAVOURS}
    notes = "; ".join(f"{n}: {r or _version(_BY_NAME[n])}" for n, r in reasons.items())
    want = os.environ.get(ENV_FLAVOUR)
    if want:
        if want not in _BY_NAME:
            return None, f"{ENV_FLAVOUR}={want} is not one of {', '.join(_BY_NAME)}"
        f = _BY_NAME[want]
        return (f, notes) if reasons[want] is None else (None, f"{want}: {reasons[want]}")
    for f in FLAVOURS:
        if reasons[f.name] is None:
            return f, notes
    return None, notes


# ---- the kernel calls, per flavour ------------------------------------------------------------
# Prefill and decode take q [T, Hq, D] of one kind of sequence, the K and V caches, metadata
# (and ``out`` rows to fill), return [T, Hq, D] (causal, bottom-right); FA4 also cascades.

def _common(spec: LayerSpec, no_window: tuple) -> dict:
    """The keywords every flavour's calls share; ``no_window``: how the flavour spells "no
    sliding window" (FA4 (None, None), FA2/FA3 (-1, -1))."""
    window = (spec.sliding_window - 1, 0) if spec.sliding_window else no_window
    return dict(softmax_scale=spec.scale, causal=True, window_size=window,
                softcap=spec.logits_soft_cap or 0.0)


def default_page_size(f: Flavour, device: torch.device) -> int:
    """The page size flavour ``f`` runs with when none is asked for; FA4 on SM90: 64, where
    decode's 64-key tile still loads whole pages by TMA. A sequence's last page, and the page
    where a shared prefix ends, are half empty on average: at 128, KV for fewer sequences at
    once (workload s on an H100: 10,946 against 12,044 tok/s at 64; BENCHMARKS.md)."""
    sm90 = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
    return 64 if f.name == "fa4" and sm90 else f.default_block_size


def fa4_decode_tile(device: torch.device) -> tuple[int, int] | None:
    """The tile (query rows, keys) FA4's decode kernels run with for head sizes up to 128:
    ``$PAGEDGEN_FA4_DECODE_TILE`` ("64x128", or "fa4" for FA4's own choice), else 64 x 64 on
    SM90, where FA4's own 128 x 128 holds 2-4 valid query rows of a GQA decode (6.7% longer
    on (a)'s decode shape, BENCHMARKS.md), and FA4's own elsewhere (None)."""
    return _tile(ENV_DECODE_TILE, "64x64", device)


def fa4_group_tile(device: torch.device) -> tuple[int, int] | None:
    """The tile of cascade decode's group-level calls for head sizes up to 128:
    ``$PAGEDGEN_FA4_GROUP_TILE``, else 64 x 128 on SM90 (one 1,536-token prefix for 256 decodes:
    19.0 against 25.3 µs a layer with FA4's own on an H200; 32 groups of 8: 43.9 against 45.1;
    BENCHMARKS.md), and FA4's own elsewhere."""
    return _tile(ENV_GROUP_TILE, "64x128", device)


def _tile(env: str, sm90_default: str, device: torch.device) -> tuple[int, int] | None:
    sm90 = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
    want = os.environ.get(env) or (sm90_default if sm90 else "fa4")
    if want == "fa4":
        return None
    try:
        m, n = (int(x) for x in want.split("x"))
    except ValueError:
        m = n = 0
    if m <= 0 or m % 64 or n <= 0 or n % 16:
        raise PagedgenError(f"{env}={want}: expected 'fa4' or ROWSxKEYS, rows a multiple of 64 "
                            "and keys of 16 (e.g. 64x128)")
    return m, n


def _fa4_calls(mod, split_kv: bool, decode_tile: tuple[int, int] | None = None,
               suffix: str = "triton", group_tile: tuple[int, int] | None = None
               ) -> tuple[Callable, Callable, Callable]:
    # the function behind flash_attn_varlen_func (its autograd wrapper costs host time)
    fn = _fa4_with_tile(mod, None)
    fwd = mod.interface._flash_attn_fwd  # takes ``out`` and ``lse`` to write into
    num_splits = 0 if split_kv else 1  # 0: FA4's heuristic; SM90 has no split-KV kernel
    tiled = fn if decode_tile is None else _fa4_with_tile(mod, decode_tile)

    def dec(q, *args, **kw):  # the tile is for head sizes up to 128 (FA4's own beyond)
        return (tiled if q.shape[-1] <= 128 else fn)(q, *args, **kw)

    def prefill(q, k_cache, v_cache, md: AttentionMetadata, spec: LayerSpec, out=None
                ) -> torch.Tensor:
        return fn(q, k_cache, v_cache, cu_seqlens_q=md.query_start_loc,
                  max_seqlen_q=md.max_query_len, seqused_k=md.seq_lens,
                  page_table=md.block_tables, out=out, **_common(spec, (None, None)))[0]

    def decode(q, k_cache, v_cache, md: AttentionMetadata, spec: LayerSpec, out=None
               ) -> torch.Tensor:
        # q as [B, 1, H, D] (no cu_seqlens): shapes fixed by the batch, so CUDA graphs can hold
        # it. With split_kv the KV is split when the batch alone cannot fill the GPU.
        return dec(q.unsqueeze(1), k_cache, v_cache, seqused_k=md.seq_lens,
                   page_table=md.block_tables, num_splits=num_splits,
                   out=None if out is None else out.unsqueeze(1),
                   **_common(spec, (None, None)))[0].squeeze(1)

    def cascade(q, kv_cache, x: CascadeInputs, spec: LayerSpec, out=None) -> torch.Tensor:
        # per level, each group's queries as one non-causal sequence over its pages, read once
        b, h, d = q.shape
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        qs = q.index_select(0, x.order)
        levels = torch.empty(x.num_levels, b, h, d, dtype=q.dtype, device=q.device)
        lse = torch.empty(x.num_levels, h, b, dtype=torch.float32, device=q.device)
        tile = group_tile if d <= 128 else None
        for i in range(x.num_levels):
            fwd(qs, k_cache, v_cache, cu_seqlens_q=x.cu_q[i], max_seqlen_q=x.max_q,
                seqused_k=x.kv_lens[i], page_table=x.tables[i], softmax_scale=spec.scale,
                causal=False, softcap=spec.logits_soft_cap or None, return_lse=True,
                tile_mn=tile, out=levels[i], lse=lse[i])
        out = torch.empty_like(q) if out is None else out
        if suffix == "triton":  # each row's own pages, split by the batch alone (graph-safe)
            splits = paged_decode.num_splits(b, spec, q.device)
            suf, suf_lse = paged_decode.partials(splits, b, spec, q.device)
            paged_decode.decode(q, kv_cache.transpose(0, 1), out, suf, suf_lse, x.suffix_tables,
                                x.suffix_lens, spec, splits)
        else:  # FA4's decode: suf [B, 1, H, D] and suf_lse [B, H, 1] as one split
            suf, suf_lse = dec(q.unsqueeze(1), k_cache, v_cache, seqused_k=x.suffix_lens,
                               page_table=x.suffix_tables, num_splits=num_splits,
                               return_lse=True, **_common(spec, (None, None)))[:2]
            suf, suf_lse = suf.transpose(0, 1), suf_lse.permute(2, 0, 1)
        return merge(out, suf, suf_lse, levels, lse.transpose(1, 2), x)  # levels' lse [L, H, B]

    return prefill, decode, cascade


def cascade_suffix_kernel() -> str:
    """What attends each row's own pages in FA4's cascade decode (``$PAGEDGEN_FA4_CASCADE_SUFFIX``):
    ``triton``, ops/paged_decode.py (faster on the short runs cascade leaves), or ``fa4``."""
    want = os.environ.get(ENV_CASCADE_SUFFIX) or "triton"
    if want not in ("triton", "fa4"):
        raise PagedgenError(f"{ENV_CASCADE_SUFFIX}={want}: expected 'triton' or 'fa4'")
    return want


def _fa4_with_tile(mod, tile: tuple[int, int] | None) -> Callable:
    """FA4's forward with a given tile (None: FA4's own): ``flash_attn_varlen_func``'s
    keywords, calling the function behind it (which alone takes ``tile_mn``; inference needs
    no autograd)."""
    fwd = mod.interface._flash_attn_fwd

    def call(q, k, v, *, window_size, softcap, **kw):
        return fwd(q, k, v, window_size_left=window_size[0], window_size_right=window_size[1],
                   softcap=softcap or None, tile_mn=tile, **kw)
    return call


def _fa3_calls(mod, split_kv: bool) -> tuple[Callable, Callable]:
    fn = mod.flash_attn_with_kvcache

    def prefill(q, k_cache, v_cache, md: AttentionMetadata, spec: LayerSpec) -> torch.Tensor:
        return fn(q, k_cache, v_cache, cache_seqlens=md.seq_lens, page_table=md.block_tables,
                  cu_seqlens_q=md.query_start_loc, max_seqlen_q=md.max_query_len,
                  **_common(spec, (-1, -1)))

    def decode(q, k_cache, v_cache, md: AttentionMetadata, spec: LayerSpec) -> torch.Tensor:
        return fn(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=md.seq_lens,
                  page_table=md.block_tables, num_splits=0, **_common(spec, (-1, -1))).squeeze(1)

    return _copied(prefill), _copied(decode), None


def _fa2_calls(mod, split_kv: bool) -> tuple[Callable, Callable]:
    def prefill(q, k_cache, v_cache, md: AttentionMetadata, spec: LayerSpec) -> torch.Tensor:
        cu_seqlens_k = F.pad(md.seq_lens.cumsum(0, dtype=torch.int32), (1, 0))
        return mod.flash_attn_varlen_func(
            q, k_cache, v_cache, cu_seqlens_q=md.query_start_loc, cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=md.max_query_len, max_seqlen_k=md.max_seq_len,
            block_table=md.block_tables, **_common(spec, (-1, -1)))

    def decode(q, k_cache, v_cache, md: AttentionMetadata, spec: LayerSpec) -> torch.Tensor:
        return mod.flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache,
                                           cache_seqlens=md.seq_lens, block_table=md.block_tables,
                                           num_splits=0, **_common(spec, (-1, -1))).squeeze(1)

    return _copied(prefill), _copied(decode), None


_CALLS = {"fa4": _fa4_calls, "fa3": _fa3_calls, "fa2": _fa2_calls}


def _copied(call: Callable) -> Callable:
    """An FA2/FA3 call (which take no output tensor) with FA4's ``out``: copied into it."""
    return lambda *args, out=None: call(*args) if out is None else out.copy_(call(*args))


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
        if self.flavour.name == "fa4":  # keep compiled kernels for the next run
            os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
            import_quack_lean()  # without torch._dynamo (see fa4_import)
        self.module = importlib.import_module(self.flavour.module)
        # FA4 splits the KV of long decodes on SM100 only ("SplitKV not supported on SM 9.0").
        split_kv = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 10
        calls, self.decode_tile = _CALLS[self.flavour.name], None
        if self.flavour.name == "fa4":
            self.decode_tile = fa4_decode_tile(device)
            self.cascade_suffix = cascade_suffix_kernel()
            calls = partial(calls, decode_tile=self.decode_tile, suffix=self.cascade_suffix,
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
        if not any(_installed(x) for x in FLAVOURS):
            return f"no flash-attn flavour is installed ({INSTALL_HINT}): {why}"
        return why

    @classmethod
    def describe(cls, device: torch.device) -> str:
        f, notes = select_flavour(device)
        tile = ""
        if f.name == "fa4":
            try:
                t = fa4_decode_tile(device)
                tile = f", decode tile {'x'.join(map(str, t)) if t else 'FA4 own'}"
            except PagedgenError as e:
                tile = f", {e}"
        return (f"runs {f.name} {_version(f)}, page size {default_page_size(f, device)}{tile} "
                f"({notes})")
