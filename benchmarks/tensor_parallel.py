"""Tensor parallel against one GPU, as the commands a user runs, for each model and
tensor-parallel size asked for:

- the decode step at batch 1 and 64 as `pagedgen profile` times it (synchronous steps, host
  work included; against the memory roofline, all-reduce time as its own kernel group);
- the decode step in a real run (`pagedgen generate` of that many 1,024-token prompts, async
  scheduling: decode-only steps' time per step);
- workload (a) of workloads.py (`pagedgen generate`, whole command timed);
- with ``--vllm``, vLLM at its defaults with ``tensor_parallel_size`` = the run's (its
  multicast-dependent paths off: ``vllm_peer.TP_SAFE``, recorded in the result) on the same
  requests: each batch's decode run and the workload, output tokens over wall time in both.

    python -m benchmarks.tensor_parallel --backend flash-attn --runs llama-3-8b:1,llama-3-8b:2 \
        --vllm --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.replicas import run, write_workload

EXTRA: list[str] = []  # more options for every pagedgen command (--quantization fp8)


def profile(model: str, tp: int, backend: str, out: Path, batches: str) -> dict:
    """The decode step per batch size from `pagedgen profile` (median of its timed steps)."""
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", "from pagedgen.cli.main import main; main()",
                          "profile", "--model", model, "--backend", backend, "-tp", str(tp),
                          "--batch-sizes", batches, "--output-len", "48",
                          "--measured-steps", "24", "--output-dir", str(out), *EXTRA],
                         capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(res.stderr[-3000:])
    r = json.loads((out / "profile.json").read_text())["results"][0]
    dec = r["phases"]["decode"]
    return {"command_s": time.perf_counter() - t0,
            "batches": [{k: b[k] for k in ("batch", "step_ms_p50", "step_ms_p90",
                                          "decode_roofline_ms", "decode_roofline_fraction")
                         if k in b} for b in r["batches"]],
            "kernel_batch": r["kernel_batch"],
            "decode_groups_us_per_step": {g: us / r["decode_steps"]
                                          for g, us in dec["groups_us"].items() if us}}


def decode_run(model: str, tp: int, backend: str, out: Path, batch: int, tokens: int) -> dict:
    """`pagedgen generate` of ``batch`` random 1,024-token prompts, ``tokens`` out each."""
    import random

    rng = random.Random(batch)
    src = out / f"decode-{batch}.jsonl"
    with src.open("w") as f:
        for i in range(batch):
            f.write(json.dumps({"id": i, "prompt_token_ids": [rng.randrange(256) for _ in
                                                              range(1024)],
                                "max_tokens": tokens, "ignore_eos": True,
                                "temperature": 0}) + "\n")
    s = run([str(src), "--model", model, "--backend", backend, "-tp", str(tp), *EXTRA,
             "-o", str(out / f"decode-{batch}-{model}-{tp}.out.jsonl")])
    return {"batch": batch, "output_tokens": tokens,
            "decode_step_ms": 1000 * batch / s["decode_tokens_per_s"],
            "decode_tokens_per_s": s["decode_tokens_per_s"],
            "output_tokens_per_s": s["output_tokens_per_s"],
            "all_reduce": s.get("all_reduce")}


def vllm_runs(model: str, tp: int, batches: list[int], workload_name: str,
              quantization: str | None = None) -> dict:
    """vLLM at its defaults (``TP_SAFE`` under TP) on each batch's decode run (1,024-token
    prompts, as ``decode_run``: other random ids, the same shape) and on the workload."""
    from benchmarks.vllm_peer import TP_SAFE, run_vllm
    from pagedgen.runtime.models.loader import resolve_model

    hf = resolve_model(model).hf_config
    engine = {"tensor_parallel_size": tp, **(TP_SAFE if tp > 1 else {}),
              **({"quantization": quantization} if quantization else {})}
    decodes = [{"num_prompts": b, "input_len": [1024, 1024],
                "output_len": [512 if b == 1 else 256] * 2} for b in batches]
    res = run_vllm([*decodes, workload_name], None, hf, engine, repeats=2)  # one start-up
    out: dict = {"engine": engine, "decode": [], "generate": None}
    if "skipped" in res:
        out["skipped"] = res["skipped"]
        out["log"] = res.get("log", "")
        print(f"vLLM {model} tp {tp}: {res['skipped']}", flush=True)
        return out
    for b, _d in zip(batches, decodes):
        out["decode"].append({"batch": b, **_best(res, f"{b} prompts")})
        print(f"vLLM {model} tp {tp}: batch {b}: {out['decode'][-1]}", flush=True)
    out["generate"] = _best(res, workload_name)
    print(f"vLLM {model} tp {tp}: workload ({workload_name}): {out['generate']}", flush=True)
    return out


def _best(res: dict, label: str) -> dict:
    """The best of the repeated runs of one workload (each system's run at its fastest)."""
    runs = [r for r in res["runs"] if r["workload"] == label]
    return {"vllm": res["vllm"], "startup_s": res["startup_s"],
            "output_tokens_per_s": max(r["output_tokens_per_s"] for r in runs),
            "runs_output_tokens_per_s": [r["output_tokens_per_s"] for r in runs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--backend", default="flash-attn")
    ap.add_argument("--runs", default="llama-3-8b:1,llama-3-8b:2",
                    help="MODEL:TP pairs, comma-separated")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--workload", default="a")
    ap.add_argument("--all-reduce", default=None, choices=["push", "one-shot", "nccl"],
                    help="the all-reduce kind (sets PAGEDGEN_ALL_REDUCE)")
    ap.add_argument("--unfused", action="store_true",
                    help="the norm after an all-reduce as its own kernel "
                         "(PAGEDGEN_FUSED_ALL_REDUCE=0)")
    ap.add_argument("--skip", default="",
                    help="any of 'profile', 'decode', 'generate' to leave out")
    ap.add_argument("--quantization", default=None, choices=["fp8"],
                    help="FP8 weights in every run (pagedgen -q fp8, vLLM quantization='fp8')")
    ap.add_argument("--expert-parallel", action="store_true",
                    help="MoE experts split whole over the ranks (pagedgen -ep)")
    ap.add_argument("--vllm", action="store_true",
                    help="also vLLM at each run's tensor-parallel size (its defaults)")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/tp-bench"))
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.quantization:
        EXTRA.extend(["--quantization", args.quantization])
    if args.expert_parallel:
        EXTRA.append("--expert-parallel")
    if args.all_reduce:
        os.environ["PAGEDGEN_ALL_REDUCE"] = args.all_reduce  # the commands inherit it
    if args.unfused:
        os.environ["PAGEDGEN_FUSED_ALL_REDUCE"] = "0"
    args.dir.mkdir(parents=True, exist_ok=True)
    results = {}
    for spec in args.runs.split(","):
        model, tp = spec.rsplit(":", 1)
        row: dict = {}
        if "profile" not in args.skip:  # one profile per batch size: each its kernel table
            row["profile"] = [profile(model, int(tp), args.backend,
                                      args.dir / f"prof-{model}-{tp}-{b}", b)
                              for b in args.batches.split(",")]
            for p in row["profile"]:
                b = p["batches"][0]
                print(f"{model} -tp {tp}: decode step at batch {b['batch']}: "
                      f"{b['step_ms_p50']:.2f} ms (roofline {b.get('decode_roofline_ms', 0):.2f}"
                      f" ms, {b.get('decode_roofline_fraction', 0):.0%}); kernels per step: "
                      + ", ".join(f"{g} {us / 1000:.2f}" for g, us in
                                  p["decode_groups_us_per_step"].items()), flush=True)
        if "decode" not in args.skip:
            row["decode"] = [decode_run(model, int(tp), args.backend, args.dir, int(b),
                                        512 if int(b) == 1 else 256)
                             for b in args.batches.split(",")]
            for d in row["decode"]:
                print(f"{model} -tp {tp}: generate, decode step at batch {d['batch']}: "
                      f"{d['decode_step_ms']:.2f} ms, {d['output_tokens_per_s']:,.0f} output "
                      f"tok/s over the run ({d['all_reduce']})", flush=True)
        if "generate" not in args.skip:
            src = args.dir / f"{model}.jsonl"
            n = write_workload(args.workload, src, model, None, None)
            out = args.dir / f"out-{model}-{tp}.jsonl"
            s = run([str(src), "--model", model, "--backend", args.backend, "-tp", tp,
                     *EXTRA, "-o", str(out)])
            row["generate"] = s
            print(f"{model} -tp {tp}: workload ({args.workload}) {n} requests: "
                  f"{s['output_tokens_per_s']:,.0f} output tok/s, run {s['wall_time_s']:.2f} s, "
                  f"start-up {s.get('startup_s', 0):.1f} s, whole command {s['command_s']:.1f} s",
                  flush=True)
        if args.vllm:
            row["vllm"] = vllm_runs(model, int(tp), [int(b) for b in args.batches.split(",")],
                                    args.workload, args.quantization)
        results[spec] = row
        if args.json:  # after every run: a time limit keeps what was measured
            args.json.write_text(json.dumps({"backend": args.backend, "workload":
                                             args.workload, "runs": results}, indent=2))
    if args.json:
        args.json.write_text(json.dumps({"backend": args.backend, "workload": args.workload,
                                         "runs": results}, indent=2))


if __name__ == "__main__":
    main()
