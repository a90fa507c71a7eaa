"""The run summary: the engine's counters and its worker's description (``Engine.describe``)
as one dict of figures (the CLI's table and ``--json``, the benchmarks)."""

from __future__ import annotations

from typing import Any

from pagedgen.runtime import kernel_plans
from pagedgen.runtime.worker import batch_invariant, jit_monitor


def run_summary(engine, wall: float, start: float, extra: dict[str, Any] | None = None
                ) -> dict[str, Any]:
    """``engine``'s figures for requests finished since ``start`` (the
    ``time.perf_counter()`` at which the run began), over ``wall`` seconds, beside its
    worker's description (``Engine.describe``); ``extra`` adds the caller's (start-up,
    input)."""
    st = engine.stats
    prompt_tokens, output_tokens = st.prompt_tokens, st.output_tokens
    worker = engine.describe(wall)
    phases = worker.pop("startup_breakdown_s")
    out = {
        "model": engine.src.name,
        **worker,
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
        "peak_kv_blocks_used": st.peak_blocks_used,
        "max_num_seqs": engine.config.max_num_seqs,
    }
    if engine.config.batch_invariant:
        out["batch_invariant"] = batch_invariant.summary(
            engine.config.backend, worker["cuda_graphs"], "recurrent_state_slots" in worker)
    if engine.device.type == "cuda" and jit_monitor.MONITOR.installed:
        out.update(jit_monitor.MONITOR.summary(*engine.jit_marks))
    if kernel_plans.sources:
        out["kernel_plans"] = kernel_plans.summary()
    if "recurrent_state_slots" in worker and engine.config.prefix_caching:
        out["prefix_caching"] = "off: linear-attention layers keep no state at a prefix"
    if engine.grammars_used is not None:
        out.update(engine.grammars_used.summary())
    out.update(extra or {})
    # the worker's phases, unless ``extra`` brought them with the total (``startup``)
    out.setdefault("startup_breakdown_s", phases)
    return out
