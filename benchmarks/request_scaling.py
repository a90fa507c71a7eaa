"""Requests/s and peak host memory of `pagedgen generate` as the request count grows (issue 18).

Each size runs as its own `pagedgen generate` process over a generated JSONL file of short
one-token requests (tiny preset by default), so per-request host cost (reading, tokenizing,
scheduling, writing) is what the figure shows; the model's work per request is the same at
every size. A loop whose cost grows with the queue shows as a falling ratio.

    python -m benchmarks.request_scaling --sizes 1000,10000,100000,1000000 --device cpu
    python -m benchmarks.request_scaling --device cuda \
        --json benchmarks/results/h100-request-scaling.json

Columns: requests/s over the generation phase (the summary's wall time), the ratio to the
smallest size, start-up (reading + validating + tokenizing the file; model load), the whole
command's wall time, and the process's peak resident memory (``wait4``'s ru_maxrss).

``--chunks 1000`` measures a GPU workload instead (workload r of workloads.py: Llama-3-8B
shape, random 64-256 prompt tokens, 16 output tokens; ``--num-prompts``): all requests queued at
once on one engine, against the same requests cut into chunks of 1,000 run one after another on
that engine (files of 1,000 lines, without each file's start-up), and vLLM given all of them in
one ``LLM.generate`` call (``--vllm``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import print_table


def write_prompts(path: Path, n: int, max_tokens: int) -> None:
    """``n`` text prompts of 8 bytes (byte tokenizer: 9 tokens; the same at every size)."""
    with path.open("w") as f:
        for i in range(n):
            f.write(f'{{"id": "r{i}", "prompt": "{i:08d}", "max_tokens": {max_tokens}}}\n')


def run_one(prompts: Path, out: Path, extra: list[str]) -> dict:
    """One `pagedgen generate` process; its summary, wall time and resource usage."""
    cmd = [sys.executable, "-m", "pagedgen.cli.main", "generate", str(prompts), "-o", str(out),
           "--json", *extra]
    log = out.with_suffix(".log")
    t0 = time.perf_counter()
    with log.open("wb") as err, out.with_suffix(".summary").open("wb") as summary:
        proc = subprocess.Popen(cmd, stdout=summary, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak memory
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{log.read_text()[-2000:]}")
    text = out.with_suffix(".summary").read_text()
    return {"command_s": wall, "summary": json.loads(text[text.index("{"):]), "usage": usage}


def check_order(out: Path, n: int) -> None:
    with out.open() as f:
        for i, line in enumerate(f):
            if not line.startswith(f'{{"id": "r{i}"'):
                sys.exit(f"{out}:{i + 1}: expected id r{i}")
    if i + 1 != n:
        sys.exit(f"{out}: {i + 1} lines, expected {n}")


def compare_chunks(num_prompts: int, chunk: int, backend: str, vllm: bool,
                   peer_only: bool = False) -> list[dict]:
    """Output tok/s of one queue of ``num_prompts`` requests vs chunks of ``chunk``."""
    from common import profile_configs
    from vllm_peer import run_vllm
    from workloads import workload

    from pagedgen.runtime.models.loader import resolve_model

    wl = workload("r", num_prompts)
    cfg, sampling = profile_configs(wl.profile, backend=backend)
    cfg = cfg.with_step_limits()
    rows = []
    if not peer_only:
        rows += _pagedgen_chunks(wl, cfg, sampling, chunk)
    if vllm:
        res = run_vllm("r", num_prompts, resolve_model(wl.profile).hf_config,
                       dict(max_num_seqs=cfg.max_num_seqs,
                            max_num_batched_tokens=cfg.max_num_batched_tokens), repeats=1)
        if "skipped" in res:
            print(f"vLLM: {res['skipped']}", flush=True)
        else:
            r = res["runs"][0]
            rows.append({"system": f"vLLM {res['vllm']}, one generate call",
                         "requests": num_prompts, **r, "load_time_s": res["startup_s"]})
            print(json.dumps(rows[-1]), flush=True)
    for r in rows:
        r["vs_queued"] = r["output_tokens_per_s"] / rows[0]["output_tokens_per_s"]
    return rows


def _pagedgen_chunks(wl, cfg, sampling, chunk: int) -> list[dict]:
    from dataclasses import replace

    from common import build_engine, free_gpu

    engine, load_s = build_engine(cfg)
    prompts, outs = wl.requests(engine.src.hf_config.vocab_size)
    params = [replace(sampling, max_tokens=n, temperature=0.0, ignore_eos=True) for n in outs]
    items = [(p, sp, None, i) for i, (p, sp) in enumerate(zip(prompts, params))]
    engine.add_requests(items[:2 * cfg.max_num_seqs])  # warm-up, not timed
    engine.run()
    rows = []
    n = wl.num_prompts
    for label, parts in ((f"pagedgen {cfg.backend}, {n:,} queued", [items]),
                         (f"pagedgen {cfg.backend}, {n // chunk} x {chunk:,}",
                          [items[i:i + chunk] for i in range(0, len(items), chunk)])):
        engine.reset_prefix_cache()
        before = engine.stats.output_tokens
        t = time.perf_counter()
        for part in parts:
            engine.add_requests(part)  # lazily, as `pagedgen generate` queues a file
            engine.run()
        wall = time.perf_counter() - t
        tokens = engine.stats.output_tokens - before
        rows.append({"system": label, "requests": n, "wall_time_s": wall,
                     "output_tokens": tokens, "output_tokens_per_s": tokens / wall,
                     "load_time_s": load_s})
        print(json.dumps(rows[-1]), flush=True)
    del engine
    free_gpu()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1000,10000,100000,1000000")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--workdir", type=Path, help="where the files go [default: a temp dir]")
    ap.add_argument("--chunks", type=int, help="GPU mode: chunks of this many requests")
    ap.add_argument("--num-prompts", type=int, default=100_000)
    ap.add_argument("--backend", help="[default: auto; flash-attn with --chunks]")
    ap.add_argument("--vllm", action="store_true")
    ap.add_argument("--peer-only", action="store_true", help="with --chunks: vLLM alone")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.chunks:
        rows = compare_chunks(args.num_prompts, args.chunks, args.backend or "flash-attn",
                              args.vllm, args.peer_only)
        if args.json:
            args.json.write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows},
                                            indent=2))
        print_table("one queue vs chunks", rows, ["system", "requests", "output_tokens_per_s",
                                                  "vs_queued", "wall_time_s", "load_time_s"])
        return
    extra = ["--device", args.device, "--model", args.model, "--max-num-seqs",
             str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
             "--backend", args.backend or "auto"]
    rows = []
    meta = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
            "python": sys.version.split()[0]}
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        for n in (int(s) for s in args.sizes.split(",")):
            prompts, out = Path(tmp) / f"p{n}.jsonl", Path(tmp) / f"o{n}.jsonl"
            write_prompts(prompts, n, args.max_tokens)
            res = run_one(prompts, out, extra)
            check_order(out, n)
            s = res["summary"]
            row = {"requests": n, "requests_per_s": n / s["wall_time_s"],
                   "input_time_s": s["input_time_s"], "load_time_s": s["load_time_s"],
                   "wall_time_s": s["wall_time_s"], "command_s": res["command_s"],
                   "peak_rss_bytes": res["usage"].ru_maxrss * 1024, "steps": s["steps"],
                   "device": s["device"]}
            first = rows[0] if rows else row
            row["vs_smallest"] = row["requests_per_s"] / first["requests_per_s"]
            print(json.dumps(row), flush=True)
            rows.append(row)
            prompts.unlink()
            out.unlink()
            if args.json:
                args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print_table(f"request scaling ({args.model}, {args.device}, {args.max_tokens} output token)",
                rows, ["requests", "requests_per_s", "vs_smallest", "input_time_s",
                       "load_time_s", "wall_time_s", "command_s", "peak_rss_bytes"])


if __name__ == "__main__":
    main()
