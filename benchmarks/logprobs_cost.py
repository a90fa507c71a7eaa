"""What log-probabilities cost: workload (a) of BENCHMARKS.md on one engine, without them, with
``logprobs`` on every request or on 1 in 8, and prompt scoring (``prompt_logprobs``, no output).

Runs are interleaved over ``--repeats`` rounds (median reported), greedy with EOS ignored; the
greedy tokens must not change when log-probabilities are asked for.

    python -m benchmarks.logprobs_cost --backend flash-attn --json out.json
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from benchmarks.common import build_engine, median_run, print_table, profile_configs, timed_runs
from benchmarks.workloads import workload

KEYS = ("wall_time_s", "output_tokens_per_s", "prefill_tokens_per_s", "total_tokens_per_s",
        "prompt_tokens", "output_tokens")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="llama-3-8b")
    ap.add_argument("--backend", default="flash-attn")
    ap.add_argument("--device", default=None)
    ap.add_argument("--workload", default="a", help="a workload of workloads.py")
    ap.add_argument("--num-prompts", type=int, default=None, help="fewer prompts (CPU runs)")
    ap.add_argument("--max-tokens", type=int, default=None, help="fewer output tokens")
    ap.add_argument("--k", type=int, default=5, help="top alternatives per token")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    overrides = dict(backend=args.backend) | ({"device": args.device} if args.device else {})
    cfg, base = profile_configs(args.profile, **overrides)
    engine, load_s = build_engine(cfg)
    wl = workload(args.workload)
    prompts, outs = wl.requests(engine.src.hf_config.vocab_size)
    prompts = prompts[:args.num_prompts]
    outs = [min(o, args.max_tokens or o) for o in outs[:len(prompts)]]
    greedy = replace(base, temperature=0.0, ignore_eos=True)
    cases = {
        "no logprobs": [replace(greedy, max_tokens=o) for o in outs],
        f"logprobs={args.k}, every request": [replace(greedy, max_tokens=o, logprobs=args.k)
                                              for o in outs],
        f"logprobs={args.k}, 1 in 8": [replace(greedy, max_tokens=o,
                                               logprobs=args.k if i % 8 == 0 else None)
                                       for i, o in enumerate(outs)],
        "prompt_logprobs=1, max_tokens 0 (scoring)": [
            replace(greedy, max_tokens=0, prompt_logprobs=1) for _ in outs],
    }
    runs: dict[str, list] = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, params in cases.items():
            runs[name] += timed_runs(engine, prompts, params, load_s=load_s)
    rows = []
    for name, rs in runs.items():
        mid = median_run(rs)
        rows.append({"case": name, **{k: mid[k] for k in KEYS},
                     "runs_output_tokens_per_s": mid["runs_output_tokens_per_s"],
                     "outputs_digest": mid["outputs_digest"]})
    digests = {r["outputs_digest"] for r in rows[:3]}
    base_tps = rows[0]["output_tokens_per_s"]
    for r in rows[:3]:
        r["vs_no_logprobs"] = r["output_tokens_per_s"] / base_tps
    print_table(f"log-probabilities on workload ({args.workload}), {cfg.model}, "
                f"{engine.backend_name}, median of {args.repeats}",
                rows, ["case", "wall_time_s", "output_tokens_per_s", "vs_no_logprobs",
                       "prefill_tokens_per_s", "total_tokens_per_s"])
    print(f"greedy tokens unchanged by logprobs: {len(digests) == 1}")
    if args.json:
        for r in rows:
            r.pop("outputs_digest")
        args.json.write_text(json.dumps({"backend": engine.backend_name,
                                         "profile": args.profile, "rows": rows,
                                         "greedy_tokens_unchanged": len(digests) == 1},
                                        indent=2))


if __name__ == "__main__":
    main()
