"""The gated delta rule's decode kernel alone (issue 60): ``gated_delta_kernel`` at decode
(one token a sequence) on Qwen3.5-9B's linear-attention shapes, replayed from a CUDA graph
(timed as ``moe_kernels`` times), for each value block and warp count it can launch with,
against the floor of reading and writing every sequence's state once (float32 states, as
Qwen3.5's configs name, and bf16). The launch ``scan_triton`` uses is marked.

    python -m benchmarks.gdn_kernels [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.moe_kernels import _replay_ms

HK, HV, DK, DV = 16, 32, 128, 128  # Qwen3.5-9B: key heads, value heads, their widths


def rows(seqs: tuple[int, ...] = (256, 64)) -> list[dict]:
    from pagedgen.attention.recurrent import triton_kernels as tk
    from pagedgen.attention.recurrent.gated_delta import DECODE_LAUNCH
    from pagedgen.runtime.hardware import copy_bandwidth

    bw, dev, out_rows = copy_bandwidth(), "cuda", []
    for n in seqs:
        qkv = torch.randn(n, 2 * HK * DK + HV * DV, device=dev, dtype=torch.bfloat16)
        a, b = (torch.randn(n, HV, device=dev, dtype=torch.bfloat16) for _ in range(2))
        a_log, dt_bias = torch.randn(HV, device=dev), torch.randn(HV, device=dev)
        slots = torch.arange(n, device=dev, dtype=torch.int32)
        has = torch.ones(n, device=dev, dtype=torch.int32)
        qsl = torch.arange(n + 1, device=dev, dtype=torch.int32)
        out = torch.empty(n, HV * DV, device=dev, dtype=torch.bfloat16)
        for state_dtype in (torch.float32, torch.bfloat16):
            ssm = torch.randn(n, HV, DK, DV, device=dev, dtype=state_dtype) * 0.1
            floor_us = 2 * ssm.numel() * ssm.element_size() / bw * 1e6
            for bv in (16, 32, 64):
                for warps in (1, 2, 4, 8):
                    def launch():
                        tk.gated_delta_kernel[(n, HV, DV // bv)](
                            qkv, qkv.stride(0), a, b, a.stride(0), a_log, dt_bias, ssm, slots,
                            has, qsl, out, out.stride(0), HK, HV, DK ** -0.5, DK=DK, DV=DV,
                            BK=DK, BV=bv, num_warps=warps)
                    t = 1000 * _replay_ms(launch, calls=10)
                    row = {"seqs": n, "state": str(state_dtype).split(".")[-1], "block_v": bv,
                           "warps": warps, "us": round(t, 1), "floor_us": round(floor_us, 1),
                           "of_floor": round(floor_us / t, 3),
                           "used": (bv, warps) == DECODE_LAUNCH}
                    out_rows.append(row)
                    print(json.dumps(row), flush=True)
    return out_rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    result = rows()
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": result}, indent=1))


if __name__ == "__main__":
    main()
