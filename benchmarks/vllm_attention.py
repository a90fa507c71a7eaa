"""vLLM's Triton attention kernel (``unified_attention``, what vLLM 0.26 runs on every layer of
a model with heads over 256, Gemma 4's) timed on ``attention_kernels``' shapes, in a process
of vLLM's own (``attention_kernels --vllm`` starts it with vLLM's site on ``PYTHONPATH``; no
pagedgen imports here).

The same contexts as ``attention_kernels`` draws (seeded), pages of 16 as vLLM's Triton
backend takes, K and V in its layout (``[blocks, KV heads, page, 2 x head]`` seen as
``[blocks, page, KV heads, head]`` each), bf16; decodes replayed from a CUDA graph with the
split-softmax buffers vLLM's backend allocates (its 3D kernel below ``128 / KV heads``
sequences, as vLLM picks). One JSON row per shape on stdout. The shapes' contexts and rates
(``contexts``, ``rate``) are ``attention_kernels``' too: this module imports no pagedgen.

    PYTHONPATH=/tmp/site-vllm python -m benchmarks.vllm_attention '{"heads": [32, 4],
        "head_dim": 512, "shapes": [["decode", 64, [4096, 4096]]], "iters": 20}'
"""

from __future__ import annotations

import json
import sys
import time

import torch

PAGE = 16
SEGMENTS = 16  # vLLM's NUM_PAR_SOFTMAX_SEGMENTS
MIN_GRID_2D = 128  # vLLM's MIN_LAUNCH_GRID_SIZE_2D


def contexts(kind: str, batch: int, ctx: tuple[int, int]) -> tuple[list[int], int]:
    """A shape's sequence lengths (seeded: each drawn from ``ctx``) and each one's new tokens
    (a decode's 1; a prefill's ``ctx[0]``, after the rest cached), as ``attention_kernels``
    and this module both draw them."""
    g = torch.Generator().manual_seed(0)
    ctxs = torch.randint(ctx[0], ctx[1] + 1, (batch,), generator=g).tolist()
    return ctxs, 1 if kind == "decode" else ctx[0]


def rate(kind: str, ctxs: list[int], n_new: int, hq: int, hkv: int, d: int, kv_bytes: int,
         seconds: float) -> dict[str, float]:
    """A decode's GB/s of K and V read (``kv_bytes`` an element), a causal prefill's TFLOP/s."""
    if kind == "decode":
        return {"GB_s": sum(ctxs) * hkv * d * 2 * kv_bytes / seconds / 1e9}
    pairs = sum(n_new * (c - n_new) + n_new * (n_new + 1) / 2 for c in ctxs)
    return {"TFLOP_s": 4 * hq * d * pairs / seconds / 1e12}


def bench(kind: str, batch: int, ctx: tuple[int, int], hq: int, hkv: int, d: int,
          iters: int) -> dict:
    import vllm
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention

    dev = torch.device("cuda")
    ctxs, n_new = contexts(kind, batch, ctx)
    pages = [-(-c // PAGE) for c in ctxs]
    num_blocks = sum(pages) + 1
    torch.manual_seed(0)
    kv = torch.randn(num_blocks, hkv, PAGE, 2 * d, dtype=torch.bfloat16, device=dev)
    k_cache, v_cache = kv.transpose(1, 2).split(d, dim=-1)
    perm = torch.randperm(num_blocks - 1).tolist()
    table = torch.zeros(batch, max(pages), dtype=torch.int32)
    start = 0
    for i, p in enumerate(pages):
        table[i, :p] = torch.tensor(perm[start:start + p], dtype=torch.int32)
        start += p
    table = table.to(dev)
    t = batch * n_new
    q = torch.randn(t, hq, d, dtype=torch.bfloat16, device=dev)
    out = torch.empty_like(q)
    cu_q = torch.arange(0, t + 1, n_new, dtype=torch.int32, device=dev)
    seqused = torch.tensor(ctxs, dtype=torch.int32, device=dev)
    ones = torch.ones(1, dtype=torch.float32, device=dev).expand(batch, hkv)
    threshold = MIN_GRID_2D // hkv
    pow2 = 1 << (d - 1).bit_length()
    segm = (torch.empty(threshold, hq, SEGMENTS, pow2, dtype=torch.float32, device=dev),
            torch.empty(threshold, hq, SEGMENTS, dtype=torch.float32, device=dev),
            torch.empty(threshold, hq, SEGMENTS, dtype=torch.float32, device=dev))

    def run() -> None:
        unified_attention(q=q, k=k_cache, v=v_cache, out=out, cu_seqlens_q=cu_q,
                          max_seqlen_q=n_new, seqused_k=seqused, max_seqlen_k=max(ctxs),
                          softmax_scale=d ** -0.5, causal=True, window_size=(-1, -1),
                          block_table=table, softcap=0, q_descale=None,
                          k_descale=ones, v_descale=ones, seq_threshold_3D=threshold,
                          num_par_softmax_segments=SEGMENTS, softmax_segm_output=segm[0],
                          softmax_segm_max=segm[1], softmax_segm_expsum=segm[2])

    run()
    torch.cuda.synchronize()
    graphed = kind == "decode"
    step = run
    if graphed:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        step = graph.replay
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    torch.cuda.synchronize()
    s = (time.perf_counter() - t0) / iters
    row = {"backend": f"vLLM {vllm.__version__} triton (unified_attention)", "kind": kind,
           "batch": batch, "context": ctx[0] if ctx[0] == ctx[1] else f"{ctx[0]}-{ctx[1]}",
           "page": PAGE, "heads": f"{hq}/{hkv}", "head_dim": d, "cuda_graph": graphed,
           "kernel": "3D (split softmax)" if graphed and batch <= threshold else "2D",
           "ms": s * 1000, **rate(kind, ctxs, n_new, hq, hkv, d, 2, s)}
    return row


def main() -> None:
    spec = json.loads(sys.argv[1])
    hq, hkv = spec["heads"]
    for kind, batch, (lo, hi) in spec["shapes"]:
        try:
            row = bench(kind, batch, (lo, hi), hq, hkv, spec["head_dim"], spec["iters"])
        except Exception as e:  # a shape vLLM's kernel does not take: said, the rest run
            row = {"backend": "vLLM triton", "kind": kind, "batch": batch,
                   "error": f"{type(e).__name__}: {str(e)[:300]}"}
        torch.cuda.empty_cache()
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
