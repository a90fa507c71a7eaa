"""FP8 GEMMs against bf16 on this GPU, for a model's linear shapes (issue 32).

For each M, each of the model's four linear layers (qkv, o, gate_up, down; summed) through the
bf16 GEMM and every FP8 kernel that can run it (``runtime/quantization/fp8/``), timed from CUDA
graph replays as the model runs them, plus the kernel the layer's measured plan picks. Prints
microseconds, each one's speed-up over bf16, and the weight bandwidth reached;
``--every-tile`` also each Triton tile's time (``<kind>/<tile>_us``), and the tensor-core
instructions each Triton kernel was compiled to (``wgmma``: Hopper's asynchronous warpgroup MMA;
``mma.sync``: the Ampere-style one).

    python -m benchmarks.fp8_gemm --profile llama-3-8b --json benchmarks/results/fp8-gemm.json
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

import torch

from benchmarks.common import print_table
from pagedgen.runtime.hardware import copy_bandwidth
from pagedgen.runtime.models.loader import resolve_model
from pagedgen.runtime.quantization.fp8.gemm import (
    candidates,
    graph_time,
    plan_gemm,
    run_gemm,
    standalone_layer,
)


def shapes(profile: str) -> dict[str, tuple[int, int]]:
    c = resolve_model(profile).hf_config
    d = c.head_dim or c.hidden_size // c.num_attention_heads
    q, kv = c.num_attention_heads * d, c.num_key_value_heads * d
    return {"qkv": (q + 2 * kv, c.hidden_size), "o": (c.hidden_size, q),
            "gate_up": (2 * c.intermediate_size, c.hidden_size),
            "down": (c.hidden_size, c.intermediate_size)}


def mma_instructions() -> dict[str, str]:
    """For each Triton FP8 GEMM kernel this process compiled: the tensor-core instructions in
    its PTX and its shared memory."""
    from pagedgen.runtime.quantization.fp8 import kernels as k

    out = {}
    for name in ("_scaled_gemm_kernel", "_scaled_gemm_tma_kernel"):
        for cache in getattr(getattr(k, name), "device_caches", {}).values():
            for i, compiled in enumerate(cache[0].values()):
                ptx = compiled.asm.get("ptx", "")
                acc = re.search(r"tensor<(\d+x\d+)xf32, #mma", compiled.asm.get("ttgir", ""))
                ops = sorted(set(re.findall(r"(?:wgmma\.mma_async|mma\.sync)[\w.]*", ptx)))
                meta = compiled.metadata
                out[f"{name} #{i} acc {acc[1] if acc else '?'}"] = (
                    f"{' '.join(ops) or 'no MMA'}; {getattr(meta, 'shared', '?')} B shared, "
                    f"{getattr(meta, 'num_warps', '?')} warps, "
                    f"{getattr(meta, 'num_stages', '?')} stages")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="llama-3-8b")
    ap.add_argument("--m", default="1,8,16,32,64,128,256,512,1024,4096,8192")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--every-tile", action="store_true",
                    help="each Triton tile's time too, and its kernel's MMA instructions")
    ap.add_argument("--tma-tiles", default="",
                    help="more TMA tiles to try, NAME=BM,BN,BK,WARPS,STAGES;... (this run only)")
    args = ap.parse_args()
    from pagedgen.runtime.quantization.fp8 import kernels as fp8_kernels

    for spec in filter(None, args.tma_tiles.split(";")):
        name, _, dims = spec.partition("=")
        fp8_kernels.TMA_TILES[name] = tuple(int(v) for v in dims.split(","))
    if not torch.cuda.is_available():
        sys.exit("fp8_gemm.py needs a CUDA GPU")
    bw = copy_bandwidth()
    layers = {}
    for name, (n, kk) in shapes(args.profile).items():
        w = torch.randn(n, kk, device="cuda", dtype=torch.bfloat16) * 0.02
        layer = standalone_layer(w)
        layer.dense = w
        layer.plan = plan_gemm(layer, None)
        layers[name] = layer
    fp8_bytes = sum(lay.weight.numel() for lay in layers.values())
    rows = []
    for m in [int(v) for v in args.m.split(",")]:
        xs = {name: torch.randn(m, lay.weight.shape[1], device="cuda", dtype=torch.bfloat16)
              for name, lay in layers.items()}
        dense = sum(graph_time(lambda lay=lay, x=xs[n]: x @ lay.dense.t())
                    for n, lay in layers.items())
        row = {"M": m, "bf16_us": 1e6 * dense}
        best: dict[str, tuple[float, str]] = {}  # kind → (time, its fastest tile)
        for gemm in candidates(next(iter(layers.values())), None, m):
            t = sum(graph_time(lambda lay=lay, x=xs[n], g=gemm: run_gemm(g, lay, x, None))
                    for n, lay in layers.items())
            kind = gemm.split("/")[0]
            best[kind] = min(best.get(kind, (math.inf, "")), (t, gemm))
            if args.every_tile and "/" in gemm:
                row[f"{gemm}_us"] = 1e6 * t
        for kind, (t, gemm) in best.items():
            row[f"{kind}_us"] = 1e6 * t
            row[f"{kind}_speedup"] = dense / t
            if "/" in gemm:
                row[f"{kind}_tile"] = gemm.split("/")[1]
        chosen = sum(graph_time(lambda lay=lay, x=xs[n]: run_gemm(lay.plan.choose(m), lay, x,
                                                                   None))
                     for n, lay in layers.items())
        row["plan"] = " ".join(lay.plan.choose(m) for lay in layers.values())
        row["plan_speedup"] = dense / chosen
        row["plan_weight_TBps"] = fp8_bytes / chosen / 1e12
        row["plan_bw_fraction"] = fp8_bytes / chosen / bw
        rows.append(row)
        print(json.dumps(row), flush=True)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "profile": args.profile, "copy_bw_tb_s": bw / 1e12,
            "shapes": shapes(args.profile)}
    if args.every_tile:
        try:
            meta["mma"] = mma_instructions()
        except (AttributeError, KeyError, TypeError, IndexError) as e:  # Triton's internals
            meta["mma"] = {"unread": repr(e)}
        print(json.dumps(meta["mma"]), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    cols = sorted({c for r in rows for c in r}, key=lambda c: (c != "M", c))
    print_table(f"FP8 GEMMs vs bf16 on {meta['gpu']} ({args.profile}, 4 layers summed)", rows,
                cols)


if __name__ == "__main__":
    main()
