"""Where a workload's steps go: steps that carry prefill chunks ("mixed") against decode-only
steps, by size, and their kernels.

1. Every step of the workload run synchronously (one at a time, the device idle in between):
   its prefill tokens, prefill sequences, decodes and wall time, summed per kind and per
   bucket of prefill tokens, with a least-squares fit ms = a + b * prefill tokens + c * decodes
   over the mixed steps.
2. ``--profile-steps`` of them (steady state) under torch.profiler: per kind of step, GPU time
   by kernel group and the top kernels.
3. The same workload run as ``pagedgen generate`` runs it (async scheduling), a window of
   steps traced for GPU kernels only, a marker kernel launched as each step call begins: per
   kind of step, the GPU's busy time, its idle time before a step began (the host still in
   the step before) and inside it (the host launching the step's work slower than the GPU
   ran it).

    python -m benchmarks.mixed_steps --workload s --backend flash-attn --json out.json
"""

from __future__ import annotations

import argparse
import bisect
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import free_gpu, parse_overrides, profile_configs
from benchmarks.workloads import WORKLOADS
from pagedgen import profiling
from pagedgen.runtime import kernel_stats
from pagedgen.runtime.engine.engine import Engine
from pagedgen.runtime.models.loader import resolve_model

BUCKETS = (0, 1, 64, 256, 1024, 4096, 1 << 30)  # prefill tokens: [lo, hi)


def _profiler() -> torch.profiler.profile:
    """A profiler of the host, and of the GPU where there is one."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=acts)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _requests(wl, vocab: int, sampling) -> tuple[list[list[int]], list]:
    prompts, outs = wl.requests(vocab)
    return prompts, wl.sampling_params(sampling, outs)


def record_steps(engine: Engine, log: list[dict[str, Any]]) -> None:
    """Wrap the engine's scheduler call so each step's composition is logged."""
    schedule = engine._schedule

    def wrapped():
        batch = schedule()
        log.append({"prefill_tokens": batch.num_prefill_tokens,
                    "prefill_seqs": len(batch.prefills), "decodes": len(batch.decodes)})
        return batch
    engine._schedule = wrapped


def host_ranges(trace: Path, kind_of: dict[str, str], counts: dict[str, int]
                ) -> dict[str, dict[str, float]]:
    """Per kind of step, host milliseconds a step: the step's range, and the profiling scopes
    and CUDA launch calls inside it (scopes nest: pg:forward holds the others)."""
    data = json.loads(trace.read_text())
    events = [e for e in data.get("traceEvents", []) if e.get("ph") == "X"]
    steps = [(e["ts"], e["ts"] + e.get("dur", 0), kind_of.get(e["name"].split(".", 1)[1]))
             for e in events if e.get("cat") == "user_annotation"
             and e["name"].startswith("pagedgen.step")]
    steps.sort()
    starts = [s[0] for s in steps]
    out: dict[str, dict[str, float]] = {k: {} for k in counts}

    def kind_at(t: float) -> str | None:
        i = bisect.bisect_right(starts, t) - 1
        return steps[i][2] if i >= 0 and t <= steps[i][1] else None

    for e in events:
        name, cat = e["name"], e.get("cat", "")
        if cat == "user_annotation" and name.startswith("pagedgen.step"):
            key = "step"
        elif cat == "user_annotation" and name.startswith(profiling.PREFIX):
            key = name
        elif cat == "cuda_runtime" and "Launch" in name:
            key = "launch calls: " + name
        else:
            continue
        kind = kind_at(e["ts"])
        if kind is None:
            continue
        out[kind][key] = out[kind].get(key, 0.0) + e.get("dur", 0) / 1000
        out[kind]["count " + key] = out[kind].get("count " + key, 0.0) + 1
    return {k: {n: v / max(1, counts[k]) for n, v in sorted(d.items())}
            for k, d in out.items()}


def _by_bucket(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Steps (with their ``ms``) summed per bucket of prefill tokens."""
    buckets = []
    for lo, hi in zip(BUCKETS, BUCKETS[1:]):
        ss = [s for s in steps if lo <= s["prefill_tokens"] < hi]
        if ss:
            n = len(ss)
            buckets.append({"prefill_tokens": f"[{lo}, {hi})", "steps": n,
                            "total_s": sum(s["ms"] for s in ss) / 1000,
                            "mean_ms": sum(s["ms"] for s in ss) / n,
                            "mean_prefill_tokens": sum(s["prefill_tokens"] for s in ss) / n,
                            "mean_prefill_seqs": sum(s["prefill_seqs"] for s in ss) / n,
                            "mean_decodes": sum(s["decodes"] for s in ss) / n})
    return buckets


def synchronous(cfg, prompts, params, profile_from: int, profile_steps: int, out_dir: Path
                ) -> dict[str, Any]:
    engine = Engine(replace(cfg, async_scheduling=False))
    log: list[dict[str, Any]] = []
    record_steps(engine, log)
    for p, sp in zip(prompts, params):
        engine.add_request(p, sp)
    prof = None
    i = 0
    while engine.has_unfinished():
        if i == profile_from:
            prof = _profiler()
            prof.start()
            profiling.ENABLED = True
        _sync()
        t0 = time.perf_counter()
        with torch.profiler.record_function(f"pagedgen.step{i}"):
            engine.step()
        _sync()
        log[-1]["ms"] = 1000 * (time.perf_counter() - t0)
        i += 1
        if prof is not None and i == profile_from + profile_steps:
            profiling.ENABLED = False
            prof.stop()
            trace = out_dir / "mixed-steps-trace.json"
            prof.export_chrome_trace(str(trace))
            prof = None
    steps = log
    out: dict[str, Any] = {"steps": len(steps), "total_s": sum(s["ms"] for s in steps) / 1000}
    kinds = {"decode": [s for s in steps if s["prefill_tokens"] == 0],
             "mixed": [s for s in steps if s["prefill_tokens"] > 0]}
    for k, ss in kinds.items():
        out[k] = {"steps": len(ss), "total_s": sum(s["ms"] for s in ss) / 1000,
                  "mean_ms": sum(s["ms"] for s in ss) / max(1, len(ss)),
                  "mean_decodes": sum(s["decodes"] for s in ss) / max(1, len(ss)),
                  "prefill_tokens": sum(s["prefill_tokens"] for s in ss)}
    out["buckets"] = _by_bucket(steps)
    mixed = kinds["mixed"]
    if len(mixed) >= 3:
        a = torch.tensor([[1.0, s["prefill_tokens"], s["decodes"]] for s in mixed],
                         dtype=torch.float64)
        y = torch.tensor([s["ms"] for s in mixed], dtype=torch.float64)
        coef = torch.linalg.lstsq(a, y.unsqueeze(1)).solution.squeeze(1).tolist()
        out["mixed_fit_ms"] = {"constant": coef[0], "per_prefill_token": coef[1],
                               "per_decode": coef[2]}
    trace = out_dir / "mixed-steps-trace.json"
    if trace.exists():
        kind_of = {f"step{j}": ("mixed" if s["prefill_tokens"] else "decode")
                   for j, s in enumerate(steps)}
        counts = {"mixed": 0, "decode": 0}
        for j in range(profile_from, min(len(steps), profile_from + profile_steps)):
            counts[kind_of[f"step{j}"]] += 1
        window = steps[profile_from:profile_from + profile_steps]
        out["profiled"] = {"first_step": profile_from, "steps": counts, "wall_ms_per_step": {
            kind: sum(s["ms"] for s in window if (s["prefill_tokens"] > 0) == (kind == "mixed"))
            / max(1, counts[kind]) for kind in counts},
            "host_ms_per_step": host_ranges(trace, kind_of, counts)}
        if torch.cuda.is_available():
            kernels = kernel_stats.load_kernels(trace)
            for k in kernels:
                k.phase = kind_of.get(k.phase or "", k.phase)
            summ = kernel_stats.summarize(kernels, ("mixed", "decode"), top=12)
            for kind, s in summ.items():
                n = max(1, counts[kind])
                s["per_step_ms"] = {g: us / n / 1000 for g, us in s["groups_us"].items() if us}
                s["gpu_ms_per_step"] = s["gpu_time_us"] / n / 1000
                del s["groups_us"]
            out["profiled"].update(summ)
        trace.unlink()
    out["attention_call_host_us"] = engine.measurement().attention_call_host_us()
    out.update(_pieces(engine))
    del engine
    free_gpu()
    return out


def _pieces(engine: Engine) -> dict[str, Any]:
    d = engine.describe()
    if "mixed_graph_steps" not in d:
        return {}
    return {"mixed_graph_steps": d["mixed_graph_steps"],
            "mixed_graph_buckets": engine.measurement().mixed_graph_buckets(),
            "mixed_graph_capture_s": d["mixed_graph_capture_s"],
            "mixed_graph_failed": d.get("mixed_graph_failed", {})}


MARKER = "spin_kernel"  # torch.cuda._sleep's kernel: launched at the start of each step call


def step_timeline(kernels: list[tuple[float, float, str]], kinds: list[str]
                  ) -> dict[str, dict[str, float]]:
    """GPU time of steps cut by markers (``kernels``: start, end and name of every kernel of a
    window whose step calls each launched a MARKER first; ``kinds``: each of those steps'
    kind, in order). Per kind of step: its steps, the GPU busy time of their kernels, the GPU
    idle before a step's marker ran (waiting for the host to begin the step: the step
    before's tail on the host), and the idle inside a step, between its marker and its last
    kernel (waiting for the host to launch the step's work). Milliseconds, as the inputs are
    microseconds."""
    ks = sorted(kernels)
    marks = [i for i, k in enumerate(ks) if MARKER in k[2]]
    out = {k: {"steps": 0, "busy_ms": 0.0, "idle_before_ms": 0.0, "idle_inside_ms": 0.0}
           for k in dict.fromkeys(kinds)}
    names: dict[str, dict[str, float]] = {k: {} for k in out}
    prev_end = None
    for n, (i, kind) in enumerate(zip(marks, kinds)):
        j = marks[n + 1] if n + 1 < len(marks) else len(ks)
        start = ks[i][0]
        if prev_end is not None and start > prev_end:
            out[kind]["idle_before_ms"] += (start - prev_end) / 1000
        end, busy, idle = ks[i][1], 0.0, 0.0
        for s, e, name in ks[i + 1:j]:
            if s > end:
                idle += s - end
            busy += max(0.0, e - max(s, end))
            end = max(end, e)
            names[kind][name] = names[kind].get(name, 0.0) + (e - s) / 1000
        prev_end = end if prev_end is None else max(prev_end, end)
        d = out[kind]
        d["steps"] += 1
        d["busy_ms"] += busy / 1000
        d["idle_inside_ms"] += idle / 1000
    for kind, d in out.items():  # kernel time by group and the top kernels, ms a step
        n = max(1, d["steps"])
        groups: dict[str, float] = {}
        for name, ms in names[kind].items():
            g = kernel_stats.group_from_name(name)
            groups[g] = groups.get(g, 0.0) + ms / n
        d["groups_ms"] = dict(sorted(groups.items(), key=lambda kv: -kv[1]))
        d["top_ms"] = [(kernel_stats.short_name(name, 60), ms / n) for name, ms in
                       sorted(names[kind].items(), key=lambda kv: -kv[1])[:8]]
    return out


def _trace_kernels(trace: Path) -> list[tuple[float, float, str]]:
    """Every kernel, copy and memset of a chrome trace: (start, end, name) in microseconds."""
    events = json.loads(trace.read_text()).get("traceEvents", [])
    return [(e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in events
            if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]


def traced_window(prof: torch.profiler.profile, trace: Path, kinds: list[str]
                  ) -> tuple[dict[str, dict[str, Any]], float, float | None]:
    """Stop ``prof`` (GPU kernels of a window of step calls that each launched a MARKER
    first; ``kinds``: each call's kind of step) and divide the GPU's time among the steps:
    ``step_timeline`` per kind, the window's GPU span in ms and the fraction of it the GPU was
    busy. ``trace`` is where the chrome trace is written, and removed after reading."""
    _sync()
    prof.stop()
    prof.export_chrome_trace(str(trace))
    kernels = _trace_kernels(trace)
    trace.unlink()
    per_kind = step_timeline(kernels, kinds)
    span = (max(e for _, e, _ in kernels) - min(s for s, _, _ in kernels)) / 1000
    busy = sum(d["busy_ms"] for d in per_kind.values())
    return per_kind, span, busy / span if span else None


def asynchronous(cfg, prompts, params, profile_from: int, profile_steps: int, out_dir: Path
                 ) -> dict[str, Any]:
    """The workload as ``generate`` runs it; a window of steps traced for kernels only (no host
    events: recording the host's ops would slow it and make idle time of its own), each step
    call preceded by a marker kernel, so the GPU's time divides into steps."""
    engine = Engine(cfg)
    log: list[dict[str, Any]] = []
    record_steps(engine, log)
    for p, sp in zip(prompts, params):
        engine.add_request(p, sp)
    _sync()
    start = time.perf_counter()
    i, prof, window, first = 0, None, {}, 0
    cuda = torch.cuda.is_available()
    while engine.has_unfinished():
        if i == profile_from and cuda:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            prof.start()
            first = len(log)
        t0 = time.perf_counter()
        if prof is not None:
            torch.cuda._sleep(1)
        logged = len(log)
        engine.step()
        if len(log) > logged:  # the last call only resolves the step in flight
            log[-1]["ms"] = 1000 * (time.perf_counter() - t0)
        i += 1
        if prof is not None and i == profile_from + profile_steps:
            steps = log[first:]
            kinds = ["mixed" if s["prefill_tokens"] else "decode" for s in steps]
            per_kind, span, busy_fraction = traced_window(
                prof, out_dir / "mixed-steps-async-trace.json", kinds)
            window = {"first_step": profile_from, "steps": len(steps),
                      "host_ms": sum(s["ms"] for s in steps), "gpu_span_ms": span,
                      "gpu_busy_fraction": busy_fraction,
                      "step_call_ms": {k: sum(s["ms"] for s, sk in zip(steps, kinds) if sk == k)
                                       / kinds.count(k) for k in set(kinds)},
                      "by_kind": per_kind}
            prof = None
    _sync()
    wall = time.perf_counter() - start
    # each step call's wall time: in steady state the host waits on the GPU, so the calls
    # divide the run's wall time among the steps
    out = {"wall_s": wall, "steps": len(log), **_pieces(engine),
           "step_calls": _by_bucket(log), "profiled_window": window}
    del engine
    free_gpu()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="s", choices=sorted(WORKLOADS))
    ap.add_argument("--backend", default="flash-attn")
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--profile", default=None, help="another model profile (a CPU smoke run)")
    ap.add_argument("--profile-from", type=int, default=400)
    ap.add_argument("--profile-steps", type=int, default=40)
    ap.add_argument("--async-steps", type=int, default=200,
                    help="steps of the async run traced for kernels")
    ap.add_argument("--async-runs", type=int, default=1, help="runs of the async run (the "
                    "last one is reported)")
    ap.add_argument("--sync-off", action="store_true", help="only the async run")
    ap.add_argument("--set", action="append", default=[],
                    help="engine config override KEY=VALUE (int, float, bool or text)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    wl = WORKLOADS[args.workload]
    if args.num_prompts:
        wl = replace(wl, num_prompts=args.num_prompts)
    if args.profile:
        wl = replace(wl, profile=args.profile)
    overrides = parse_overrides(args.set)
    cfg, sampling = profile_configs(wl.profile, backend=args.backend, **overrides)
    src = resolve_model(wl.profile)
    prompts, params = _requests(wl, src.hf_config.vocab_size, sampling)
    out_dir = (args.json.parent if args.json else Path("."))
    res = {"workload": args.workload, "backend": args.backend, "overrides": overrides,
           "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    if not args.sync_off:
        res["synchronous"] = synchronous(cfg, prompts, params, args.profile_from,
                                         args.profile_steps, out_dir)
        print(json.dumps(res["synchronous"], indent=1), flush=True)
    for run in range(args.async_runs):  # the last run is kept (the first compiles kernels)
        res["asynchronous"] = asynchronous(cfg, prompts, params, args.profile_from,
                                           args.async_steps, out_dir)
        print(f"async run {run + 1}:", json.dumps(res["asynchronous"], indent=1), flush=True)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
