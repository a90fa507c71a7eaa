"""KV reuse on the GPU (issue 13): prefix caching and parallel sampling, against the same work
without reuse, and against vLLM.

Parts (``--parts``, workloads in workloads.py):
  d  shared prefix: 512 x (1,536 shared + 128 unique) tokens x 128 out; pagedgen per backend
     with prefix caching on (``--repeats``), on without cascade decode
     (``--no-cascade-repeats``) and off (``--off-repeats``); vLLM with its prefix caching on
     (``--vllm``)
  p  parallel sampling: 128 x 1,024 tokens, n = 8, 256 out, temperature 1; against the same
     1,024 samples sent as independent requests (each with its sample's derived seed), with
     prefix caching off and on. Output tok/s and the most KV blocks in use
  a  workload (a) with prefix caching on and off, runs interleaved (hashing must cost nothing)

Every pagedgen figure comes from one engine per backend (start-up apart); each run starts with
a cold prefix cache. Greedy runs check that caching does not change a token.

    python -m benchmarks.kv_reuse --parts d,p,a --backends flash-attn --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    build_engine,
    free_gpu,
    median_run,
    print_table,
    profile_configs,
    timed_runs,
)
from benchmarks.vllm_peer import run_vllm, same_limits
from benchmarks.workloads import workload
from pagedgen.runtime.engine.engine import Engine
from pagedgen.runtime.models.loader import resolve_model
from pagedgen.runtime.sampling.sampler import derive_seed

KEYS = ("wall_time_s", "output_tokens", "output_tokens_per_s", "prefix_cache_hit_rate",
        "prefix_cache_hit_tokens", "prefill_tokens_per_s", "peak_kv_blocks_used", "preemptions",
        "kv_cache_blocks", "block_size", "cascade_decode_steps", "decode_steps")


def row(part: str, system: str, runs: list[dict[str, Any]], **extra) -> dict[str, Any]:
    """The median run's figures (``KEYS``) and every run's output tok/s."""
    mid = median_run(runs)
    out = {"part": part, "system": system, **{k: mid[k] for k in KEYS if k in mid},
           "runs_output_tokens_per_s": [round(x, 1) for x in mid["runs_output_tokens_per_s"]],
           **extra}
    print(json.dumps(out), flush=True)
    return out


def engine_for(profile: str, backend: str) -> tuple[Engine, float]:
    return build_engine(profile_configs(profile, backend=backend)[0])


def part_d(backend: str, repeats: int, off_repeats: int, no_cascade_repeats: int) -> list[dict]:
    wl = workload("d")
    eng, load_s = engine_for(wl.profile, backend)
    prompts, outs = wl.requests(eng.src.hf_config.vocab_size)
    _, sampling = profile_configs(wl.profile)
    params = [replace(sampling, max_tokens=n, temperature=0.0, ignore_eos=True) for n in outs]
    on = timed_runs(eng, prompts, params, repeats=repeats, load_s=load_s, prefix_caching=True)
    rows = [row("d", f"pagedgen {backend}, prefix caching on", on, load_time_s=load_s)]
    if no_cascade_repeats:
        with eng.measurement().cascade_off():
            plain = timed_runs(eng, prompts, params, repeats=no_cascade_repeats,
                               prefix_caching=True)
        same = len({r["outputs_digest"] for r in on + plain}) == 1
        rows.append(row("d", f"pagedgen {backend}, prefix caching on, cascade decode off", plain,
                        same_tokens_as_on=same))
    if off_repeats:
        off = timed_runs(eng, prompts, params, repeats=off_repeats, prefix_caching=False)
        same = len({r["outputs_digest"] for r in on + off}) == 1
        rows.append(row("d", f"pagedgen {backend}, prefix caching off", off,
                        same_tokens_as_on=same))
    del eng
    free_gpu()
    return rows


def part_p(backend: str) -> list[dict]:
    wl = workload("p")
    eng, load_s = engine_for(wl.profile, backend)
    prompts, outs = wl.requests(eng.src.hf_config.vocab_size)
    _, sampling = profile_configs(wl.profile)
    base = [replace(sampling, max_tokens=n, temperature=wl.temperature, ignore_eos=True,
                    seed=1000 + i) for i, n in enumerate(outs)]
    forked = [replace(p, n=wl.n) for p in base]
    single = [replace(p, seed=derive_seed(p.seed, j)) for p in base for j in range(wl.n)]
    repeated = [p for p in prompts for _ in range(wl.n)]
    rows = [row("p", f"pagedgen {backend}, n = {wl.n}",
                timed_runs(eng, prompts, forked, prefix_caching=False), load_time_s=load_s),
            row("p", f"pagedgen {backend}, {len(single)} independent, prefix caching off",
                timed_runs(eng, repeated, single, prefix_caching=False)),
            row("p", f"pagedgen {backend}, {len(single)} independent, prefix caching on",
                timed_runs(eng, repeated, single, prefix_caching=True))]
    del eng
    free_gpu()
    return rows


def part_a(backend: str, repeats: int) -> list[dict]:
    wl = workload("a")
    eng, load_s = engine_for(wl.profile, backend)
    prompts, outs = wl.requests(eng.src.hf_config.vocab_size)
    _, sampling = profile_configs(wl.profile)
    params = [replace(sampling, max_tokens=n, temperature=0.0, ignore_eos=True) for n in outs]
    on, off = [], []
    for _ in range(repeats):  # interleaved, so drift hits both alike
        on += timed_runs(eng, prompts, params, prefix_caching=True)
        off += timed_runs(eng, prompts, params, prefix_caching=False)
    ratio = statistics.median(r["output_tokens_per_s"] for r in on) / statistics.median(
        r["output_tokens_per_s"] for r in off)
    same = len({r["outputs_digest"] for r in on + off}) == 1
    rows = [row("a", f"pagedgen {backend}, prefix caching on", on, load_time_s=load_s,
                on_over_off=ratio, same_tokens_as_off=same),
            row("a", f"pagedgen {backend}, prefix caching off", off)]
    del eng
    free_gpu()
    return rows


def part_d_vllm(repeats: int) -> list[dict]:
    wl = workload("d")
    cfg, _ = profile_configs(wl.profile)
    res = run_vllm("d", None, resolve_model(wl.profile).hf_config, same_limits(cfg),
                   repeats=repeats)
    if "skipped" in res:
        print(f"vLLM: {res['skipped']}", flush=True)
        return []
    return [row("d", f"vLLM {res['vllm']}, prefix caching on", res["runs"],
                startup_s=res["startup_s"])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="d,p,a")
    ap.add_argument("--backends", default="flash-attn,flashinfer",
                    help="comma list; empty: vLLM alone (with --vllm)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--off-repeats", type=int, default=1)
    ap.add_argument("--no-cascade-repeats", type=int, default=1)
    ap.add_argument("--vllm", action="store_true", help="vLLM on part d too")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kv_reuse.py needs a CUDA GPU")
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}
    rows: list[dict] = []
    parts = args.parts.split(",")
    backends = [b for b in args.backends.split(",") if b]
    for backend in backends:
        if "d" in parts:
            rows += part_d(backend, args.repeats, args.off_repeats, args.no_cascade_repeats)
        if "a" in parts:
            rows += part_a(backend, args.repeats)
        if args.json:
            args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    if "p" in parts and backends:  # one backend: the first
        rows += part_p(backends[0])
    if "d" in parts and args.vllm:
        rows += part_d_vllm(args.repeats)
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print_table(f"KV reuse on {meta['gpu']}", rows,
                ["part", "system", "output_tokens_per_s", "wall_time_s", "prefix_cache_hit_rate",
                 "peak_kv_blocks_used", "preemptions"])


if __name__ == "__main__":
    main()
