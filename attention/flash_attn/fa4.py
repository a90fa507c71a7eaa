"""FlashAttention-4's calls (``flash_attn.cute``, CuTe DSL; SM90 and SM100): paged prefill
(over head size 128 on SM90 with the tile that loads whole pages by TMA), paged decode with the
tile chosen for GQA decodes on SM90, and cascade decode (each group's shared pages once, each
row's own pages by our Triton decode or FA4's, merged). Kernels compile
at first use (a few seconds per variant), so the backend's state warms every variant a run can
need before timing or capture; compiled kernels are kept on disk for the next run."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedgen import envs
from pagedgen.attention.backend import LayerSpec
from pagedgen.attention.cascade import CascadeInputs, merge
from pagedgen.attention.flash_attn.flavours import common
from pagedgen.attention.metadata import AttentionMetadata
from pagedgen.attention.ops import paged_decode
from pagedgen.errors import PagedgenError

ENV_DECODE_TILE = envs.FA4_DECODE_TILE.name
ENV_CASCADE_SUFFIX = envs.FA4_CASCADE_SUFFIX.name
ENV_GROUP_TILE = envs.FA4_GROUP_TILE.name
ENV_PREFILL_TILE = envs.FA4_PREFILL_TILE.name


def fa4_decode_tile(device: torch.device) -> tuple[int, int] | None:
    """The tile (query rows, keys) FA4's decode kernels run with: ``$PAGEDGEN_FA4_DECODE_TILE``
    ("64x128", or "fa4" for FA4's own choice), else 64 x 64 on SM90, and FA4's own elsewhere
    (None). FA4's own on SM90 (128 x 128 up to head size 128, 128 x 80 at 256) holds a few
    valid query rows of a GQA decode and, at 256, gathers pages by cp.async: 6.7% longer on
    (a)'s decode shape, 58% on k's (benchmarks/results/LOG.md)."""
    return _tile(envs.FA4_DECODE_TILE, "64x64", device)


Tiles = tuple[tuple[int, int] | None, tuple[int, int] | None]  # head sizes <= 128, > 128


def fa4_prefill_tiles(device: torch.device, page_size: int) -> Tiles:
    """The tiles FA4's paged prefill runs with, for head sizes up to 128 and over 128:
    ``$PAGEDGEN_FA4_PREFILL_TILE`` for both, else on SM90 with 64-token pages 128 x 64 over 128
    and FA4's own (None) up to it. FA4 loads K/V by TMA only where a tile's keys are one page;
    its own tile over 128 (128 x 80 at head size 256) gathers pages by cp.async instead, 11%
    slower on k's prefill chunks (2% at head size 128: not changed; benchmarks/results/LOG.md)."""
    tile = _tile(envs.FA4_PREFILL_TILE, "128x64" if page_size == 64 else "fa4", device)
    return (tile if envs.FA4_PREFILL_TILE.get() else None), tile


def fa4_group_tile(device: torch.device) -> tuple[int, int] | None:
    """The tile of cascade decode's group-level calls for head sizes up to 128:
    ``$PAGEDGEN_FA4_GROUP_TILE``, else 64 x 128 on SM90 (one 1,536-token prefix for 256 decodes:
    19.0 against 25.3 µs a layer with FA4's own on an H200; 32 groups of 8: 43.9 against 45.1;
    benchmarks/results/LOG.md), and FA4's own elsewhere."""
    return _tile(envs.FA4_GROUP_TILE, "64x128", device)


def _tile(env: envs.EnvVar, sm90_default: str, device: torch.device
          ) -> tuple[int, int] | None:
    sm90 = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
    want = env.get() or (sm90_default if sm90 else "fa4")
    if want == "fa4":
        return None
    try:
        m, n = (int(x) for x in want.split("x"))
    except ValueError:
        m = n = 0
    if m <= 0 or m % 64 or n <= 0 or n % 16:
        raise PagedgenError(f"{env.name}={want}: expected 'fa4' or ROWSxKEYS, rows a multiple "
                            "of 64 and keys of 16 (e.g. 64x128)")
    return m, n


def fa4_calls(mod, split_kv: bool, decode_tile: tuple[int, int] | None = None,
              suffix: str = "triton", group_tile: tuple[int, int] | None = None,
              prefill_tiles: Tiles = (None, None)) -> tuple[Callable, Callable, Callable]:
    fwd = mod.interface._flash_attn_fwd  # takes ``out`` and ``lse`` to write into
    num_splits = 0 if split_kv else 1  # 0: FA4's heuristic; SM90 has no split-KV kernel
    pre = _by_head_size(mod, prefill_tiles)
    dec = _fa4_with_tile(mod, decode_tile)

    def prefill(q, k_cache, v_cache, md: AttentionMetadata, spec: LayerSpec, out=None
                ) -> torch.Tensor:
        return pre(q, k_cache, v_cache, cu_seqlens_q=md.query_start_loc,
                   max_seqlen_q=md.max_query_len, seqused_k=md.seq_lens,
                   page_table=md.block_tables, out=out, **common(spec, (None, None)))[0]

    def decode(q, k_cache, v_cache, md: AttentionMetadata, spec: LayerSpec, out=None
               ) -> torch.Tensor:
        # q as [B, 1, H, D] (no cu_seqlens): shapes fixed by the batch, so CUDA graphs can hold
        # it. With split_kv the KV is split when the batch alone cannot fill the GPU.
        return dec(q.unsqueeze(1), k_cache, v_cache, seqused_k=md.seq_lens,
                   page_table=md.block_tables, num_splits=num_splits,
                   out=None if out is None else out.unsqueeze(1),
                   **common(spec, (None, None)))[0].squeeze(1)

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
                               return_lse=True, **common(spec, (None, None)))[:2]
            suf, suf_lse = suf.transpose(0, 1), suf_lse.permute(2, 0, 1)
        return merge(out, suf, suf_lse, levels, lse.transpose(1, 2), x)  # levels' lse [L, H, B]

    return prefill, decode, cascade


def cascade_suffix_kernel() -> str:
    """What attends each row's own pages in FA4's cascade decode (``$PAGEDGEN_FA4_CASCADE_SUFFIX``):
    ``triton``, ops/paged_decode.py (faster on the short runs cascade leaves), or ``fa4``."""
    want = envs.FA4_CASCADE_SUFFIX.get() or "triton"
    if want not in ("triton", "fa4"):
        raise PagedgenError(f"{ENV_CASCADE_SUFFIX}={want}: expected 'triton' or 'fa4'")
    return want


def _by_head_size(mod, tiles: Tiles) -> Callable:
    """FA4's forward with the tile of the query's head size."""
    narrow, wide = (_fa4_with_tile(mod, t) for t in tiles)
    return lambda q, *args, **kw: (wide if q.shape[-1] > 128 else narrow)(q, *args, **kw)


def _fa4_with_tile(mod, tile: tuple[int, int] | None) -> Callable:
    """FA4's forward with a given tile (None: FA4's own): ``flash_attn_varlen_func``'s
    keywords, calling the function behind it (which alone takes ``tile_mn``; inference needs
    no autograd)."""
    fwd = mod.interface._flash_attn_fwd

    def call(q, k, v, *, window_size, softcap, **kw):
        return fwd(q, k, v, window_size_left=window_size[0], window_size_right=window_size[1],
                   softcap=softcap or None, tile_mn=tile, **kw)
    return call
