"""`pagedgen generate --ray local --replicas N` and `-dp N` against one GPU on a workload of
workloads.py, each as the whole command a user runs (start-up included), and how many output
lines agree with the one-GPU run.

    python -m benchmarks.ray_replicas --workload a --backend triton --replicas 2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.workloads import workload
from pagedgen.runtime.models.loader import resolve_model


def write_workload(name: str, path: Path, profile: str, num: int | None,
                   max_tokens: int | None, repeat: int = 1) -> int:
    prompts, outs = workload(name).requests(resolve_model(profile).hf_config.vocab_size)
    prompts, outs = prompts[:num], [min(o, max_tokens or o) for o in outs[:num]]
    prompts, outs = prompts * repeat, outs * repeat
    with path.open("w") as f:
        for i, (p, n) in enumerate(zip(prompts, outs)):
            f.write(json.dumps({"id": i, "prompt_token_ids": p, "max_tokens": n,
                                "ignore_eos": True, "temperature": 0}) + "\n")
    return len(prompts)


def run(args: list[str]) -> dict:
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", "from pagedgen.cli.main import main; main()",
                          "generate", *args, "--json"], capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(res.stderr[-3000:])
    summary = json.loads(res.stdout[res.stdout.index("{"):])
    summary["command_s"] = time.perf_counter() - t0
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workload", default="a")
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/ray-bench"))
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--profile", default=None, help="another model shape (CPU smoke runs)")
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--repeat", type=int, default=1, help="the workload's requests K times over")
    ap.add_argument("--no-ray", action="store_true", help="one GPU and -dp only")
    args = ap.parse_args()
    profile = args.profile or workload(args.workload).profile
    args.dir.mkdir(parents=True, exist_ok=True)
    src = args.dir / "prompts.jsonl"
    n = write_workload(args.workload, src, profile, args.num_prompts, args.max_tokens,
                       args.repeat)
    warm = args.dir / "warm.jsonl"
    write_workload(args.workload, warm, profile, 16, 16)
    opts = ["--profile", profile, "--backend", args.backend,
            *(["--device", args.device] if args.device else [])]
    base = [str(src), *opts]
    rows = {}
    # a short run first: the kernel caches on disk are warm for every run after it
    run([str(warm), *opts, "-o", str(args.dir / "warm.out.jsonl")])
    rows["one GPU"] = run([*base, "-o", str(args.dir / "one2.jsonl")])
    rows[f"-dp {args.replicas}"] = run([*base, "-o", str(args.dir / "dp.jsonl"), "-dp",
                                        str(args.replicas)])
    if not args.no_ray:
        rows[f"ray, {args.replicas} replicas"] = run(
            [*base, "-o", str(args.dir / "ray.jsonl"), "--ray", "local",
             "--replicas", str(args.replicas)])
    one = (args.dir / "one2.jsonl").read_text().splitlines()
    dp = (args.dir / "dp.jsonl").read_text().splitlines()
    same_dp = sum(a == b for a, b in zip(one, dp))
    same = None
    if not args.no_ray:
        ray = (args.dir / "ray.jsonl").read_text().splitlines()
        same = sum(a == b for a, b in zip(one, ray))
    for name, r in rows.items():
        print(f"{name:>22}: {r['output_tokens_per_s']:>9,.0f} output tok/s, run "
              f"{r['wall_time_s']:.2f} s, whole command {r['command_s']:.1f} s")
        for k in sorted(k for k in r if k.startswith("replica_")):
            print(f"{'':>24}{r[k]}")
    print(f"{n} requests; output lines identical to the one-GPU run: ray {same}, -dp "
          f"{same_dp} of {len(one)} (greedy bf16: a batch of another size may flip a near tie)")
    if args.json:
        args.json.write_text(json.dumps({"workload": args.workload, "backend": args.backend,
                                         "runs": rows, "identical_lines": same,
                                         "identical_lines_dp": same_dp,
                                         "requests": n}, indent=2))


if __name__ == "__main__":
    main()
