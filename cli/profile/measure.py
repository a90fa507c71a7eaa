"""Measuring one backend on the workload: for each batch size, batched prefill, then
``warmup_steps`` decode steps, then ``measured_steps`` timed ones; the largest batch size under
torch.profiler, its kernels attributed to phases and groups (runtime/kernel_stats.py, CUDA-graph
replays included), against the hardware's rooflines."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from pagedgen import profiling
from pagedgen.cli.profile.workload import Workload, prompts_for
from pagedgen.errors import PagedgenError
from pagedgen.runtime import kernel_stats


def _percentile(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else 0.0


def _step(engine, phase: str) -> float:
    """One engine step inside a ``pagedgen.<phase>`` range; seconds (synchronized)."""
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with torch.profiler.record_function(f"pagedgen.{phase}"):
        engine.step()
    sync()
    return time.perf_counter() - t0


def measured_config(cfg, wl: Workload):
    """The engine config ``profile`` measures with: synchronous steps (each step's latency and
    kernels are its own) and prefill steps eager, as they launch, unless the profile's engine
    asks for piecewise graphs (``mixed_step_graphs: true``: a bucket would otherwise be
    captured inside a timed prefill)."""
    num_seqs = max(wl.batch_sizes)  # a decode step of the largest batch fits the step's budget
    tokens = dataclasses.replace(cfg, max_num_seqs=None).with_step_limits().max_num_batched_tokens
    return dataclasses.replace(cfg, max_num_seqs=num_seqs, async_scheduling=False,
                               max_num_batched_tokens=max(tokens, num_seqs),
                               enforce_eager=cfg.enforce_eager or not wl.cuda_graphs,
                               mixed_step_graphs=bool(cfg.mixed_step_graphs))


def run_backend(cfg, wl: Workload, out_dir: Path, seed: int, limits: dict[str, float]
                ) -> dict[str, Any]:
    from pagedgen.runtime.config import SamplingParams
    from pagedgen.runtime.engine.engine import Engine

    engine = Engine(measured_config(cfg, wl))
    m = engine.measurement()
    figures = m.figures()
    name = figures["backend"]
    kernel_batch = max(wl.batch_sizes)
    decode_steps = max(1, min(wl.measured_steps, wl.output_len - wl.warmup_steps - 2))
    per_batch = []
    prof = None
    for batch in wl.batch_sizes:
        prompts = prompts_for(engine, wl, batch, seed)
        # sequences admitted early also decode during the later prefill chunks: leave room
        chunks = -(-sum(map(len, prompts)) // engine.config.max_num_batched_tokens) + 1
        params = SamplingParams(max_tokens=chunks + wl.warmup_steps + decode_steps + 2,
                                temperature=0.0, ignore_eos=True)
        engine.reset_prefix_cache()  # each batch size starts cold (its prompts repeat)
        hits_before = engine.stats.prefix_hit_tokens
        try:
            seqs = [engine.add_request(p, params) for p in prompts]
        except ValueError as e:  # a prompt (with its decode steps) the model cannot take
            raise PagedgenError(f"profile workload at batch {batch}: {e}")
        if batch == kernel_batch:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if figures["device"].startswith("cuda"):
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            prof = torch.profiler.profile(activities=acts)
            prof.start()
        try:
            timings = _measure(engine, seqs, wl, decode_steps, batch == kernel_batch)
        finally:
            if batch == kernel_batch:
                prof.stop()
        prefill_s, prefill_tokens, times = (timings["prefill_s"], timings["prefill_tokens"],
                                            timings["times"])
        hits = engine.stats.prefix_hit_tokens - hits_before
        while engine.has_unfinished():
            engine.step()
        ctx = timings["mean_context"]
        p50 = _percentile(times, 50)
        row = {"batch": batch, "prefill_tokens": prefill_tokens, "prefix_hit_tokens": hits,
               "prefill_tok_s": prefill_tokens / prefill_s if prefill_s else 0.0,
               "decode_tok_s": batch / p50 if p50 else 0.0,
               "step_ms_p50": 1000 * p50, "step_ms_p90": 1000 * _percentile(times, 90),
               "step_ms_p99": 1000 * _percentile(times, 99), "mean_context": ctx,
               # the timed decode steps' grouped cascade and KV reads (plain: every decode
               # reading its whole context)
               **{k: v for k, v in timings["reads"].items() if k != "cascade_most_levels"}}
        if "copy_bw" in limits:  # weights, KV and linear-attention state (read and written)
            least = sum(m.decode_bytes(batch, ctx).values())
            row["decode_roofline_ms"] = 1000 * least / limits["copy_bw"]
            row["decode_roofline_fraction"] = row["decode_roofline_ms"] / row["step_ms_p50"]
        per_batch.append(row)
    figures = engine.measurement().figures()  # the KV summary's peak after the batches
    rank = figures.pop("tensor_parallel_rank")
    result: dict[str, Any] = {**figures, "model": engine.src.name, "batches": per_batch,
                              "kernel_batch": kernel_batch, "decode_steps": decode_steps}
    rank = f"-rank{rank}" if figures["tensor_parallel_size"] > 1 else ""  # each rank its own
    trace = out_dir / f"trace-{name}{rank}.json"
    prof.export_chrome_trace(str(trace))
    result["trace"] = str(trace)
    if figures["device"].startswith("cuda"):
        kernels = kernel_stats.load_kernels(trace)
        ref = [k for k in kernels if k.phase == "reference" and k.in_forward]
        result["graph_replays_matched"] = kernel_stats.attribute_graph_kernels(kernels, ref)
        result["phases"] = kernel_stats.summarize(kernels)
        result["roofline"] = _roofline(engine, result, per_batch[-1], limits)
    else:
        result["phases"] = _cpu_summary(prof)
        result["not_measured"] = ("no GPU here: the kernel table shows CPU operator self-times "
                                  "by group; GPU kernel times and rooflines need a GPU")
    del engine, m, prof
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def _measure(engine, seqs, wl: Workload, decode_steps: int, profiled: bool) -> dict[str, Any]:
    """Prefill the batch, warm up, then time ``decode_steps`` decode steps."""
    m = engine.measurement()
    with profiling.enabled() if profiled else contextlib.nullcontext():
        prefill_s, prefill_tokens = 0.0, 0
        while engine.scheduler.waiting or any(s.num_uncomputed > 1 for s in seqs):
            before = engine.stats.prefill_tokens
            prefill_s += _step(engine, "prefill")
            prefill_tokens += engine.stats.prefill_tokens - before
        for _ in range(wl.warmup_steps):
            _step(engine, "warmup")
        ctx0 = statistics.fmean(s.num_tokens for s in seqs)
        mark = m.decode_reads()
        times = [_step(engine, "decode") for _ in range(decode_steps)]
        reads = m.decode_reads_since(mark)
        mean_context = (ctx0 + statistics.fmean(s.num_tokens for s in seqs)) / 2
        if profiled and m.figures()["cuda_graphs"]:  # one eager forward: the reference
            with m.without_graphs():  # the graph replays' kernels are attributed against
                _step(engine, "reference")
    return dict(prefill_s=prefill_s, prefill_tokens=prefill_tokens, times=times,
                mean_context=mean_context, reads=reads)


def _roofline(engine, result: dict, row: dict, limits: dict[str, float]) -> dict[str, Any]:
    """Decode attention bandwidth, prefill attention and GEMM FLOP/s, against measured limits."""
    m = engine.measurement()
    g = m.gemm_figures()
    out: dict[str, Any] = {"copy_bw_tb_s": limits["copy_bw"] / 1e12,
                           "matmul_tflop_s": limits["matmul"] / 1e12}
    dec, pre = result["phases"]["decode"], result["phases"]["prefill"]
    steps, batch = result["decode_steps"], row["batch"]
    least = m.decode_bytes(batch, row["mean_context"])
    attn_s = dec["groups_us"]["attention"] / 1e6 / steps
    if attn_s:
        out["decode_attention_tb_s"] = least["kv"] / attn_s / 1e12
        out["decode_attention_bw_fraction"] = least["kv"] / attn_s / limits["copy_bw"]
    # this rank's linear layers (FP8 ones in their own kernel group, against the FP8 peak)
    linear, lm_head = g["linear_params"], g["lm_head_params"]
    fp8 = g["fp8"] and "matmul_fp8" in limits
    linear_group, linear_peak = ("FP8 GEMM", limits["matmul_fp8"]) if fp8 \
        else ("GEMM", limits["matmul"])
    if fp8:
        out["fp8_matmul_tflop_s"] = limits["matmul_fp8"] / 1e12
    lin_dec_s = dec["groups_us"][linear_group] / 1e6 / steps
    head_dec_s = dec["groups_us"]["GEMM"] / 1e6 / steps
    if fp8 and lin_dec_s:
        out["decode_fp8_gemm_tflop_s"] = 2 * batch * linear / lin_dec_s / 1e12
        out["decode_fp8_gemm_tb_s"] = g["fp8_linear_bytes"] / lin_dec_s / 1e12
        out["decode_fp8_gemm_bw_fraction"] = g["fp8_linear_bytes"] / lin_dec_s / limits["copy_bw"]
    if head_dec_s:
        flops = 2 * batch * (lm_head + (0 if fp8 else linear))
        out["decode_gemm_tflop_s"] = flops / head_dec_s / 1e12
    n_tok = row["prefill_tokens"]
    n_seq_len = n_tok / batch
    attn_flops = 4 * g["num_heads"] * g["head_size"] * g["attention_layers"] * batch \
        * n_seq_len * (n_seq_len + 1) / 2
    if pre["groups_us"]["attention"]:
        t = pre["groups_us"]["attention"] / 1e6
        out["prefill_attention_tflop_s"] = attn_flops / t / 1e12
        out["prefill_attention_peak_fraction"] = attn_flops / t / limits["matmul"]
    if pre["groups_us"][linear_group]:
        t = pre["groups_us"][linear_group] / 1e6
        flops = 2 * n_tok * linear + (0 if fp8 else 2 * batch * lm_head)
        out["prefill_gemm_tflop_s"] = flops / t / 1e12
        out["prefill_gemm_peak_fraction"] = flops / t / linear_peak
    out.update(_moe_roofline(m.moe_figures(batch, n_tok), dec, pre, steps, limits))
    lin_s = dec["groups_us"]["linear attention"] / 1e6 / steps
    if lin_s:  # each sequence's state read and written once a step
        out["decode_linear_attention_tb_s"] = least["state"] / lin_s / 1e12
        out["decode_linear_attention_bw_fraction"] = least["state"] / lin_s / limits["copy_bw"]
    out["decode_step_roofline_fraction"] = row.get("decode_roofline_fraction")
    return out


def _moe_roofline(moe: dict[str, Any] | None, dec: dict, pre: dict, steps: int,
                  limits: dict[str, float]) -> dict[str, Any]:
    """The MoE kernel group (``moe``: ``Measurement.moe_figures``): decode against the bytes
    of the experts a step is expected to read (uniform routing), prefill against the FLOPs of
    each token's top-k experts and the peak of the tensor cores they meet (FP8 experts: FP8's,
    where measured)."""
    if moe is None:
        return {}
    out: dict[str, Any] = {}
    dec_s = dec["groups_us"]["MoE"] / 1e6 / steps
    if dec_s:
        out["decode_moe_tb_s"] = moe["decode_bytes"] / dec_s / 1e12
        out["decode_moe_bw_fraction"] = moe["decode_bytes"] / dec_s / limits["copy_bw"]
    if pre["groups_us"]["MoE"]:
        fp8 = moe["fp8"] and "matmul_fp8" in limits
        t = pre["groups_us"]["MoE"] / 1e6
        out["prefill_moe_tflop_s"] = moe["prefill_flops"] / t / 1e12
        out["prefill_moe_peak_fraction"] = moe["prefill_flops"] / t / limits[
            "matmul_fp8" if fp8 else "matmul"]
    return out


def _cpu_summary(prof) -> dict[str, Any]:
    """On CPU: operator self-times by phase and group (the innermost pg: scope, else the name)."""
    ops = []
    for evt in prof.events():
        if evt.name.startswith(("pagedgen.", profiling.PREFIX)):
            continue
        phase, group, p = None, None, evt.cpu_parent
        while p is not None:
            if group is None and p.name.startswith(profiling.PREFIX):
                group = kernel_stats._SCOPE_GROUP.get(p.name[len(profiling.PREFIX):])
            if p.name.startswith("pagedgen."):
                phase = p.name.split(".", 1)[1]
                break
            p = p.cpu_parent
        group = group or ("GEMM" if evt.name in ("aten::mm", "aten::addmm", "aten::bmm")
                          else kernel_stats.group_from_name(evt.name))
        ops.append(kernel_stats.Kernel(evt.name, evt.time_range.start,
                                       evt.self_cpu_time_total, phase, group, None))
    return kernel_stats.summarize(ops, time_key="cpu_time_us")


def run_sharded(cfg, wl: Workload, out_dir: Path, seed: int, limits: dict[str, float]
                 ) -> dict[str, Any]:
    """``run_backend`` on every rank of a tensor-parallel group (worker processes on GPUs
    0..N-1, or gloo on the CPU); rank 0's result."""
    from pagedgen.runtime.drivers import data_parallel

    return data_parallel.run_on_ranks(_profile_worker, (cfg, wl, out_dir, seed, limits), cfg)


def _profile_worker(cfg, wl: Workload, out_dir: Path, seed: int, limits: dict[str, float],
                    inbox):
    yield run_backend(cfg, wl, out_dir, seed, limits)
