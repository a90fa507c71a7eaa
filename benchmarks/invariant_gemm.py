"""``--batch-invariant``'s GEMM against cuBLAS on a model's linear shapes (issue 97).

For each row count M, each linear layer of the profile (qkv, o, gate_up, down, the LM head)
through cuBLAS (``F.linear``) and through the invariant GEMM in each of its ``CANDIDATES``
(``runtime/quantization/invariant_gemm.py``) and of ``--tiles`` (more:
ROWSxCOLSxWARPSxSTAGES[xtma]), timed over eager calls: TFLOP/s, and the shape's plan's choice
(timed from graph replays, as a run times it) against cuBLAS. Then whether each tile gives the
first tile's bits on every shape (a plan mixes only tiles that do: ``kept_tiles``) and which
tiles this device keeps.

    python -m benchmarks.invariant_gemm --profile llama-3-8b --json $OUT/invariant-gemm.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from benchmarks.common import event_ms, print_table
from benchmarks.fp8_gemm import shapes
from pagedgen.runtime.models.loader import resolve_model
from pagedgen.runtime.quantization.invariant_gemm import (
    CANDIDATES,
    Tiles,
    kept_tiles,
    parse_tiles,
    tile_name,
    tiled_linear,
    tiles_for,
)


def candidates(text: str) -> list[Tiles]:
    """``--tiles``: "128x256x8x3,..." as Tiles (rows, columns, warps, stages)."""
    return [parse_tiles(t) for t in text.split(",") if t]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="llama-3-8b")
    ap.add_argument("--m", default="1,16,64,256,512,2048,8192")
    ap.add_argument("--tiles", default="",
                    help="more tiles to time, ROWSxCOLSxWARPSxSTAGES (128x256x8x3,...)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("invariant_gemm.py needs a CUDA GPU")
    dev, dt = torch.device("cuda"), torch.bfloat16
    layers = shapes(args.profile) | {"lm_head": (resolve_model(args.profile).hf_config.vocab_size,
                                                 shapes(args.profile)["o"][0])}
    tiles = list(dict.fromkeys([*map(parse_tiles, CANDIDATES), *candidates(args.tiles)]))
    names = [tile_name(t) for t in tiles]
    rows, same = [], {}
    ms = [int(m) for m in args.m.split(",")]
    for layer, (n, k) in layers.items():
        w = torch.randn(n, k, device=dev, dtype=dt) * 0.02
        x = torch.randn(max(ms), k, device=dev, dtype=dt)
        out = torch.empty(max(ms), n, device=dev, dtype=dt)
        first = tiled_linear(x, w, None, out.clone(), tiles[0])
        same[layer] = {nm: torch.equal(first, tiled_linear(x, w, None, out.clone(), t))
                       for nm, t in zip(names, tiles)}
        for m in ms:
            xm, om = x[:m], out[:m]
            flop = 2 * m * n * k
            r = {"layer": layer, "m": m, "n": n, "k": k,
                 "cublas_tflops": flop / event_ms(lambda: torch.nn.functional.linear(xm, w)) / 1e9}
            for nm, t in zip(names, tiles):
                r[f"{nm}_tflops"] = flop / event_ms(lambda: tiled_linear(xm, w, None, om, t)) / 1e9
            r["plan"] = tile_name(tiles_for(m, w, dt))
            r["plan_vs_cublas"] = r[f"{r['plan']}_tflops"] / r["cublas_tflops"]
            rows.append(r)
            print(json.dumps(r), flush=True)
    meta = {"gpu": torch.cuda.get_device_name(), "profile": args.profile,
            "tiles_same_bits_as_first": same,
            "tiles_kept": [tile_name(t) for t in kept_tiles(dev, dt)]}
    print(json.dumps(meta))
    print_table(f"the invariant GEMM against cuBLAS on {meta['gpu']} (TFLOP/s)", rows,
                ["layer", "m", "cublas_tflops", *[f"{nm}_tflops" for nm in names], "plan",
                 "plan_vs_cublas"])
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
