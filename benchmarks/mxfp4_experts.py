"""One gpt-oss MoE layer's MXFP4 experts (issue 61) through the grouped GEMM in every swapped
tile, at decode token counts: each tile's time for the whole layer (gate/up, the biased clamped
SwiGLU, down with its bias and routing weights, the slot sum), replayed from a CUDA graph,
against the 4-bit floor: the codes and exponents of the experts the step's tokens chose, over
the copy bandwidth as ``profile`` measures it (``hardware.copy_bandwidth``). The experts are
drawn dense and stored through the MoE method's own load path, in whatever layout it keeps
them.

    python -m benchmarks.mxfp4_experts [--model gpt-oss-20b] [--tokens 1,64,256] [--tiles A,B]
        [--unfolded] [--json F]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from benchmarks.moe_kernels import _replay_ms
from pagedgen.runtime import hardware
from pagedgen.runtime.collectives.parallel import TensorParallel
from pagedgen.runtime.layers.moe import kernels as mk
from pagedgen.runtime.layers.moe.act import clamped_swiglu
from pagedgen.runtime.layers.moe.layer import FusedMoE
from pagedgen.runtime.layers.moe.plan import CANDIDATES, mostly_padding, random_routing
from pagedgen.runtime.quantization.mxfp4.moe import Mxfp4Moe

SHAPES = {"gpt-oss-20b": (32, 4, 2880, 2880), "gpt-oss-120b": (128, 4, 2880, 2880)}


def layer(shape: tuple[int, int, int, int], dev: torch.device) -> FusedMoE:
    experts, top_k, hidden, inter = shape
    with torch.device(dev):
        moe = FusedMoE(experts, top_k, hidden, inter, TensorParallel(), method=Mxfp4Moe(),
                       act=clamped_swiglu(1.702, 7.0), bias=True)
    g = torch.Generator(device=dev).manual_seed(0)
    for name in FusedMoE.DRAWN:
        moe.load_drawn(name, torch.randn(moe.drawn_shape(name), device=dev, generator=g) * 0.02)
    with torch.no_grad():
        moe.w13_bias.normal_(0, 0.02, generator=g)
        moe.w2_bias.normal_(0, 0.02, generator=g)
    return moe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt-oss-20b", choices=sorted(SHAPES))
    ap.add_argument("--tokens", default="1,64,256")
    ap.add_argument("--tiles", default=None, help="these swapped tiles only (names, commas)")
    ap.add_argument("--unfolded", action="store_true",
                    help="convert with two multiplies, as for exponents past 128 (before/after)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    shape = SHAPES[args.model]
    moe = layer(shape, dev)
    scales = moe.method.scales(moe)
    if args.unfolded:
        scales = dataclasses.replace(scales, small_exponents=False)
    per_expert = sum(t[0].numel() for t in (moe.w13_weight, moe.w2_weight, scales.w13,
                                            scales.w2))
    gbps = hardware.copy_bandwidth() / 1e9
    swapped = [t for t in CANDIDATES.values() if t.swap
               and (args.tiles is None or t.name in args.tiles.split(","))]
    rows = []
    print(f"{args.model}: {shape[0]} experts, top {shape[1]}, copy {gbps:,.0f} GB/s; "
          f"{torch.cuda.get_device_name(dev)}; conversion "
          f"{'folded' if scales.small_exponents else 'two multiplies'}")
    for tokens in map(int, args.tokens.split(",")):
        x = torch.randn(tokens, shape[2], device=dev, dtype=torch.bfloat16) * 0.5
        weights, ids = random_routing(tokens, shape[0], shape[1], dev)
        floor_us = ids.unique().numel() * per_expert / gbps / 1e3
        times = {}
        for t in swapped:
            if mostly_padding(t.block_m, tokens, shape[1], shape[0]):
                continue
            try:
                times[t.name] = 1e3 * _replay_ms(lambda t=t: mk.fused_experts(
                    x, moe.w13_weight, moe.w2_weight, weights, ids, (t, t), None, scales,
                    act=moe.act, b13=moe.w13_bias, b2=moe.w2_bias))
            except Exception as e:  # a tile this GPU or Triton cannot build
                print(f"  {t.name}: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
        best = min(times, key=times.get)
        got = mk.fused_experts(x, moe.w13_weight, moe.w2_weight, weights, ids,
                               (CANDIDATES[best],) * 2, None, scales, act=moe.act,
                               b13=moe.w13_bias, b2=moe.w2_bias).float()
        want = mk.reference(x.float(), *moe.method.dense(moe, torch.float32), weights, ids,
                            moe.act, moe.w13_bias, moe.w2_bias)
        err = ((got - want).abs().max() / want.abs().max()).item()
        print(f"tokens {tokens}: best {best} {times[best]:.1f} us, floor {floor_us:.1f} us "
              f"({floor_us / times[best]:.2f} of it), error {err:.1e} of the loop's peak; " +
              ", ".join(f"{k} {v:.0f}" for k, v in sorted(times.items(), key=lambda kv: kv[1])))
        rows.append({"tokens": tokens, "best": best, "us": times, "floor_us": floor_us,
                     "error": err})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "gpu": torch.cuda.get_device_name(dev),
                       "copy_gbps": gbps, "folded": scales.small_exponents, "rows": rows},
                      f, indent=2)


if __name__ == "__main__":
    main()
