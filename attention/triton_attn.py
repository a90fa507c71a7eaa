"""The triton backend: pagedgen's own paged-attention kernels (attention/triton_kernels.py).

Needs no FlashInfer or flash-attn: any GPU Triton supports, and CPU tensors under
``TRITON_INTERPRET=1`` (how CI tests the kernels). ``begin_forward`` plans once per step: the
prefill tiles (longest first) and the number of KV splits for decode. CUDA graphs: the decode
grid depends only on the batch size, so a captured graph stays valid as contexts grow.
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass

import torch

from pagedgen.attention.backend import (AttentionBackend, AttentionImpl, AttentionMetadata,
                                        AttentionState, LayerSpec)
from pagedgen.attention.kv_cache import write_kv_triton
from pagedgen.runtime.profiling import scope

INSTALL_HINT = "pip install 'pagedgen[triton]'"
MAX_SPLITS = 32


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@dataclass
class TritonPlan:
    tile_seq: torch.Tensor | None = None  # prefill tiles: sequence index
    tile_qstart: torch.Tensor | None = None  # prefill tiles: first new token of the tile
    num_splits: int = 1


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class TritonState(AttentionState):
    def __init__(self, backend, layer_specs, block_size, dtype, kv_cache_dtype, device) -> None:
        super().__init__(backend, layer_specs, block_size, dtype, kv_cache_dtype, device)
        s = layer_specs[0]
        self.group = s.num_heads // s.num_kv_heads
        self.g_tile = self.group if self.group == _pow2(self.group) and self.group <= 16 else 1
        big = s.head_size > 128
        if _interpreting():
            self.block_m, self.block_n, self.decode_block_n = 16 * self.g_tile, 16, 16
        else:
            self.block_m = 64 if big else 128
            self.block_n = 32 if big else 64
            self.decode_block_n = 64 if big else 128
        self.block_m = max(self.block_m, 16 * self.g_tile)
        # On CPU (the interpreter) pretend to have 64 SMs, so that tests exercise split-KV.
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count \
            if device.type == "cuda" else 64

    def num_splits(self, batch: int, max_seq_len: int | None) -> int:
        """KV splits per (sequence, KV head): enough programs to fill the GPU twice over."""
        programs = batch * self.layer_specs[0].num_kv_heads
        splits = max(1, min(MAX_SPLITS, math.ceil(2 * self.num_sms / programs)))
        if max_seq_len is not None:  # eager steps: no more splits than tiles
            splits = max(1, min(splits, math.ceil(max_seq_len / (2 * self.decode_block_n))))
        return splits

    def make_graph_plan(self, batch_size: int, max_num_pages: int) -> None:
        """Nothing to allocate: the decode grid depends on the batch size only."""

    def begin_forward(self, metadata: AttentionMetadata, graph_batch_size: int | None = None
                      ) -> None:
        md, plan = metadata, TritonPlan()
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
        if md.num_decodes:
            plan.num_splits = self.num_splits(
                md.num_decodes, None if graph_batch_size else max(md.seq_lens_cpu[md.num_prefills:]))
        md.plan = plan


class TritonImpl(AttentionImpl):
    def __init__(self, spec: LayerSpec, state: TritonState) -> None:
        super().__init__(spec, state)
        from pagedgen.attention import triton_kernels as tk
        self.tk = tk

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        md, st, spec, tk = metadata, self.state, self.spec, self.tk
        out = torch.empty_like(q)
        write_kv_triton(kv_cache[:, 0], kv_cache[:, 1], k, v, md.slot_mapping)
        cs = kv_cache.stride()
        window = spec.sliding_window or 0
        cap = spec.logits_soft_cap or 0.0
        precision = "ieee" if q.dtype == torch.float32 else "tf32"
        group = spec.num_heads // spec.num_kv_heads
        if md.num_prefills:
            plan = md.plan
            grid = (plan.tile_seq.shape[0], spec.num_heads // st.g_tile)
            tk.prefill_kernel[grid](
                q, kv_cache, out, md.block_tables, md.query_start_loc, md.context_lens,
                plan.tile_seq, plan.tile_qstart, q.stride(0), q.stride(1), out.stride(0),
                out.stride(1), cs[0], cs[1], cs[2], cs[3], md.block_tables.stride(0),
                spec.scale, cap, window, group, st.g_tile, md.block_size, D=spec.head_size,
                BLOCK_M=st.block_m, BLOCK_N=st.block_n,
                USE_WINDOW=window > 0, USE_SOFTCAP=cap > 0, PRECISION=precision,
                **({} if _interpreting() else {"num_warps": 8 if st.block_m >= 128 else 4,
                                              "num_stages": 2}))
        if md.num_decodes:
            t0, b = md.num_prefill_tokens, md.num_decodes
            dq, dout = q[t0:], out[t0:]
            dec = md.decode_metadata
            splits = md.plan.num_splits
            part = lse = dout  # unused placeholders when writing directly
            if splits > 1:
                part = torch.empty((splits, b, spec.num_heads, spec.head_size),
                                   dtype=torch.float32, device=q.device)
                lse = torch.empty((splits, b, spec.num_heads), dtype=torch.float32,
                                  device=q.device)
            tk.decode_kernel[(b, spec.num_kv_heads, splits)](
                dq, kv_cache, dout, part, lse, dec.block_tables, dec.seq_lens,
                dq.stride(0), dq.stride(1), dout.stride(0), dout.stride(1),
                cs[0], cs[1], cs[2], cs[3], dec.block_tables.stride(0),
                part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
                spec.scale, cap, window, splits, group, md.block_size,
                GP=max(16, _pow2(group)), D=spec.head_size, BLOCK_N=st.decode_block_n,
                USE_WINDOW=window > 0, USE_SOFTCAP=cap > 0, DIRECT=splits == 1,
                PRECISION=precision,
                **({} if _interpreting() else {"num_warps": 4, "num_stages": 2}))
            if splits > 1:
                tk.merge_kernel[(b, spec.num_heads)](
                    dout, part, lse, dout.stride(0), dout.stride(1), part.stride(0),
                    part.stride(1), part.stride(2), lse.stride(0), lse.stride(1), splits,
                    D=spec.head_size, SP=_pow2(splits))
        return out


class TritonBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True
    supports_sliding_window = True
    supports_soft_cap = True
    # Triton's CPU interpreter computes bf16 dot products wrongly, so no bf16 there; fp32 is
    # for the interpreter's tests only (GPU kernels are tuned for 16-bit inputs).
    supported_dtypes = (torch.float16, torch.float32) if _interpreting() else (
        torch.float16, torch.bfloat16)

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TritonImpl

    @staticmethod
    def get_state_cls() -> type[AttentionState]:
        return TritonState

    @staticmethod
    def get_supported_head_sizes() -> list[int]:
        return [64, 128, 256]

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return f"triton is not installed ({INSTALL_HINT})"
        if device.type == "cpu" and not _interpreting():
            return "runs on CUDA GPUs; on CPU only under TRITON_INTERPRET=1 (slow; for tests)"
        if device.type not in ("cpu", "cuda"):
            return f"runs on CUDA GPUs, not {device.type}"
        return None
