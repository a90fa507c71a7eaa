"""Decode-step time against the memory roofline (issue 3).

Batch B sequences with a context of C tokens on the Llama-3-8B-shaped dummy model: each decode
step reads every weight once plus every sequence's K/V (and, in a hybrid model, reads and
writes every sequence's linear-attention state), so its lower bound is
(weight bytes + KV bytes + state bytes) / measured copy bandwidth. Prints measured step time
and the fraction of that bound reached.

    python -m benchmarks.decode_roofline --batch 64 --context 2048
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace
from pathlib import Path

from benchmarks.common import profile_configs, random_prompts
from pagedgen.runtime.engine.engine import Engine
from pagedgen.runtime.hardware import copy_bandwidth


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--profile", default="llama-3-8b")
    ap.add_argument("--backend", default="flashinfer")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--no-fused-kernels", action="store_true",
                    help="norms, rotary and SwiGLU as torch ops (to measure the fused kernels)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    bw = copy_bandwidth()
    cfg, sampling = profile_configs(args.profile, backend=args.backend, max_num_seqs=args.batch,
                                    enforce_eager=args.enforce_eager,
                                    fused_kernels=not args.no_fused_kernels)
    engine = Engine(cfg)
    params = replace(sampling, max_tokens=args.steps + 1, temperature=0.0, ignore_eos=True)
    for p in random_prompts(args.batch, args.context, args.context, vocab=256):
        engine.add_request(p, params)
    times = []
    prof = None
    while engine.has_unfinished():
        if len(times) == 10 and prof is None:  # profile a few decode steps' kernels
            from torch.profiler import ProfilerActivity, profile
            prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            prof.__enter__()
        if len(times) == 15 and prof is not None and not getattr(prof, "_done", False):
            prof.__exit__(None, None, None)
            prof._done = True
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15,
                                            max_name_column_width=60))
        st = engine.stats
        n_before, t_before = st.decode_steps, st.decode_time
        engine.step()  # no syncs around it: async scheduling overlaps the host with the GPU
        if st.decode_steps > n_before:  # a decode-only step: its launch to its bookkeeping
            times.append(st.decode_time - t_before)
    times = times[3:]  # warm-up
    step = statistics.median(times)
    m = engine.measurement()
    figures = m.figures()
    # linear-attention layers: each sequence's state read and written
    least = m.decode_bytes(args.batch, args.context + args.steps // 2)
    weight_bytes = m.decode_bytes(1, 0)["weights"]  # as one token's forward reads them
    kv_bytes, state_bytes = least["kv"], least["state"]
    bound = (weight_bytes + kv_bytes + state_bytes) / bw
    res = {"backend": figures["backend"], "cuda_graphs": figures["cuda_graphs"],
           "fused_kernels": figures["fused_kernels"], "batch": args.batch,
           "context": args.context, "step_ms": step * 1000, "step_ms_p90": 1000 * sorted(times)[
               int(0.9 * (len(times) - 1))], "weight_gb": weight_bytes / 1e9,
           "kv_gb": kv_bytes / 1e9, "state_gb": state_bytes / 1e9,
           "copy_bw_tb_s": bw / 1e12, "roofline_ms": bound * 1000,
           "roofline_fraction": bound / step,
           "decode_host_ms": m.host_ms_per_step("decode")}
    print(json.dumps(res, indent=2))
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
