"""The float32 dense GEMM on this CPU: oneDNN's inner product against torch's F.linear (MKL's
sgemm), first per weight shape with the weights streamed from memory as a decode step reads
them, then a whole greedy run of a model both ways (its engine, 12-token prompts; the same
tokens required).

    python -m benchmarks.dense_gemm --model smollm2-135m --json out.json
    python -m benchmarks.dense_gemm --model tiny --min-weight 131072   # a gate below ours
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedgen.runtime.config import EngineConfig, SamplingParams
from pagedgen.runtime.engine.engine import Engine
from pagedgen.runtime.quantization import dense_gemm

SHAPES = {  # each model's [out, in]: LM head, gate/up, down, q/k/v (and o where it differs)
    "smollm2-135m": ((49152, 576), (3072, 576), (576, 1536), (960, 576)),
    "tiny": ((384, 256), (1376, 256), (256, 688), (512, 256), (256, 256)),
}


def stream_ms(fn, shape: tuple[int, int], rows: int, copies: int = 30, reps: int = 3) -> float:
    """Milliseconds for ``fn(x, w)`` over ``copies`` weights of ``shape`` in turn (more bytes
    than the caches hold, as a model's layers), a mean per weight."""
    ws = [torch.randn(shape) for _ in range(copies)] if shape[0] < 10_000 else \
        [torch.randn(shape) for _ in range(3)]
    x = torch.randn(rows, shape[1])
    for w in ws:
        fn(x, w)
    t = time.perf_counter()
    for _ in range(reps):
        for w in ws:
            fn(x, w)
    return (time.perf_counter() - t) / (reps * len(ws)) * 1e3


def run(model: str, prompts: int, tokens: int, onednn: bool, min_weight: int
        ) -> tuple[float, list[list[int]]]:
    """Output tokens/s of a greedy run, and its tokens (oneDNN from ``min_weight`` elements,
    or not at all)."""
    real, gate = dense_gemm.onednn_pays, dense_gemm.MIN_WEIGHT
    dense_gemm.onednn_pays = (lambda: True) if onednn else (lambda: False)
    dense_gemm.MIN_WEIGHT = min_weight
    try:
        engine = Engine(EngineConfig(model=model, device="cpu"))
        first = 1000 if engine.src.hf_config.vocab_size > 2000 else 30  # in its vocabulary
        ids = [[first + 7 * i + j for j in range(12)] for i in range(prompts)]
        engine.generate(ids, SamplingParams(max_tokens=4, temperature=0.0))
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        t = time.perf_counter()
        seqs = engine.generate(ids, params)
        dt = time.perf_counter() - t
    finally:
        dense_gemm.onednn_pays, dense_gemm.MIN_WEIGHT = real, gate
    return prompts * tokens / dt, [s.output_token_ids for s in seqs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--min-weight", type=int, default=dense_gemm.MIN_WEIGHT,
                    help="the oneDNN run's size gate, in weight elements (default: ours)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    onednn = dense_gemm.onednn_linear
    out = {"cpu": dense_gemm.cpu_vendor(), "threads": torch.get_num_threads(),
           "chosen_here": dense_gemm.onednn_pays(), "shapes": []}
    with torch.inference_mode():
        for shape in SHAPES[args.model]:
            for rows in (1, 16, 64):
                mkl = stream_ms(lambda x, w: F.linear(x, w), shape, rows)
                dnn = stream_ms(lambda x, w: onednn(x, w, None), shape, rows)
                out["shapes"].append({"shape": shape, "rows": rows, "f_linear_ms": mkl,
                                      "onednn_ms": dnn, "speedup": mkl / dnn})
                print(f"{shape} × {rows:3d} rows: F.linear {mkl:7.3f} ms, oneDNN {dnn:7.3f} ms,"
                      f" {mkl / dnn:4.2f}x")
    off, toks_off = run(args.model, args.prompts, args.tokens, False, args.min_weight)
    on, toks_on = run(args.model, args.prompts, args.tokens, True, args.min_weight)
    out |= {"model": args.model, "min_weight": args.min_weight, "f_linear_tok_s": off,
            "onednn_tok_s": on, "speedup": on / off, "same_tokens": toks_on == toks_off}
    print(f"{args.model}, {args.prompts} × {args.tokens} tokens: F.linear {off:.1f} tok/s, "
          f"oneDNN from {args.min_weight:,} elements {on:.1f} tok/s, {on / off:.2f}x; "
          f"same tokens: {toks_on == toks_off}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
