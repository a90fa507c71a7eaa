"""Attention kernel throughput per backend on fixed shapes (issues 6 and 7).

``--heads`` query/KV heads (default 32/8, Llama-3-8B's), head_dim 128, bf16, page sizes
``--page-sizes`` (default 16, and each backend's own with 0), NHD cache; ``--shapes`` (default:
decode 64 x 4096 and 1 x 32768, in GB/s of K/V read; prefill 8 x 4096 causal, in TFLOP/s).
Each figure: one layer's AttentionImpl.forward, planned once outside the timing, run ``--iters``
times back to back between two CUDA events (decode: replayed from a CUDA graph when the backend
supports graphs, so host launch overhead is not counted); the forward includes writing the new
tokens' K/V (at most 0.2 ms of K/V for the prefill shape).

    python benchmarks/attention_kernels.py --backends flashinfer,triton,flash-attn \
        --page-sizes 16,128
    python benchmarks/attention_kernels.py --backends flash-attn,flashinfer --page-sizes 0 \
        --heads 16/8 --shapes decode:256x1100,decode:64x1100
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from pagedgen.attention.backend import AttentionMetadataBuilder, LayerSpec, ScheduledSeq
from pagedgen.attention.registry import get_backend

D = 128
DEFAULT_SHAPES = "decode:64x4096,decode:1x32768,prefill:8x4096"


def bench(backend_name: str, kind: str, batch: int, ctx: int, page: int, iters: int,
          HQ: int = 32, HKV: int = 8) -> dict:
    dev = torch.device("cuda")
    backend = get_backend(backend_name, dev)
    page = page or backend.resolve_block_size(None)
    spec = LayerSpec(HQ, HKV, D, D ** -0.5)
    n_new = 1 if kind == "decode" else ctx
    pages_per_seq = -(-ctx // page)
    num_blocks = batch * pages_per_seq + 1
    shape = backend.get_kv_cache_shape(num_blocks, page, HKV, D)
    cache = torch.randn(shape, dtype=torch.bfloat16, device=dev)
    perm = torch.randperm(num_blocks - 1).tolist()
    seqs = [ScheduledSeq(perm[i * pages_per_seq:(i + 1) * pages_per_seq], ctx - n_new, n_new)
            for i in range(batch)]
    builder = AttentionMetadataBuilder(page, dev)
    md = builder.build(seqs, []) if kind == "prefill" else builder.build([], seqs)
    state = backend.get_state_cls()(backend, [spec], page, torch.bfloat16, torch.bfloat16, dev)
    impl = backend.get_impl_cls()(spec, state)
    t = batch * n_new
    q = torch.randn(t, HQ, D, dtype=torch.bfloat16, device=dev)
    k = torch.randn(t, HKV, D, dtype=torch.bfloat16, device=dev)
    v = torch.randn(t, HKV, D, dtype=torch.bfloat16, device=dev)
    run = lambda: impl.forward(q, k, v, cache, md)  # noqa: E731
    graphed = kind == "decode" and backend.supports_cuda_graphs
    if graphed:
        state.make_graph_plan(batch, num_blocks)
        state.begin_forward(md, graph_batch_size=batch)
        run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        run = graph.replay  # noqa: E731
    else:
        state.begin_forward(md)
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        run()
    b.record()
    torch.cuda.synchronize()
    s = a.elapsed_time(b) / 1000 / iters
    res = {"backend": backend_name, "kind": kind, "batch": batch, "context": ctx, "page": page,
           "heads": f"{HQ}/{HKV}", "cuda_graph": graphed, "ms": s * 1000}
    if kind == "decode":
        res["GB_s"] = batch * ctx * HKV * D * 2 * 2 / s / 1e9
    else:
        res["TFLOP_s"] = batch * 4 * HQ * D * ctx * (ctx + 1) / 2 / s / 1e12
    del cache
    torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--backends", default="flashinfer,triton")
    ap.add_argument("--page-sizes", default="16")
    ap.add_argument("--heads", default="32/8", help="query/KV heads")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="kind:batchxcontext, ...")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    hq, hkv = map(int, args.heads.split("/"))
    shapes = [(kind, *map(int, bc.split("x"))) for kind, bc in
              (sh.split(":") for sh in args.shapes.split(","))]
    rows = []
    for name in args.backends.split(","):
        for page in map(int, args.page_sizes.split(",")):
            for kind, batch, ctx in shapes:
                r = bench(name, kind, batch, ctx, page, args.iters, hq, hkv)
                rows.append(r)
                print(json.dumps(r), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
