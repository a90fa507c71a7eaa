"""The worker's read-only description of itself (``Engine.describe``), which the summary, and
through it ``profile`` and the benchmarks, read instead of the runner's attributes: what runs
(the backend of each KV group, device, dtype, tensor parallelism, weight format), the KV cache it
holds, its CUDA graphs and kernels, the vision tower's and the recurrent state's figures, the
decode steps' KV reads, its start-up phases."""

from __future__ import annotations

from typing import Any

import torch

from pagedgen.runtime.engine.stats import peak_memory_bytes


def describe(runner: Any, peak_held: int, wall: float | None = None) -> dict[str, Any]:
    """``runner``'s figures; ``peak_held``: the most pages the engine held at once (the KV
    summary's peak per group); ``wall``: the run's seconds (the vision tower's share)."""
    quant, tp = runner.quant, runner.tp
    out: dict[str, Any] = {
        "backend": runner.backend_name,
        "device": str(runner.device),
        **({"threads": torch.get_num_threads()} if runner.device.type == "cpu" else {}),
        **({"tensor_parallel_size": tp.size, "all_reduce": tp.all_reduce_kind}
           if tp.size > 1 else {}),
        "dtype": str(runner.dtype).removeprefix("torch."),
        "quantization": quant.name if quant else "none",
        **({"quantization_scheme": quant.describe_scheme()} if quant else {}),
        **runner.kv.summary(runner.num_blocks, peak_held),
        "block_size": runner.block_size,
        "peak_memory_bytes": peak_memory_bytes(runner.device),
        "cuda_graphs": runner.graphs is not None,
        "fused_kernels": runner.fused_kernels,
        "cascade_attention": runner.builder.cascade,
        "cascade_mixed_steps": runner.builder.mixed,
        **runner.decode_reads.summary(),
    }
    if runner.images is not None and wall is not None:
        out.update(runner.images.summary(wall))
    if runner.graphs is not None:
        out.update(runner.graphs.summary())
    if runner.piecewise_off:
        out["mixed_step_graphs"] = f"off: {runner.piecewise_off}"
    if (pw := runner.piecewise) is not None:
        out.update(mixed_graph_steps=pw.steps, mixed_graph_buckets=len(pw.pieces),
                   mixed_graph_capture_s=pw.capture_time_s)
        if pw.failed:
            out["mixed_graph_failed"] = {str(k): v for k, v in pw.failed.items()}
    for state in {s.backend: s for s in runner.attn_states}.values():  # one per backend
        out.update(state.compile_stats())
    if runner.recurrent is not None:
        out.update(runner.recurrent.summary())
    if runner.host_steps["decode"]:
        out["decode_host_ms_per_step"] = runner.host_ms_per_step("decode")
    out["startup_breakdown_s"] = dict(runner.startup_phases)
    return out
