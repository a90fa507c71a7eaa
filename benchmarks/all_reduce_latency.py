"""One tensor-parallel all-reduce, each kind pagedgen can take, timed on two GPUs: a CUDA graph
of 50 calls per kind and size (as decode steps replay them), its replays timed with CUDA
events; microseconds a call. Kinds: NCCL, PyTorch's one-shot kernel over symmetric memory,
pagedgen's push kernel (``fused_all_reduce``), and each followed by the residual add + RMSNorm
(the one-shot then the fused norm kernel, against the push kernel with the norm inside).

    python -m benchmarks.all_reduce_latency --rows 1,8,64,256 --hidden 4096
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

CALLS = 50


def _worker(rows_list: list[int], hidden: int, inbox):
    import torch
    import torch.distributed as dist

    from pagedgen.runtime.collectives import fused_all_reduce as far
    from pagedgen.runtime.collectives import parallel
    from pagedgen.runtime.layers.fused_ops import rms_norm_fused

    tp = parallel.current()
    dtype = torch.bfloat16
    tp.enable_one_shot(dtype, torch.device("cuda"))
    group = tp.group.group_name
    weight = torch.ones(hidden, device="cuda", dtype=dtype)

    def one_shot(x):
        part = tp.one_shot[:x.numel()]
        out = torch.empty_like(x)
        torch.ops.symm_mem.one_shot_all_reduce_out(part, "sum", group, out.view(-1))
        return out

    kinds = {
        "nccl": lambda x, r: dist.all_reduce(x, group=tp.group),
        "one-shot": lambda x, r: one_shot(x),
        "push": lambda x, r: far.push_all_reduce(tp.push, x),
        "one-shot + norm": lambda x, r: rms_norm_fused(one_shot(x), weight, 1e-6, r),
        "nccl + norm": lambda x, r: (dist.all_reduce(x, group=tp.group),
                                     rms_norm_fused(x, weight, 1e-6, r)),
        "push, norm fused": lambda x, r: far.push_all_reduce(tp.push, x, residual=r,
                                                             weight=weight, eps=1e-6),
    }
    result = {}
    for rows in rows_list:
        x = torch.randn(rows, hidden, device="cuda").to(dtype)
        r = torch.randn(rows, hidden, device="cuda").to(dtype)
        for name, call in kinds.items():
            for _ in range(3):  # compiled, warmed
                call(x.clone(), r)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(CALLS):
                    call(x, r)
            times = []
            for _ in range(12):
                dist.barrier(group=tp.group)
                torch.cuda.synchronize()
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1000 / CALLS)
            times.sort()
            result[f"{name} @ {rows} rows"] = times[len(times) // 2]
            del graph
    yield result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", default="1,8,64,256")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    from pagedgen.runtime.drivers.launch import Workers

    rows = [int(r) for r in args.rows.split(",")]
    with Workers(_worker, [(rows, args.hidden)], [[0, 1]], tp=2) as w:
        (result,) = [msg for _, msg in w.messages()]
    for name, us in result.items():
        print(f"all-reduce {name} x {args.hidden} bf16: {us:.1f} us a call", flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
