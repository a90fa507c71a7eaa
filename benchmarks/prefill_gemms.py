"""A hybrid Qwen3.5 model's prefill GEMMs alone on this GPU: each projection of one layer at a
prefill chunk's M through torch's bf16 GEMM (cuBLAS), its TFLOP/s against the measured matmul
rate, and the sum over a workload's prompt tokens (what the run's GEMM group cannot beat
through cuBLAS at these shapes).

    python -m benchmarks.prefill_gemms --profile qwen3.5-9b --m 16384 --tokens 611072
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from benchmarks.common import event_ms
from pagedgen.runtime.layers.linear import MergedProjections
from pagedgen.runtime.models.loader import resolve_model


def merged(*widths: int) -> int:
    """The rows of projections merged into one GEMM (as ``MergedProjections`` lays them out)."""
    return MergedProjections.layout(widths)[1]


def projections(c) -> list[tuple[str, int, int, int]]:
    """(name, N, K, layers) of every dense GEMM a prefill token meets in a Qwen3.5 model (as
    ``qwen3_next.py`` builds it, its projections merged as after loading)."""
    d = c.head_dim
    kinds = c.layer_types
    full, linear = kinds.count("full_attention"), kinds.count("linear_attention")
    key = c.linear_num_key_heads * c.linear_key_head_dim
    value = c.linear_num_value_heads * c.linear_value_head_dim
    rows = [("attn qkv+gate", 2 * c.num_attention_heads * d + 2 * c.num_key_value_heads * d,
             c.hidden_size, full),
            ("attn o", c.hidden_size, c.num_attention_heads * d, full),
            ("gdn in (qkvz | ba)", merged(2 * key + 2 * value, 2 * c.linear_num_value_heads),
             c.hidden_size, linear),
            ("gdn out", c.hidden_size, value, linear)]
    if getattr(c, "num_local_experts", 0):
        w = c.shared_expert_intermediate_size
        rows += [("router | shared gate | gate/up", merged(c.num_local_experts, 1, 2 * w),
                  c.hidden_size, len(kinds)), ("shared down", c.hidden_size, w, len(kinds))]
    else:
        rows += [("mlp gate_up", 2 * c.intermediate_size, c.hidden_size, len(kinds)),
                 ("mlp down", c.hidden_size, c.intermediate_size, len(kinds))]
    return rows


def time_gemm(m: int, n: int, k: int, calls: int = 20) -> float:
    """Mean µs of ``x @ w.T`` (bf16, random, four input sets rotated: ``common.event_ms``)."""
    xs = itertools.cycle([torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                          for _ in range(4)])
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    return 1000 * event_ms(lambda: torch.nn.functional.linear(next(xs), w), calls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="qwen3.5-9b")
    ap.add_argument("--m", type=int, default=16384)
    ap.add_argument("--tokens", type=int, default=0, help="a workload's prompt tokens")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    c = resolve_model(args.profile).hf_config
    peak = 2 * 8192 ** 3 / time_gemm(8192, 8192, 8192) / 1e6
    rows, total = [], 0.0
    for name, n, k, layers in projections(c):
        us = time_gemm(args.m, n, k)
        tflops = 2 * args.m * n * k / us / 1e6
        run_s = us * 1e-6 * layers * args.tokens / args.m
        total += run_s
        rows.append({"name": name, "M": args.m, "N": n, "K": k, "layers": layers, "us": us,
                     "tflops": tflops, "of_peak": tflops / peak, "run_s": run_s})
        print(json.dumps({k_: round(v, 3) if isinstance(v, float) else v
                          for k_, v in rows[-1].items()}))
    print(json.dumps({"profile": args.profile, "peak_tflops": round(peak), "tokens": args.tokens,
                      "gemm_run_s": round(total, 3)}))
    if args.json:
        args.json.write_text(json.dumps({"peak_tflops": peak, "rows": rows,
                                         "gemm_run_s": total}, indent=2))


if __name__ == "__main__":
    main()
