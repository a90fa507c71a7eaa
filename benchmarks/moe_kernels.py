"""A MoE layer's kernels alone (issue 35): pagedgen's (routing, slot sort, the two grouped GEMMs,
the sum over each token's experts; the sort and the sum also by torch's ops) against vLLM's
``fused_topk`` + ``fused_experts`` (in a process of its own, as ``vllm_peer.py`` runs vLLM),
each replayed from a CUDA graph, at several token counts, on Qwen3-30B-A3B's and Mixtral-8x7B's
expert shapes (bf16, random weights, router logits from a random gate, the same for both).
Prints each time, the bytes of the experts a step reads over the measured copy bandwidth, and
pagedgen's split by kernel; and pagedgen's layer on the same experts quantized to FP8 per
channel (``fp8``, with the plan's way of running them: ``fp8_mode``) against the FP8 bytes
(``fp8_roofline_ms``) and vLLM's Triton FP8 experts as its ``quantization="fp8"`` runs them
(``vllm_fp8``: one scale per expert, activations quantized per tensor as they come).

``--align``: the slot sort alone (``moe.align``: each way, and ``align``'s choice) at decode
to long-prefill slot counts of Qwen3.5-35B-A3B's 256 experts (and Qwen3-30B-A3B's 128,
Mixtral's 8), for each warp count.
``--tma``: each GEMM at prefill counts in every plan candidate that loads its weights by
pointers and in its TMA twin (bf16 and FP8 weights), in TFLOP/s.

    python -m benchmarks.moe_kernels [--align | --tma] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768, True), "mixtral-8x7b": (8, 2, 4096, 14336, True)}
TOKENS = (1, 8, 64, 256, 1024, 8192)


def _inputs(shape: tuple, tokens: int, seed: int = 0):
    e, k, h, i, _ = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16, generator=g)
    w13 = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    w2 = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    gate = torch.randn(e, h, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    return x, w13, w2, x @ gate.t()


def _replay_ms(fn, calls: int = 5) -> float:
    """Median ms of one ``fn`` call from CUDA-graph replays (written out here too: the vLLM
    process imports nothing of pagedgen)."""
    fn()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / calls)
    return sorted(times)[3]


def pagedgen_times() -> dict[str, dict[int, dict[str, float]]]:
    from pagedgen.runtime.layers import fused_ops
    from pagedgen.runtime.layers.moe import align as moe_align
    from pagedgen.runtime.layers.moe import grouped_mm as moe_grouped_mm
    from pagedgen.runtime.layers.moe import kernels as mk
    from pagedgen.runtime.layers.moe import route as moe_route
    from pagedgen.runtime.layers.moe.combine import slot_sum, slot_sum_reference
    from pagedgen.runtime.layers.moe.plan import plan_moe

    out: dict[str, dict[int, dict[str, float]]] = {}
    for name, shape in SHAPES.items():
        e, k, h, i, renorm = shape
        out[name] = {}
        for t in TOKENS:
            x, w13, w2, logits = _inputs(shape, t)
            plan = plan_moe(w13, w2, k)
            tiles = plan.choose(t)
            weights, ids = moe_route.route(logits, k, renorm)
            slots, experts = moe_align.align(ids, e, tiles[0].block_m)
            inter = x.new_empty(t * k, i)
            down = x.new_empty(t * k, h)
            row = {
                "total": _replay_ms(lambda: mk.fused_experts(
                    x, w13, w2, *moe_route.route(logits, k, renorm), tiles)),
                "route": _replay_ms(lambda: moe_route.route(logits, k, renorm)),
                "align": _replay_ms(lambda: moe_align.align(ids, e, tiles[0].block_m)),
                "gate_up": _replay_ms(lambda: mk.grouped_gemm(
                    x, w13, inter, slots, experts, t * k, tiles[0], k, gated=True)),
                "down": _replay_ms(lambda: mk.grouped_gemm(
                    inter, w2, down, slots, experts, t * k, tiles[1], 1, gated=False,
                    weights=weights.reshape(-1))),
                "align_torch": _replay_ms(
                    lambda: moe_align.align_reference(ids, e, tiles[0].block_m)),
                "slot_sum": _replay_ms(lambda: slot_sum(down, k)),
                "slot_sum_torch": _replay_ms(lambda: slot_sum_reference(down, k)),
                "tiles": f"{tiles[0].name} / {tiles[1].name}"}
            if moe_grouped_mm.available(w13):  # torch's grouped GEMM, for prefill counts
                row["torch_grouped"] = _replay_ms(lambda: moe_grouped_mm.experts(
                    x, w13, w2, *moe_route.route(logits, k, renorm),
                    silu_and_mul=fused_ops.silu_and_mul_fused))
                if t >= plan.grouped_mm_from:  # what the layer runs at this count
                    row["tiles"], row["total"] = "torch grouped GEMM", row["torch_grouped"]
            row.update(_fp8_times(x, w13, w2, logits, k, renorm, t))
            out[name][t] = row
    return out


def _fp8_times(x, w13, w2, logits, k: int, renorm: bool, t: int) -> dict:
    """The layer's time with these experts quantized to e4m3 per output channel."""
    from pagedgen.runtime.layers import fused_ops
    from pagedgen.runtime.layers.moe import grouped_mm as moe_grouped_mm
    from pagedgen.runtime.layers.moe import kernels as mk
    from pagedgen.runtime.layers.moe import route as moe_route
    from pagedgen.runtime.layers.moe.plan import plan_moe

    q13, q2, scales = mk.ExpertScales.quantize(w13, w2)
    plan = plan_moe(q13, q2, k, scales, x.dtype)
    tiles, a8 = plan.choose(t), plan.native(t)
    row = {"fp8": _replay_ms(lambda: mk.fused_experts(
        x, q13, q2, *moe_route.route(logits, k, renorm), tiles, None, scales, a8)),
        "fp8_mode": ("w8a8 " if a8 else "w8a16 ") + tiles[0].name}
    if moe_grouped_mm.available(q13, scales):
        row["fp8_torch_grouped"] = _replay_ms(lambda: moe_grouped_mm.experts(
            x, q13, q2, *moe_route.route(logits, k, renorm),
            silu_and_mul=fused_ops.silu_and_mul_fused, scales=scales))
        if t >= plan.grouped_mm_from:  # what the layer runs at this count
            row["fp8_mode"], row["fp8"] = "torch FP8 grouped GEMM", row["fp8_torch_grouped"]
    return row


def _per_expert_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 weights with one float32 scale per expert (vLLM's online FP8 experts)."""
    scale = w.abs().amax(dim=(1, 2)).float() / torch.finfo(torch.float8_e4m3fn).max
    return (w / scale[:, None, None]).to(torch.float8_e4m3fn), scale


def _vllm_worker(out_path: str) -> None:
    """vLLM's MoE kernels on the same inputs, bf16 and FP8 (this process imports vLLM, not
    pagedgen)."""
    from vllm.model_executor.layers.fused_moe import fused_experts, fused_topk
    from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config

    res: dict[str, dict[int, dict[str, float]]] = {}
    for name, shape in SHAPES.items():
        e, k, h, i, renorm = shape
        res[name] = {}
        for t in TOKENS:
            x, w13, w2, logits = _inputs(shape, t)
            (q13, s13), (q2, s2) = _per_expert_fp8(w13), _per_expert_fp8(w2)
            fp8 = fp8_w8a8_moe_quant_config(w1_scale=s13, w2_scale=s2)

            def run(quant=None, w=(w13, w2)):
                routed = fused_topk(x, logits, k, renorm)
                return fused_experts(x, *w, routed[0], routed[1], quant_config=quant)

            res[name][t] = {"bf16": _replay_ms(run),
                            "fp8": _replay_ms(lambda: run(fp8, (q13, q2)))}
    Path(out_path).write_text(json.dumps(res))


def vllm_times() -> dict | str:
    from pagedgen.cli.bench.peer import site_path, vllm_site

    site = vllm_site()
    if site is None:
        return "vLLM is not installed here"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "vllm.json"
        env = {**os.environ, "VLLM_NO_USAGE_STATS": "1",
               **({"PYTHONPATH": site_path(site)} if site else {})}
        res = subprocess.run([sys.executable, "-m", "benchmarks.moe_kernels", "--vllm-worker",
                              str(out)], env=env, capture_output=True, text=True,
                             cwd=Path(__file__).parent.parent, timeout=400)
        if res.returncode != 0:
            return f"vLLM failed: {res.stderr.strip().splitlines()[-3:]}"
        return json.loads(out.read_text())


def align_rows(cases=((256, 8, 1, 16), (256, 8, 64, 16), (256, 8, 256, 16), (256, 8, 512, 16),
                       (256, 8, 1024, 64), (256, 8, 2048, 64), (256, 8, 4096, 64),
                       (256, 8, 8192, 128), (256, 8, 16384, 128), (128, 8, 256, 16),
                       (128, 8, 16384, 128), (8, 2, 256, 16), (8, 2, 8192, 128)),
               warps=(4, 8)) -> list[dict]:
    """The slot sort (us a call, replayed in a CUDA graph): torch's ops, the Triton program
    per expert (``by_expert_w{warps}``; to 32,768 slots: each program reads every slot) and
    the chunked one (``by_chunks_w{warps}``), and ``align``'s choice."""
    from pagedgen.runtime.layers.moe import align as moe_align
    from pagedgen.runtime.layers.moe import route as moe_route

    rows = []
    for e, k, t, block_m in cases:
        logits = torch.randn(t, e, device="cuda", dtype=torch.bfloat16)
        _, ids = moe_route.route(logits, k, True)
        row = {"experts": e, "top_k": k, "tokens": t, "block_m": block_m,
               "torch_us": round(1000 * _replay_ms(
                   lambda: moe_align.align_reference(ids, e, block_m), calls=20), 2),
               "align_us": round(1000 * _replay_ms(
                   lambda: moe_align.align(ids, e, block_m), calls=20), 2)}
        for w in warps:
            if t * k <= 32768:
                row[f"by_expert_w{w}_us"] = round(1000 * _replay_ms(
                    lambda: moe_align.align_by_expert(ids, e, block_m, num_warps=w),
                    calls=20), 2)
            row[f"by_chunks_w{w}_us"] = round(1000 * _replay_ms(
                lambda: moe_align.align_by_chunks(ids, e, block_m, num_warps=w), calls=20), 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def tma_rows(tokens=(2048, 8192), shapes=("qwen3-30b-a3b",)) -> list[dict]:
    """Each prefill-height candidate against its TMA twin, per GEMM (``--tma``)."""
    from dataclasses import replace

    from pagedgen.runtime.layers.moe import align as moe_align
    from pagedgen.runtime.layers.moe import kernels as mk
    from pagedgen.runtime.layers.moe import route as moe_route
    from pagedgen.runtime.layers.moe.plan import CANDIDATES, fits

    rows = []
    for name in shapes:
        e, k, h, i, renorm = shape = SHAPES[name]
        for fp8 in (False, True):
            for t in tokens:
                x, w13, w2, logits = _inputs(shape, t)
                scales = None
                if fp8:
                    w13, w2, scales = mk.ExpertScales.quantize(w13, w2)
                weights, ids = moe_route.route(logits, k, renorm)
                inter, down = x.new_empty(t * k, i), x.new_empty(t * k, h)
                for base in CANDIDATES.values():
                    if base.tma or base.block_m < 64 or base.swap:
                        continue
                    slots, experts = moe_align.align(ids, e, base.block_m)
                    row = {"shape": name, "fp8": fp8, "tokens": t, "tiles": base.name}
                    for tiles in (base, replace(base, tma=True)):
                        for gemm, gated, flop_k in (("up", True, h), ("down", False, i)):
                            if not fits(tiles, 2, gated, 1 if fp8 else 2):
                                continue
                            a, w, o, s = ((x, w13, inter, scales and scales.w13) if gated
                                          else (inter, w2, down, scales and scales.w2))
                            try:
                                ms = _replay_ms(lambda: mk.grouped_gemm(
                                    a, w, o, slots, experts, t * k, tiles, k if gated else 1,
                                    gated=gated, w_scale=s,
                                    weights=None if gated else weights.reshape(-1)))
                            except Exception as exc:  # noqa: BLE001 - a tile that won't build
                                row[f"{gemm}{'_tma' * tiles.tma}"] = str(exc)[:80]
                                continue
                            flop = 2 * t * k * flop_k * o.shape[1] * (2 if gated else 1)
                            row[f"{gemm}{'_tma' * tiles.tma}_us"] = round(1000 * ms, 1)
                            row[f"{gemm}{'_tma' * tiles.tma}_tflops"] = round(flop / ms / 1e9)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--vllm-worker")
    ap.add_argument("--align", action="store_true")
    ap.add_argument("--tma", action="store_true")
    args = ap.parse_args()
    if args.vllm_worker:
        _vllm_worker(args.vllm_worker)
        return
    if args.align or args.tma:
        rows = align_rows() if args.align else tma_rows()
        if args.json:
            Path(args.json).write_text(json.dumps({"rows": rows}, indent=1))
        return
    from pagedgen.runtime.hardware import copy_bandwidth
    from pagedgen.runtime.layers.moe.layer import expected_active_experts

    bw = copy_bandwidth()
    ours = pagedgen_times()
    theirs = vllm_times()
    rows = []
    for name, (e, k, h, i, _) in SHAPES.items():
        expert_bytes = 3 * h * i * 2
        for t in TOKENS:
            active = expected_active_experts(e, k, t)
            row = {"shape": name, "tokens": t, **ours[name][t],
                   "roofline_ms": 1000 * active * expert_bytes / bw,
                   "fp8_roofline_ms": 1000 * active * expert_bytes / 2 / bw}
            if isinstance(theirs, dict):
                peer = theirs[name][str(t)]
                row.update(vllm=peer["bf16"], vllm_over_ours=peer["bf16"] / row["total"],
                           vllm_fp8=peer["fp8"], vllm_fp8_over_ours=peer["fp8"] / row["fp8"])
            rows.append(row)
            print(json.dumps({kk: round(v, 4) if isinstance(v, float) else v
                              for kk, v in row.items()}))
    if not isinstance(theirs, dict):
        print("vllm:", theirs)
    if args.json:
        Path(args.json).write_text(json.dumps({"copy_bw_tb_s": bw / 1e12, "rows": rows,
                                               "vllm": None if isinstance(theirs, dict)
                                               else theirs}, indent=1))


if __name__ == "__main__":
    main()
