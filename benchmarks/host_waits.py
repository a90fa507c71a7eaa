"""Where a decode step's host time goes, and how long the GPU sits idle (issue 8's gap).

Runs a decode-heavy workload (``--batch`` prompts of ``--context`` tokens) to steady decode,
then profiles ``--steps`` decode steps with torch.profiler: prints the host calls that wait on
the device (synchronizations, blocking copies, ``.item()``), the busiest host operators, and
the fraction of the wall time the GPU ran kernels.

    python -m benchmarks.host_waits --backend triton --batch 64 --context 2048
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import profile_configs, random_prompts
from pagedgen.runtime.engine.engine import Engine

WAITS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize",
         "cudaMemcpy", "aten::_local_scalar_dense", "cudaHostAlloc")


def busy_fraction(events, t0_us: float, t1_us: float) -> float:
    """Union of GPU kernel intervals inside [t0, t1], over t1 - t0."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == torch.autograd.DeviceType.CUDA
                   and t0_us <= e.time_range.start <= t1_us)
    busy, end = 0.0, t0_us
    for s, e in spans:
        if e > end:
            busy += e - max(s, end)
            end = e
    return busy / (t1_us - t0_us)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="llama-3-8b")
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--sync", action="store_true", help="without async scheduling")
    args = ap.parse_args()
    cfg, sampling = profile_configs(args.profile, backend=args.backend, max_num_seqs=args.batch,
                                    async_scheduling=not args.sync)
    engine = Engine(cfg)
    params = replace(sampling, max_tokens=10 * args.steps, temperature=0.0, ignore_eos=True)
    for p in random_prompts(args.batch, args.context, args.context,
                            vocab=engine.src.hf_config.vocab_size):
        engine.add_request(p, params)
    while engine.scheduler.waiting or any(s.num_uncomputed > 1 for s in engine.scheduler.running):
        engine.step()
    for _ in range(5):  # steady decode
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        wall = time.perf_counter() - t0
    events = prof.events()
    starts = [e.time_range.start for e in events]
    lo = min(starts)
    print(f"{args.backend}, batch {args.batch} x {args.context}, async "
          f"{'off' if args.sync else 'on'}: {1000 * wall / args.steps:.2f} ms per decode step; "
          f"GPU busy {busy_fraction(events, lo, lo + wall * 1e6):.0%} of the wall time")
    table = prof.key_averages()
    print("host calls that wait on the device (total ms over the profiled steps):")
    for a in sorted(table, key=lambda a: -a.cpu_time_total):
        if any(a.key.startswith(w) for w in WAITS):
            print(f"  {a.key:40s} {a.count:6d} calls {a.cpu_time_total / 1000:9.2f} ms")
    print(table.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=50))


if __name__ == "__main__":
    main()
