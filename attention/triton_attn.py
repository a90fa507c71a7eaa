"""The triton backend: pagedgen's own paged-attention kernels (attention/ops/triton_kernels.py).

Needs no FlashInfer or flash-attn: any GPU Triton supports, and CPU tensors under
``TRITON_INTERPRET=1`` (how CI tests the kernels). ``build`` plans once per step: the
prefill tiles (longest first) and the number of KV splits for decode. CUDA graphs: the decode
grid depends only on the batch size, so a captured graph stays valid as contexts grow.

Grouped cascade decode (attention/cascade.py): the suffixes run as the split-KV decode's
splits; each level's groups through the prefill kernel (each group's queries as one non-causal
sequence, so each of its K/V tiles is read once for the group); ``cascade_merge_kernel`` merges
them all by their log-sum-exp.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

import torch

from pagedgen import envs
from pagedgen.attention.backend import AttentionBackend, AttentionImpl, AttentionState, LayerSpec
from pagedgen.attention.cascade import CascadeBuffers, CascadeInputs, merge
from pagedgen.attention.metadata import AttentionMetadata
from pagedgen.attention.ops import paged_decode
from pagedgen.attention.ops.kv_cache import fp8_converts, write_kv, write_kv_triton
from pagedgen.attention.ops.paged_decode import interpreting as _interpreting
from pagedgen.errors import PagedgenError

INSTALL_HINT = "pip install 'pagedgen[triton]'"


@dataclass
class TritonPlan:
    tile_seq: torch.Tensor | None = None  # prefill tiles: sequence index
    tile_qstart: torch.Tensor | None = None  # prefill tiles: first new token of the tile
    num_splits: int = 1
    cascade: CascadeInputs | None = None
    # cascade: the prefill kernel's tiles over each level's groups, (segment, first query)
    # [L, tiles] each (spare tiles: the last segment, always empty)
    group_tiles: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class TritonMetadata(AttentionMetadata):
    """A step's metadata with its kernels' plan."""

    plan: TritonPlan = field(default_factory=TritonPlan)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def invariant_rows(g_tile: int) -> int:
    """The rows of the prefill kernel's tiles under --batch-invariant for ``g_tile`` query
    heads a tile column: 4 positions of them, at least 16 (``tl.dot``'s least), or
    ``PAGEDGEN_INVARIANT_ATTENTION_ROWS``."""
    want = envs.INVARIANT_ATTENTION_ROWS.get()
    if want is None:
        return max(16, 4 * g_tile)
    rows = int(want) if want.isdigit() else 0
    if rows != _pow2(rows) or rows < max(16, g_tile):
        raise PagedgenError(f"{envs.INVARIANT_ATTENTION_ROWS.name}={want}: a power of two of at "
                            f"least {max(16, g_tile)}")
    return rows


class TritonState(AttentionState):
    def __init__(self, backend, layer_specs, block_size, dtype, kv_cache_dtype, device) -> None:
        super().__init__(backend, layer_specs, block_size, dtype, kv_cache_dtype, device)
        s = layer_specs[0]
        self.group = s.num_heads // s.num_kv_heads
        self.g_tile = self.group if self.group == _pow2(self.group) and self.group <= 16 else 1
        big, widest = s.head_size > 128, s.head_size > 256
        # heads of 512 (Gemma 4's global layers): each prefill program makes half a head's
        # output (an accumulator of [128, 256] over 8 warps); measured on an H100 at 8 x 4,096
        # and 16-30k tokens: 172-183 TFLOP/s against 75-78 with whole heads in 32-row tiles
        self.prefill_dv = 256 if widest else 0  # a program's output columns (0: all)
        if _interpreting():
            self.block_m, self.block_n = 16 * self.g_tile, 16
        else:
            self.block_m = 64 if big and not widest else 128
            self.block_n = 32 if big and not widest else 64
        self.block_m = max(self.block_m, 16 * self.g_tile)
        self.num_stages = 1 if widest else 2
        # A window would cut into the shared prefix differently per sequence; sinks (counted
        # in the suffix's split 0, which the merge keeps once) have no GPU test with cascade
        # yet, so their layers decode plainly.
        self._batch_invariant = False  # --batch-invariant: the ``batch_invariant`` setter
        self._invariant_graph_tiles: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.supports_cascade = not any(x.sliding_window or x.sinks for x in layer_specs)
        self.supports_mixed_cascade = self.supports_cascade
        self.cascade_buffers = CascadeBuffers(device)
        # per CUDA graph (batch size, levels): static tiles and the layout they hold
        self._graph_tiles: dict[tuple[int, int], list] = {}

    @property
    def batch_invariant(self) -> bool:
        """--batch-invariant: every token through the prefill kernel (a decode is a tile of
        its own), whose order over the keys follows neither the batch, the chunk nor the
        step. Its tiles are short (``invariant_rows``): a decode fills only its query heads'
        rows of a tile, and ``block_m`` rows of 128 made 32 times a decode's work (measured on
        an H100: the mode's decode step 30.5 ms against 15.4)."""
        return self._batch_invariant

    @batch_invariant.setter
    def batch_invariant(self, on: bool) -> None:
        self._batch_invariant = on
        if on:
            self.block_m = invariant_rows(self.g_tile)

    @property
    def num_warps(self) -> int:
        """The prefill kernel's warps: 8 for tiles of 128 rows and more."""
        return 8 if self.block_m >= 128 else 4

    def num_splits(self, batch: int, max_seq_len: int | None) -> int:
        """KV splits per (sequence, KV head) of the decode kernel (attention/ops/paged_decode)."""
        return paged_decode.num_splits(batch, self.layer_specs[0], self.device, max_seq_len)

    def make_graph_plan(self, batch_size: int, max_num_pages: int, cascade_levels: int = 0,
                        cascade_segments: int = 0) -> None:
        """The decode grid depends on the batch size only; cascade graphs also capture their
        group and suffix buffers and a fixed number of group tiles."""
        if self.batch_invariant:  # a tile a decode: its sequence, its first position
            self._invariant_graph_tiles[batch_size] = (
                torch.arange(batch_size, dtype=torch.int32, device=self.device),
                torch.zeros(batch_size, dtype=torch.int32, device=self.device))
        if cascade_levels:
            self.cascade_buffers.allocate(batch_size, cascade_levels, cascade_segments,
                                          max_num_pages)
            # groups of >= 2 rows: at most batch/2 groups, batch/block_q + 1 tiles beyond them
            most = batch_size // 2 + batch_size // (self.block_m // self.g_tile) + 1
            empty = torch.full((cascade_levels, most), batch_size, dtype=torch.int32,
                               device=self.device)
            self._graph_tiles[batch_size, cascade_levels, cascade_segments] = [
                None, empty, torch.zeros_like(empty)]

    def group_tiles(self, x: CascadeInputs, graph_batch_size: int | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefill kernel's tiles over each level's groups (segment, first query): exact
        for an eager step, into the graph's fixed number otherwise (spare ones on the empty last
        segment)."""
        block_q = self.block_m // self.g_tile
        tiles = [[(seg, q) for seg, rows in level for q in range(0, rows, block_q)]
                 for level in x.segments]
        empty = x.kv_lens.shape[1] - 1

        def padded(most: int) -> torch.Tensor:  # [L, most, 2]: spare tiles on the empty one
            return torch.tensor([[t[i] if i < len(t) else (empty, 0) for i in range(most)]
                                 for t in tiles], dtype=torch.int32).reshape(len(tiles), most, 2)

        if graph_batch_size is None:
            arr = padded(max(len(t) for t in tiles)).to(self.device, non_blocking=True)
            return arr[..., 0].contiguous(), arr[..., 1].contiguous()
        held = self._graph_tiles[graph_batch_size, x.num_levels, x.kv_lens.shape[1]]
        if held[0] is not x.layout:
            arr = padded(held[1].shape[1])
            held[1].copy_(arr[..., 0])
            held[2].copy_(arr[..., 1])
            held[0] = x.layout
        return held[1], held[2]

    def build(self, metadata: AttentionMetadata, graph_batch_size: int | None = None
              ) -> TritonMetadata:
        md, plan = metadata, TritonPlan()
        if self.batch_invariant:
            plan.tile_seq, plan.tile_qstart = self._invariant_tiles(md, graph_batch_size)
            return md.extend(TritonMetadata, plan=plan)
        if md.num_prefills:
            block_q = self.block_m // self.g_tile
            tiles = []  # (work, seq, qstart), longest (most keys) first for load balance
            for i in range(md.num_prefills):
                ctx = md.seq_lens_cpu[i] - md.query_lens_cpu[i]
                for qs in range(0, md.query_lens_cpu[i], block_q):
                    tiles.append((ctx + qs, i, qs))
            tiles.sort(reverse=True)
            arr = torch.tensor([[t[1], t[2]] for t in tiles], dtype=torch.int32)
            arr = arr.to(self.device, non_blocking=True)
            plan.tile_seq, plan.tile_qstart = arr[:, 0].contiguous(), arr[:, 1].contiguous()
        if md.cascade is not None:  # over the decode rows (after any prefills)
            plan.cascade = self.cascade_buffers.inputs(md, graph_batch_size)
            plan.group_tiles = self.group_tiles(plan.cascade, graph_batch_size)
            plan.num_splits = self.num_splits(
                md.num_decodes, None if graph_batch_size else max(plan.cascade.suffix_lens_cpu))
        elif md.num_decodes:
            plan.num_splits = self.num_splits(
                md.num_decodes,
                None if graph_batch_size else max(md.seq_lens_cpu[md.num_prefills:]))
        return md.extend(TritonMetadata, plan=plan)

    def _invariant_tiles(self, md: AttentionMetadata, graph_batch_size: int | None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill tiles over every sequence, decodes included, each tile at the same
        positions whatever the step: starting at a multiple of its rows from the sequence's
        first token (a step's first tile may start before its first new token), so a token
        sits in the same row of the same tile however its prompt was chunked. A decode-only
        step's tiles (one a sequence) are made on the device from its sequence lengths, into
        the CUDA graph's buffers when it replays one."""
        block_q = self.block_m // self.g_tile
        if not md.num_prefills:
            n = md.num_decodes
            if graph_batch_size is None:
                seq = torch.arange(n, dtype=torch.int32, device=self.device)
                qstart = torch.empty(n, dtype=torch.int32, device=self.device)
            else:
                seq, qstart = self._invariant_graph_tiles[graph_batch_size]
            torch.remainder(md.seq_lens[:n] - 1, block_q, out=qstart[:n])
            qstart[:n].neg_()
            return seq, qstart
        tiles = [(i, qs) for i, (n, length) in enumerate(zip(md.query_lens_cpu, md.seq_lens_cpu))
                 for qs in range(-((length - n) % block_q), n, block_q)]
        arr = torch.tensor(tiles, dtype=torch.int32).to(self.device, non_blocking=True)
        return arr[:, 0].contiguous(), arr[:, 1].contiguous()


class TritonImpl(AttentionImpl):
    def __init__(self, spec: LayerSpec, state: TritonState) -> None:
        super().__init__(spec, state)
        from pagedgen.attention.ops import triton_kernels as tk
        self.tk = tk

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        st = self.state
        if kv_cache.dtype.itemsize == 1 and not kv_cache.is_cuda:
            # Triton's CPU interpreter rounds to FP8 wrongly (1.999 to 1.0): torch stores there
            write_kv(kv_cache, k, v, slot_mapping, st.k_scale, st.v_scale)
            return
        write_kv_triton(kv_cache[:, 0], kv_cache[:, 1], k, v, slot_mapping, st.k_scale,
                        st.v_scale)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               metadata: TritonMetadata) -> torch.Tensor:
        md, st, spec = metadata, self.state, self.spec
        out = torch.empty_like(q)
        if md.num_prefills or st.batch_invariant:  # the mode: decodes' tiles too
            plan = md.plan
            grid = (plan.tile_seq.shape[0], spec.num_heads // st.g_tile)
            self._prefill(grid, q, kv_cache, out, out, md.block_tables, md.query_start_loc,
                          md.context_lens, plan.tile_seq, plan.tile_qstart, causal=True)
            if st.batch_invariant:
                return out
        if md.cascade is not None:  # the decodes, grouped
            t0 = md.num_prefill_tokens
            self._cascade(q[t0:], kv_cache, out[t0:], md.plan)
        elif md.num_decodes:
            t0, b = md.num_prefill_tokens, md.num_decodes
            dq, dout = q[t0:], out[t0:]
            dec = md.decode_metadata
            splits = md.plan.num_splits
            if splits == 1:  # straight into the output
                self._decode(dq, kv_cache, dout, dout, dout, dec.block_tables, dec.seq_lens, 1)
            else:
                part, lse = self._partials(splits, b, q.device)
                self._decode(dq, kv_cache, dout, part, lse, dec.block_tables, dec.seq_lens,
                             splits)
                self._merge(dout, part, lse, splits)
        return out

    def _cascade(self, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor,
                 plan: TritonPlan) -> torch.Tensor:
        """Suffixes as the decode kernel's splits; each level's groups by the prefill kernel
        over the sorted queries; one merge."""
        x, b, splits = plan.cascade, q.shape[0], plan.num_splits
        part, lse = self._partials(splits, b, q.device)
        self._decode(q, kv_cache, out, part, lse, x.suffix_tables, x.suffix_lens, splits)
        qs = q.index_select(0, x.order)
        levels, levels_lse = self._partials(x.num_levels, b, q.device)
        tile_seq, tile_qstart = plan.group_tiles
        grid = (tile_seq.shape[1], self.spec.num_heads // self.state.g_tile)
        for i in range(x.num_levels):
            self._prefill(grid, qs, kv_cache, levels[i], levels_lse[i], x.tables[i], x.cu_q[i],
                          x.kv_lens[i], tile_seq[i], tile_qstart[i], causal=False)
        return merge(out, part, lse, levels, levels_lse, x)

    def _partials(self, splits: int, b: int, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        return paged_decode.partials(splits, b, self.spec, device)

    def _prefill(self, grid, q, kv_cache, out, lse, block_tables, query_start_loc, context_lens,
                 tile_seq, tile_qstart, causal: bool) -> None:
        st, spec, cs = self.state, self.spec, kv_cache.stride()
        cap = spec.logits_soft_cap or 0.0
        window = spec.sliding_window or 0
        splits = spec.head_size // st.prefill_dv if st.prefill_dv else 1
        self.tk.prefill_kernel[(*grid, splits)](
            q, kv_cache, out, lse, block_tables,
            self.sinks if causal and self.sinks is not None else context_lens,
            query_start_loc, context_lens, tile_seq, tile_qstart,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            lse.stride(0), cs[0], cs[1], cs[2], cs[3], block_tables.stride(0),
            spec.scale * st.k_scale, st.v_scale, cap, window,
            spec.num_heads // spec.num_kv_heads, st.g_tile, st.block_size,
            D=spec.head_size, BLOCK_M=st.block_m, BLOCK_N=st.block_n,
            USE_WINDOW=window > 0, USE_SOFTCAP=cap > 0, PRECISION=_precision(q),
            CAUSAL=causal, WRITE_LSE=not causal, USE_SINKS=causal and self.sinks is not None,
            DV=st.prefill_dv,
            **({} if _interpreting() else {"num_warps": st.num_warps, "num_stages": st.num_stages}))

    def _decode(self, q, kv_cache, out, part, lse, block_tables, seq_lens, splits: int) -> None:
        """Decode kernel over ``splits`` KV splits: into ``out`` when 1, else partials."""
        paged_decode.decode(q, kv_cache, out, part, lse, block_tables, seq_lens, self.spec,
                            splits, self.sinks, self.state.k_scale, self.state.v_scale)

    def _merge(self, out, part, lse, splits: int) -> None:
        self.tk.merge_kernel[(out.shape[0], self.spec.num_heads)](
            out, part, lse, out.stride(0), out.stride(1), part.stride(0), part.stride(1),
            part.stride(2), lse.stride(0), lse.stride(1), splits, D=self.spec.head_size,
            SP=_pow2(splits))


def _precision(q: torch.Tensor) -> str:
    return "ieee" if q.dtype == torch.float32 else "tf32"


class TritonBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True
    supports_sliding_window = True
    supports_soft_cap = True
    supports_sinks = True
    supports_fp8_kv_cache = True
    supported_dtypes = (torch.float16, torch.bfloat16)
    reads_any_strides = True

    @classmethod
    def get_supported_dtypes(cls) -> tuple[torch.dtype, ...]:
        """Triton's CPU interpreter computes bf16 dot products wrongly, so no bf16 there; fp32
        is for the interpreter's tests only (GPU kernels are tuned for 16-bit inputs). Asked
        when used, not at import: the interpreter is an environment variable."""
        return (torch.float16, torch.float32) if _interpreting() else cls.supported_dtypes

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TritonImpl

    @staticmethod
    def get_state_cls() -> type[AttentionState]:
        return TritonState

    @staticmethod
    def get_supported_head_sizes() -> list[int]:
        return [64, 128, 256, 512]

    @classmethod
    def fp8_kv_reason(cls, device: torch.device) -> str | None:
        if not fp8_converts(device):
            return "Triton converts FP8 on compute capability 8.9+ only"
        return None

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return f"triton is not installed ({INSTALL_HINT})"
        if device.type == "cpu" and not _interpreting():
            return "runs on CUDA GPUs; on CPU only under TRITON_INTERPRET=1 (slow; for tests)"
        if device.type not in ("cpu", "cuda"):
            return f"runs on CUDA GPUs, not {device.type}"
        return None
