"""The run summary: the engine's counters and its runner's settings as one dict of figures
(the CLI's table and ``--json``, the benchmarks)."""

from __future__ import annotations

from typing import Any

import torch

from pagedgen.runtime import kernel_plans
from pagedgen.runtime.worker import batch_invariant, jit_monitor
from pagedgen.runtime.engine.stats import peak_memory_bytes


def run_summary(engine, wall: float, start: float, extra: dict[str, Any] | None = None
                ) -> dict[str, Any]:
    """``engine``'s figures for requests finished since ``start`` (the
    ``time.perf_counter()`` at which the run began), over ``wall`` seconds; ``extra`` adds
    the caller's (start-up, input)."""
    st = engine.stats
    prompt_tokens, output_tokens = st.prompt_tokens, st.output_tokens
    out = {
        "model": engine.src.name,
        "backend": engine.runner.backend_name,
        "device": str(engine.runner.device),
        **({"threads": torch.get_num_threads()} if engine.runner.device.type == "cpu" else {}),
        **({"tensor_parallel_size": engine.runner.tp.size,
            "all_reduce": engine.runner.tp.all_reduce_kind}
           if engine.runner.tp.size > 1 else {}),
        "dtype": str(engine.runner.dtype).removeprefix("torch."),
        "quantization": engine.runner.quant.name if engine.runner.quant else "none",
        **({"quantization_scheme": engine.runner.quant.describe_scheme()}
           if engine.runner.quant else {}),
        "requests": st.requests_finished,
        "samples": st.samples_finished,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "wall_time_s": wall,
        "prefill_tokens_per_s": st.prefill_tokens / st.prefill_time if st.prefill_time else 0.0,
        "decode_tokens_per_s": st.decode_tokens / st.decode_time if st.decode_time else 0.0,
        "output_tokens_per_s": output_tokens / wall if wall else 0.0,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / wall if wall else 0.0,
        "mean_ttft_s": (st.first_token_time_sum / st.requests_with_first_token - start
                        if st.requests_with_first_token else 0.0),
        "mean_tpot_s": st.tpot_sum / st.requests_with_tpot if st.requests_with_tpot else 0.0,
        "steps": st.num_steps,
        "steps_launched_ahead": st.overlapped_steps,
        "steps_scheduled_during_masks": st.steps_scheduled_during_masks,
        "preemptions": st.num_preemptions,
        "prefix_caching": engine.block_manager.prefix_caching,
        "prefix_grouping": engine.config.prefix_grouping,
        "prefix_cache_hit_rate": (st.prefix_hit_tokens / st.prefix_queried_tokens
                                  if st.prefix_queried_tokens else 0.0),
        "prefix_cache_hit_tokens": st.prefix_hit_tokens,
        "prefix_cache_evicted_blocks": st.evicted_blocks,
        **engine.runner.kv.summary(engine.runner.num_blocks, engine.block_manager.peak_held),
        "peak_kv_blocks_used": st.peak_blocks_used,
        "block_size": engine.runner.block_size, "max_num_seqs": engine.config.max_num_seqs,
        "peak_memory_bytes": peak_memory_bytes(engine.runner.device),
        "cuda_graphs": engine.runner.graphs is not None,
        "fused_kernels": engine.runner.fused_kernels,
        "cascade_attention": engine.runner.builder.cascade,
        "cascade_mixed_steps": engine.runner.builder.mixed,
        **engine.runner.decode_reads.summary(),
    }
    runner = engine.runner
    if engine.config.batch_invariant:
        out["batch_invariant"] = batch_invariant.SUMMARY
    if runner.images is not None:
        out.update(runner.images.summary(wall))
    if runner.graphs is not None:
        out.update(runner.graphs.summary())
    if runner.piecewise_off:
        out["mixed_step_graphs"] = f"off: {runner.piecewise_off}"
    if runner.piecewise is not None:
        pw = runner.piecewise
        out["mixed_graph_steps"] = pw.steps
        out["mixed_graph_buckets"] = len(pw.pieces)
        out["mixed_graph_capture_s"] = pw.capture_time_s
        if pw.failed:
            out["mixed_graph_failed"] = {str(k): v for k, v in pw.failed.items()}
    for state in {s.backend: s for s in runner.attn_states}.values():  # one per backend
        out.update(state.compile_stats())
    if runner.device.type == "cuda" and jit_monitor.MONITOR.installed:
        out.update(jit_monitor.MONITOR.summary(*engine.jit_marks))
    if kernel_plans.sources:
        out["kernel_plans"] = kernel_plans.summary()
    if runner.recurrent is not None:
        out.update(runner.recurrent.summary())
        if engine.config.prefix_caching:
            out["prefix_caching"] = "off: linear-attention layers keep no state at a prefix"
    if engine.grammars_used is not None:
        out.update(engine.grammars_used.summary())
    if runner.host_steps["decode"]:
        out["decode_host_ms_per_step"] = runner.host_ms_per_step("decode")
    out.update(extra or {})
    # the runner's phases, unless ``extra`` brought them with the total (``startup``)
    out.setdefault("startup_breakdown_s", dict(runner.startup_phases))
    return out
