"""Attention kernel throughput per backend on fixed shapes (issues 6 and 7).

``--heads`` query/KV heads (default 32/8, Llama-3-8B's), ``--head-dim`` (default 128), bf16,
page sizes ``--page-sizes`` (default 16, and each backend's own with 0), NHD cache;
``--shapes`` (default: decode 64 x 4096 and 1 x 32768, in GB/s of K/V read; prefill 8 x 4096
causal, in TFLOP/s; a context ``LO-HI`` draws each sequence's length uniformly from it, seeded;
a prefill's new tokens are LO, after the rest cached: a later chunk of a long prompt).
``--fa4-decode-tiles`` runs flash-attn once per FA4 decode tile (``fa4``: FA4's own choice;
``64x128``: 64 query rows x 128 keys), as ``$PAGEDGEN_FA4_DECODE_TILE`` would;
``--fa4-prefill-tiles`` the same for prefill (``$PAGEDGEN_FA4_PREFILL_TILE``; ``default``:
pagedgen's own choice). ``--kv-cache-dtypes bf16,fp8`` runs each shape over a bf16 and an
FP8 (e4m3) cache (GB/s then counts the bytes the cache holds); ``--flashinfer-decodes xqa,fa2``
runs flashinfer once per FP8 decode kernel (``$PAGEDGEN_FLASHINFER_DECODE``);
``--triton-prefill-tiles 32x32x8x2x2,64x32x8x2x4x256`` runs triton's prefill once per tile
(query rows x keys x warps x pipeline stages x query heads a tile [x output columns a
program: the head split over programs]; ``default``: the state's).
``--vllm`` also times vLLM's Triton kernel (``unified_attention``: what vLLM runs on a model
with heads over 256) on the same shapes, in vLLM's own process (``vllm_attention.py``).
Each figure: one layer's AttentionImpl.forward, planned once outside the timing, run ``--iters``
times back to back between two device synchronizations (decode: replayed from a CUDA graph when
the backend supports graphs, so host launch overhead is not counted); the forward includes
writing the new tokens' K/V (at most 0.2 ms of K/V for the prefill shape).

    python -m benchmarks.attention_kernels --backends flashinfer,triton,flash-attn \
        --page-sizes 16,128
    python -m benchmarks.attention_kernels --backends flash-attn,flashinfer --page-sizes 0 \
        --heads 16/8 --shapes decode:256x1100,decode:64x1100
    python -m benchmarks.attention_kernels --backends flash-attn --page-sizes 128,64 \
        --fa4-decode-tiles fa4,64x128,64x64 --shapes decode:256x129-1280
    python -m benchmarks.attention_kernels --backends flash-attn --page-sizes 64 --heads 16/2 \
        --head-dim 256 --fa4-prefill-tiles default,fa4 --shapes prefill:1x16384-30000
    python -m benchmarks.attention_kernels --backends flashinfer,triton --kv-cache-dtypes fp8 \
        --flashinfer-decodes xqa,fa2 --shapes decode:512x1000-2000
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch

from benchmarks.common import env_set
from benchmarks.vllm_attention import contexts, rate
from pagedgen import envs
from pagedgen.attention.backend import LayerSpec
from pagedgen.attention.flash_attn.fa4 import ENV_DECODE_TILE, ENV_PREFILL_TILE
from pagedgen.attention.metadata import AttentionMetadataBuilder, ScheduledSeq
from pagedgen.attention.registry import get_backend

DEFAULT_SHAPES = "decode:64x4096,decode:1x32768,prefill:8x4096"


def bench(backend_name: str, kind: str, batch: int, ctx: tuple[int, int], page: int,
          iters: int, HQ: int = 32, HKV: int = 8, dev: torch.device = torch.device("cuda"),
          D: int = 128, kv_dtype: torch.dtype = torch.bfloat16,
          triton_tile: str | None = None) -> dict:
    backend = get_backend(backend_name, dev)
    page = page or backend.resolve_block_size(None)
    spec = LayerSpec(HQ, HKV, D, D ** -0.5)
    ctxs, n_new = contexts(kind, batch, ctx)
    torch.manual_seed(0)  # the same cache and queries for every variant of a layout
    pages = [-(-c // page) for c in ctxs]
    num_blocks = sum(pages) + 1
    shape = backend.get_kv_cache_shape(num_blocks, page, HKV, D)
    cache = torch.randn(shape, dtype=torch.bfloat16, device=dev).to(kv_dtype)
    perm = torch.randperm(num_blocks - 1).tolist()
    starts = [sum(pages[:i]) for i in range(batch)]
    seqs = [ScheduledSeq(perm[s:s + p], c - n_new, n_new)
            for s, p, c in zip(starts, pages, ctxs)]
    builder = AttentionMetadataBuilder(page, dev)
    md = builder.build(seqs, []) if kind == "prefill" else builder.build([], seqs)
    state = backend.get_state_cls()(backend, [spec], page, torch.bfloat16, kv_dtype, dev)
    if triton_tile and triton_tile != "default":
        tile = [int(x) for x in triton_tile.split("x")]
        state.block_m, state.block_n, state.num_warps, state.num_stages, state.g_tile = tile[:5]
        state.prefill_dv = tile[5] if len(tile) > 5 else 0
    state.warmup(batch, batch * n_new, max(ctxs))
    impl = backend.get_impl_cls()(spec, state)
    t = batch * n_new
    q = torch.randn(t, HQ, D, dtype=torch.bfloat16, device=dev)
    k = torch.randn(t, HKV, D, dtype=torch.bfloat16, device=dev)
    v = torch.randn(t, HKV, D, dtype=torch.bfloat16, device=dev)
    cuda = dev.type == "cuda"
    graphed = cuda and kind == "decode" and backend.supports_cuda_graphs
    if graphed:
        state.make_graph_plan(batch, num_blocks)
    md = state.build(md, graph_batch_size=batch if graphed else None)
    run = lambda: impl.forward(q, k, v, cache, md)  # noqa: E731
    if graphed:
        run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
        run = graph.replay  # noqa: E731
    else:
        out = run()
    for _ in range(3):
        run()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        run()
    sync()
    s = (time.perf_counter() - t0) / iters  # graph replays or a backend's own launches
    res = {"backend": backend_name, "kind": kind, "batch": batch,
           "context": ctx[0] if ctx[0] == ctx[1] else f"{ctx[0]}-{ctx[1]}", "page": page,
           "heads": f"{HQ}/{HKV}", "head_dim": D, "kv_cache_dtype": str(kv_dtype)[6:],
           "cuda_graph": graphed, "ms": s * 1000}
    if getattr(state, "xqa", False):
        res["decode_kernel"] = "xqa"
    if getattr(state, "prefill_tiles", None) is not None:  # FA4: the tile this kind ran with
        tile = state.prefill_tiles[D > 128] if kind == "prefill" else state.decode_tile
        res[f"fa4_{kind}_tile"] = "x".join(map(str, tile)) if tile else "fa4"
    if backend_name == "triton" and kind == "prefill":
        res["triton_prefill_tile"] = "x".join(map(str, (
            state.block_m, state.block_n, state.num_warps, state.num_stages, state.g_tile,
            *([state.prefill_dv] if state.prefill_dv else []))))
    res.update(rate(kind, ctxs, n_new, HQ, HKV, D, kv_dtype.itemsize, s))
    res["checksum"] = float(out.float().abs().mean())  # equal across variants of one shape
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--backends", default="flashinfer,triton")
    ap.add_argument("--page-sizes", default="16")
    ap.add_argument("--heads", default="32/8", help="query/KV heads, e.g. 16/2,16/4")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="kind:batchxcontext, ...")
    ap.add_argument("--fa4-decode-tiles", default="",
                    help="flash-attn: one run per FA4 decode tile, e.g. fa4,64x128")
    ap.add_argument("--fa4-prefill-tiles", default="",
                    help="flash-attn: one run per FA4 prefill tile, e.g. default,fa4,128x64")
    ap.add_argument("--kv-cache-dtypes", default="bf16", help="bf16, fp8 or both")
    ap.add_argument("--flashinfer-decodes", default="",
                    help="flashinfer: one run per FP8 decode kernel, e.g. xqa,fa2")
    ap.add_argument("--triton-prefill-tiles", default="",
                    help="triton: one prefill run per tile, e.g. default,64x32x8x2x4")
    ap.add_argument("--vllm", action="store_true",
                    help="also vLLM's Triton kernel on the same shapes (bf16)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of the script only")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    heads = [tuple(map(int, h.split("/"))) for h in args.heads.split(",")]
    shapes = []
    for kind, bc in (sh.split(":") for sh in args.shapes.split(",")):
        batch, ctx = bc.split("x")
        lo, _, hi = ctx.partition("-")
        shapes.append((kind, int(batch), (int(lo), int(hi or lo))))
    rows = []
    fa4 = {"decode": (args.fa4_decode_tiles, ENV_DECODE_TILE),
           "prefill": (args.fa4_prefill_tiles, ENV_PREFILL_TILE)}
    kv_dtypes = [{"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}[d]
                 for d in args.kv_cache_dtypes.split(",")]
    for name in args.backends.split(","):
        # (the shapes' kind it applies to, the value, the variable that sets it)
        variants = [(kind, t, var) for kind, (ts, var) in fa4.items() for t in ts.split(",")
                    if t] if name == "flash-attn" else []
        if name == "flashinfer":
            variants = [("decode", d, envs.FLASHINFER_DECODE.name)
                        for d in args.flashinfer_decodes.split(",") if d]
        if name == "triton":  # no variable: the tile is set on the state
            variants = [("prefill", t, "") for t in args.triton_prefill_tiles.split(",") if t]
        for tiled, tile, env in variants or [(None, None, "")]:
            for page in map(int, args.page_sizes.split(",")):
                for (kind, batch, ctx), (hq, hkv), kv in itertools.product(shapes, heads,
                                                                           kv_dtypes):
                    if tiled and kind != tiled:
                        continue
                    try:
                        with env_set(env, None if tile == "default" else tile):
                            r = bench(name, kind, batch, ctx, page, args.iters, hq, hkv,
                                      torch.device(args.device), args.head_dim, kv,
                                      tile if name == "triton" else None)
                    except Exception as e:  # a variant that does not fit (shared memory)
                        if not tile:
                            raise
                        r = {"backend": name, "kind": kind, "tile": tile,
                             "error": f"{type(e).__name__}: {str(e)[:200]}"}
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()  # the cache and graph of that shape are gone
                    rows.append(r)
                    print(json.dumps(r), flush=True)
                    if args.json:  # after every row: a time limit keeps what was measured
                        args.json.write_text(json.dumps(rows, indent=2))
    if args.vllm:
        for hq, hkv in heads:
            for r in vllm_rows(hq, hkv, args.head_dim, shapes, args.iters):
                rows.append(r)
                print(json.dumps(r), flush=True)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=2))


def vllm_rows(hq: int, hkv: int, head_dim: int, shapes: list, iters: int) -> list[dict]:
    """vLLM's kernel on ``shapes`` (``vllm_attention.py`` in a process of vLLM's own), or a
    row saying why not."""
    import os
    import sys

    from benchmarks.vllm_peer import HERE
    from pagedgen.cli.bench.peer import NOT_INSTALLED, run_in_group, site_path, vllm_site

    site = vllm_site()
    if site is None:
        return [{"backend": "vLLM", "skipped": NOT_INSTALLED}]
    spec = {"heads": [hq, hkv], "head_dim": head_dim, "iters": iters,
            "shapes": [[kind, batch, list(ctx)] for kind, batch, ctx in shapes]}
    env = {**os.environ, **({"PYTHONPATH": site_path(site)} if site else {})}
    code, out, err = run_in_group([sys.executable, "-m", "benchmarks.vllm_attention",
                                   json.dumps(spec)], 590.0, env=env, cwd=HERE.parent)
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    if code != 0 and not rows:
        rows = [{"backend": "vLLM", "skipped": f"exit {code}: {err.strip()[-600:]}"}]
    return rows


if __name__ == "__main__":
    main()
