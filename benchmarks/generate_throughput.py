"""`pagedgen generate` throughput, several configurations in one run (issue 3).

Default workload: the Llama-3-8B-shaped dummy model (profiles/llama-3-8b.yaml), 256 prompts of
random lengths 128-1024 tokens, 256 output tokens each (EOS ignored, greedy):

    python -m benchmarks.generate_throughput --json out.json
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from benchmarks.common import print_table, profile_configs, random_prompts, run_engine

CONFIGS = {
    "flashinfer+graphs": dict(backend="flashinfer"),
    "flashinfer+graphs/host-built-metadata": dict(backend="flashinfer",
                                                  advance_decode_on_device=False),
    "flashinfer/no-graphs": dict(backend="flashinfer", enforce_eager=True),
    "flash-attn+graphs": dict(backend="flash-attn"),
    "triton+graphs": dict(backend="triton"),
    "sdpa": dict(backend="sdpa", enforce_eager=True),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--profile", default="llama-3-8b")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    base, sampling = profile_configs(args.profile)
    params = replace(sampling, max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(args.num_prompts, args.min_len, args.max_len, vocab=256)
    rows = []
    for name in args.configs.split(","):
        res = run_engine(replace(base, **CONFIGS[name]), prompts, params)[0]
        res["config"] = name
        rows.append(res)
        print(json.dumps(res), flush=True)
    print_table(f"{args.profile}: {args.num_prompts} prompts x {args.min_len}-{args.max_len} "
                f"in, {args.output_len} out", rows,
                ["config", "output_tokens_per_s", "total_tokens_per_s", "prefill_tokens_per_s",
                 "decode_tokens_per_s", "decode_host_ms_per_step", "wall_time_s",
                 "graph_capture_s", "graph_memory_bytes", "peak_memory_bytes"])
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
