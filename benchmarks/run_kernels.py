"""Where a whole run's GPU time goes, pagedgen beside vLLM (issue 59: what vLLM runs for MoE,
and where its FP8 MoE is faster than ours).

Each system runs one workload at its defaults (workloads.py; ``--quantization fp8`` both
quantize), once warm and once under torch.profiler (kernels only). Every kernel is grouped by
the same name rules for both (``kernel_stats.group_from_name``: vLLM's kernels carry no
pagedgen scopes, and neither do pagedgen's replayed from CUDA graphs), and the table gives each
group's seconds in each system and the heaviest kernels. vLLM runs in a process of its own
(``vllm_peer.py``) on the same token ids; ``--systems pagedgen`` alone needs no vLLM.

    python -m benchmarks.run_kernels --workload m --quantization fp8 --json out.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any

from pagedgen.runtime.kernel_stats import (
    GROUPS,
    TOP,
    Kernel,
    kernel_table,
    load_kernels,
    named,
    short_name,
)


def trace_kernels(paths: Iterable[Path]) -> list[tuple[str, float]]:
    """(name, µs) of every kernel in these Chrome traces (memory copies apart)."""
    return [pair for p in paths for pair in named(load_kernels(p))]


def idle_table(ks: list[Kernel], wall_s: float, largest: int = 8) -> dict[str, Any]:
    """Where the GPU waited in one run's trace (``ks``, as ``load_kernels`` gives them): the
    gaps between its busy spans (kernels, copies), their sum and those over a millisecond,
    the ``largest`` with when they came (seconds from the first kernel) and the kernels either
    side, and the run's wall time outside the first kernel's start and the last one's end (its
    host start and finish)."""
    gaps, end, before = [], None, ""
    for k in ks:
        if end is not None and k.ts > end:
            gaps.append((k.ts - end, k.ts, before, short_name(k.name)))
        if end is None or k.ts + k.dur > end:
            end, before = k.ts + k.dur, short_name(k.name)
    if not ks:
        return {}
    t0 = ks[0].ts
    return {"idle_s": sum(g[0] for g in gaps) / 1e6,
            "gaps_over_1ms": sum(g[0] > 1000 for g in gaps),
            "gaps_over_1ms_s": sum(g[0] for g in gaps if g[0] > 1000) / 1e6,
            "outside_kernels_s": wall_s - (end - t0) / 1e6,
            "largest_gaps": [{"at_s": round((ts - t0) / 1e6, 4), "ms": round(us / 1000, 3),
                              "after": a, "before": b}
                             for us, ts, a, b in sorted(gaps, reverse=True)[:largest]]}


def under_profiler(fn: Callable[[], Any]) -> tuple[Any, list[Kernel]]:
    """``fn()`` under torch.profiler: its result, and its trace's kernels (``load_kernels``;
    a CPU's operators where there is no GPU)."""
    import torch

    kind = torch.profiler.ProfilerActivity
    on = kind.CUDA if torch.cuda.is_available() else kind.CPU  # a CPU run: no kernels
    with tempfile.TemporaryDirectory() as d:
        with torch.profiler.profile(activities=[on]) as prof:
            got = fn()
        trace = Path(d) / "trace.json"
        prof.export_chrome_trace(str(trace))
        return got, load_kernels(trace)


def pagedgen_run(workload: str, quantization: str | None, top: int = TOP,
                 overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """pagedgen's warm run and a profiled one of ``workload``, its profile's engine config
    changed by ``overrides`` (``--set``)."""
    from dataclasses import replace

    from benchmarks.common import build_engine, free_gpu, profile_configs, timed_runs
    from benchmarks.peers import same_kv_cache
    from benchmarks.workloads import WORKLOADS
    from pagedgen.runtime.models.loader import resolve_model

    wl = WORKLOADS[workload]
    hf_config = resolve_model(wl.profile).hf_config
    cfg, sampling = profile_configs(wl.profile, backend="auto", quantization=quantization)
    cfg = replace(cfg, **(overrides or {}))
    engine, load_s = build_engine(same_kv_cache(cfg, wl, hf_config))
    prompts, outs = wl.requests(hf_config.vocab_size)
    params = wl.sampling_params(sampling, outs)
    warm = timed_runs(engine, prompts, params, repeats=1, load_s=load_s)[0]
    runs, kernels = under_profiler(partial(timed_runs, engine, prompts, params, repeats=1))
    profiled = runs[0]
    table = kernel_table(named(kernels), top)  # one parse of the trace for both tables
    idle = idle_table(kernels, profiled["wall_time_s"])
    del engine
    free_gpu()
    label = "".join(f", {k}={v}" for k, v in (overrides or {}).items())
    return {"system": f"pagedgen{label}", "backend": warm.get("backend"),
            "warm_output_tokens_per_s": warm["output_tokens_per_s"],
            "profiled_wall_s": profiled["wall_time_s"], **table, "idle": idle}


def vllm_run(workload: str, quantization: str | None, weights: str = "dummy",
             top: int = TOP) -> dict[str, Any]:
    """vLLM's warm run and a profiled one, on its dummy weights or ("normal") on them drawn
    again in pagedgen's distribution (``vllm_peer.normal_weights``)."""
    from benchmarks.peers import vllm_engine
    from benchmarks.vllm_peer import run_vllm
    from benchmarks.workloads import WORKLOADS
    from pagedgen.runtime.models.loader import resolve_model

    wl = WORKLOADS[workload]
    engine = vllm_engine(wl, quantization)
    with tempfile.TemporaryDirectory() as d:
        res = run_vllm(workload, None, resolve_model(wl.profile).hf_config, engine, repeats=2,
                       profile_dir=Path(d), weights=(weights,))
        if "skipped" in res or "outran" in res:  # no profiled run to read
            return {"system": "vLLM", "skipped": res.get("skipped") or res["outran"],
                    "log": res.get("log", "")}
        traces = sorted(Path(d).rglob("*.pt.trace.json*"))
        table = kernel_table(trace_kernels(traces), top)
    warm, profiled = res["runs"][0], res["runs"][-1]
    return {"system": f"vLLM {res['vllm']}" + (" normal" if weights == "normal" else ""),
            "traces": len(traces),
            "warm_output_tokens_per_s": warm["output_tokens_per_s"],
            "profiled_wall_s": profiled["wall_time_s"],
            "kernel_lines": res.get("kernel_lines", []), **table}


def side_by_side(rows: list[dict[str, Any]]) -> list[str]:
    """Lines of a table: each group's seconds in each system, then each system's top kernels."""
    ok = [r for r in rows if "groups_s" in r]
    lines = ["group".ljust(18) + "".join(r["system"][:16].rjust(18) for r in ok)]
    for g in GROUPS:
        if any(g in r["groups_s"] for r in ok):
            lines.append(g.ljust(18) + "".join(f"{r['groups_s'].get(g, 0):18.3f}" for r in ok))
    lines.append("GPU s".ljust(18) + "".join(f"{r['gpu_s']:18.3f}" for r in ok))
    for r in rows:
        if "skipped" in r:
            lines.append(f"{r['system']}: {r['skipped']}")
            continue
        lines.append(f"{r['system']}: {r['launches']:,} kernels; heaviest (s):")
        lines += [f"  {s:8.3f}  {name}" for name, s in r["top_s"]]
        idle = r.get("idle") or {}
        if idle:
            lines.append(f"{r['system']}: GPU idle {idle['idle_s']:.3f} s between kernels "
                         f"({idle['gaps_over_1ms']} gaps over 1 ms: "
                         f"{idle['gaps_over_1ms_s']:.3f} s), {idle['outside_kernels_s']:.3f} s "
                         "of the run outside them; largest:")
            lines += [f"  {g['ms']:8.3f} ms at {g['at_s']:7.3f} s  {g['after']} -> {g['before']}"
                      for g in idle["largest_gaps"]]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="m")
    ap.add_argument("--quantization", choices=["fp8"], default=None)
    ap.add_argument("--systems", default="pagedgen,vllm")
    ap.add_argument("--vllm-weights", choices=["dummy", "normal"], default="dummy",
                    help="normal: vLLM's weights drawn again in pagedgen's distribution")
    ap.add_argument("--top", type=int, default=TOP, help="the heaviest kernels listed")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="pagedgen's engine config changed (e.g. batch_invariant=true)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from benchmarks.common import parse_overrides
    overrides = parse_overrides(args.set)
    runs = {"pagedgen": lambda w, q: pagedgen_run(w, q, args.top, overrides),
            "vllm": lambda w, q: vllm_run(w, q, args.vllm_weights, args.top)}
    rows = []
    for system in args.systems.split(","):
        rows.append(runs[system](args.workload, args.quantization))
        if args.json:  # after each system: a time limit keeps what was measured
            args.json.write_text(json.dumps({"workload": args.workload,
                                             "quantization": args.quantization,
                                             "rows": rows}, indent=2))
    print("\n".join(side_by_side(rows)))


if __name__ == "__main__":
    main()
