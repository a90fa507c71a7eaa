"""The end-of-run summary as a Rich table (its figures: ``runtime/engine/stats.py``).

By default the table is compact: the rows a user reads after every run (what ran, how much,
how fast, memory, start-up), rows of features the run did not use left out, as wide as the
terminal up to 100 columns (80 fit). ``full=True`` shows every figure, as ``--json`` gives
them."""

from __future__ import annotations

from typing import Any

from rich.markup import escape
from rich.table import Table


def format_value(key: str, value: Any) -> str:
    """A summary value as tables show it (the unit comes from the key's suffix)."""
    if isinstance(value, dict):  # named parts in the key's unit
        unit = key[key.rfind("_"):]
        return ", ".join(f"{k.replace('_', ' ')} {format_value(unit, v)}"
                         for k, v in value.items())
    if isinstance(value, bool):
        return "on" if value else "off"
    if key.endswith("_ms_per_step"):
        return f"{value:.3f} ms"
    if key.endswith("_rate"):
        return f"{value:.1%}"
    if key.endswith("_bytes"):
        return f"{value / 2**30:.2f} GiB" if value >= 2**30 else f"{value / 2**20:.1f} MiB"
    if key.endswith("_per_s"):
        return f"{value:,.1f}"
    if key.endswith("_s"):
        return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"
    if isinstance(value, float):
        return f"{value:.3f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


_LABELS = {"wall_time_s": "wall time", "mean_ttft_s": "mean time to first token",
           "mean_tpot_s": "mean time per output token", "peak_memory_bytes": "peak memory",
           "load_time_s": "model load", "startup_s": "command to first step",
           "skipped_resumed": "skipped (already in the output)",
           "lines_with_errors": "lines with errors (records in their places)",
           "sampling_defaults": "the preset's sampling",
           "input_time_s": "input read, checked, tokenized",
           "samples": "samples (all n of each request)",
           "prefix_caching": "prefix caching",
           "prefix_grouping": "requests sharing a prefix admitted together",
           "prefix_cache_hit_rate": "prefix-cache hit rate (admitted tokens)",
           "prefix_cache_hit_tokens": "prompt tokens from the prefix cache",
           "prefix_cache_evicted_blocks": "cached blocks evicted",
           "kv_cache_blocks": "KV-cache blocks", "peak_kv_blocks_used": "most blocks in use",
           "graph_capture_s": "CUDA-graph capture", "graph_memory_bytes": "CUDA-graph memory",
           "graphs_captured_in_run": "decode graphs captured during the run",
           "graph_capture_in_run_s": "of which capture time",
           "graph_warmups_in_run": "of which warmed up first",
           "max_num_seqs": "max_num_seqs (most sequences in a step)",
           "decode_host_ms_per_step": "host time per decode step",
           "block_size": "page size (tokens)", "fused_kernels": "fused norm/rotary/SwiGLU",
           "cascade_attention": "cascade decode", "batch_invariant": "batch-invariant",
           "cascade_decode_steps": "steps that cascaded",
           "cascade_mixed_steps": "cascade in steps with prefills",
           "cascade_steps_with_prefills": "of which steps with prefills",
           "cascade_groups_per_step": "groups per cascade step",
           "cascade_levels_per_step": "levels per cascade step",
           "cascade_most_levels": "most levels in a step",
           "decode_kv_read_gb_per_step": "KV read per decode step (GB)",
           "decode_kv_plain_gb_per_step": "KV plain decode would read (GB)",
           "attention_warmup_s": "attention warm-up (compiles)",
           "attention_kernels_compiled_at_warmup": "kernel variants ready at warm-up",
           "attention_kernels_compiled_later": "kernels compiled after warm-up",
           "steps_launched_ahead": "steps launched ahead", "startup_breakdown_s": "of which",
           "mixed_step_graphs": "piecewise graphs for steps with prefills",
           "mixed_graph_steps": "steps with prefills in piecewise graphs",
           "mixed_graph_buckets": "piecewise token buckets captured",
           "mixed_graph_capture_s": "piecewise graph capture",
           "mixed_graph_failed": "piecewise captures failed",
           "kv_cache_bytes": "KV cache", "recurrent_state_bytes": "linear-attention state",
           "kv_cache_token_slots": "KV token slots (pages x page size)",
           "kv_peak_tokens_held": "most tokens held", "kv_groups_note": "KV groups",
           "weights": "weights",
           "recurrent_state_slots": "state slots (max_num_seqs + scratch)",
           "recurrent_state_bytes_per_slot": "state per slot",
           "max_num_seqs_lowered": "max_num_seqs lowered to fit the state",
           "kernel_plans": "kernel plans (FP8 GEMMs, MoE tiles)",
           "kernels_compiled_at_startup": "Triton kernels made at start-up",
           "kernel_compile_at_startup_s": "of which time",
           "kernels_compiled_in_run": "Triton kernels made during the run",
           "kernel_compile_in_run_s": "of which time",
           "slowest_compiles_in_run": "slowest made during the run",
           "compiles_in_run_s": "made during the run"}

# The table's groups, each the summary keys it shows (keys in no group go to "run").
_GROUPS: dict[str, tuple[str, ...]] = {
    "throughput (tokens/s)": ("output_tokens_per_s", "total_tokens_per_s",
                              "prefill_tokens_per_s", "decode_tokens_per_s",
                              "output_tokens_per_s_while_busy"),
    "latency": ("wall_time_s", "mean_ttft_s", "mean_tpot_s", "decode_host_ms_per_step"),
    "steps": ("max_num_seqs", "steps", "steps_launched_ahead", "preemptions", "cuda_graphs",
              "graphs_captured_in_run", "graph_capture_in_run_s", "graph_warmups_in_run",
              "fused_kernels", "batch_invariant",
              "mixed_step_graphs", "mixed_graph_steps", "mixed_graph_buckets",
              "mixed_graph_failed"),
    "shared KV (grouped cascade decode)": (
        "cascade_attention", "cascade_mixed_steps", "cascade_decode_steps",
        "cascade_steps_with_prefills", "cascade_groups_per_step",
        "cascade_levels_per_step", "cascade_most_levels", "decode_kv_read_gb_per_step",
        "decode_kv_plain_gb_per_step"),
    "KV cache and prefix cache": ("kv_cache_blocks", "kv_cache_token_slots", "block_size",
                                  "peak_kv_blocks_used", "kv_peak_tokens_held", "kv_groups",
                                  "kv_groups_note",
                                  "prefix_caching", "prefix_grouping",
                                  "prefix_cache_hit_rate",
                                  "prefix_cache_hit_tokens", "prefix_cache_evicted_blocks"),
    "memory": ("peak_memory_bytes", "kv_cache_bytes", "recurrent_state_bytes",
               "recurrent_state_bytes_per_slot", "graph_memory_bytes"),
    "linear attention": ("linear_attention_layers", "linear_attention_kernels",
                         "recurrent_state_slots", "max_num_seqs_lowered"),
    "images": ("images_encoded", "images_encoded_per_s", "image_cache_hits",
               "vision_encoder_s", "vision_encoder_share", "image_pixel_wait_s",
               "vision_attention"),
    "start-up": ("startup_s", "startup_breakdown_s", "input_time_s", "load_time_s",
                 "graph_capture_s", "mixed_graph_capture_s", "attention_warmup_s",
                 "attention_kernels_compiled_at_warmup",
                 "attention_kernels_compiled_later", "kernel_plans",
                 "kernels_compiled_at_startup", "kernel_compile_at_startup_s",
                 "kernels_compiled_in_run", "kernel_compile_in_run_s",
                 "slowest_compiles_in_run", "compiles_in_run_s"),
}
TABLE_WIDTH = 100
MIN_WIDTH = 40  # narrower, rich crops values; wider than the console, it crops too

# The compact table's rows, by group; a row shows only where its value says a feature ran
# (``_used``). Every other figure is in --json.
_COMPACT: dict[str, tuple[str, ...]] = {
    "run": ("model", "backend", "device", "threads", "tensor_parallel_size", "data_parallel_size",
            "all_reduce", "dtype", "quantization", "requests", "samples", "prompt_tokens",
            "output_tokens", "lines_with_errors", "skipped_resumed", "preemptions",
            "structured_samples",
            "grammar_unsatisfiable_samples", "grammar_rejected_samples", "output",
            "output_stream", "output_text", "weights", "sampling_defaults"),
    "throughput (tokens/s)": ("output_tokens_per_s", "output_tokens_per_s_while_busy"),
    "latency": ("wall_time_s", "mean_ttft_s", "mean_tpot_s"),
    "KV cache": ("kv_peak_tokens_held", "kv_groups_note",
                 "prefix_cache_hit_rate", "cascade_decode_steps"),
    "memory": ("peak_memory_bytes", "kv_cache_bytes", "recurrent_state_bytes",
               "max_num_seqs_lowered"),
    "start-up": ("startup_s", "kernel_plans"),
}
_COMPACT_LABELS = {"output_tokens_per_s": "output tokens/s", "total_tokens_per_s": "total tokens/s",
                   "output_tokens_per_s_while_busy": "output tokens/s while busy",
                   "peak_memory_bytes": "peak memory", "startup_s": "start-up (command to first "
                                                                   "step)"}
_UNUSED = {"quantization": ("none",), "samples": (), "skipped_resumed": (0,),
           "preemptions": (0,), "grammar_unsatisfiable_samples": (0,),
           "grammar_rejected_samples": (0,), "prefix_cache_hit_rate": (0, 0.0),
           "cascade_decode_steps": (0,), "peak_memory_bytes": (0,), "lines_with_errors": (0,)}


def _used(summary: dict[str, Any], key: str) -> bool:
    value = summary.get(key)
    if value is None:
        return False
    if key == "samples":  # only when n > 1 made more samples than requests
        return value != summary.get("requests")
    return value not in _UNUSED.get(key, ())


def summary_table(summary: dict[str, Any], title: str = "pagedgen generate",
                  full: bool = False, width: int | None = None) -> Table:
    """The summary as a two-column table in groups, at most ``width`` (default
    ``TABLE_WIDTH``) columns wide: the compact rows, or with ``full`` every figure (run,
    throughput, latency, steps, KV cache, memory, start-up); a dict value (a breakdown) is
    one row per part."""
    width = max(MIN_WIDTH, min(width or TABLE_WIDTH, TABLE_WIDTH))
    if full:
        grouped = {k for keys in _GROUPS.values() for k in keys}
        sections = {"run": [k for k in summary if k not in grouped]}
        sections.update({name: [k for k in keys if k in summary]
                         for name, keys in _GROUPS.items()})
    else:
        sections = {name: [k for k in keys if _used(summary, k)]
                    for name, keys in _COMPACT.items()}
        sections["run"] += sorted(k for k in summary if k.startswith("replica_"))
    table = Table(title=title, show_header=False, title_justify="left", width=width,
                  caption=None if full else "every figure: --json", caption_justify="left")
    table.add_column(ratio=1, overflow="fold")
    table.add_column(justify="right", ratio=1, overflow="fold")
    indent = "  " if full else ""
    for name, keys in sections.items():
        if not keys:
            continue
        if full:  # the compact table is short enough without group rows
            table.add_row(f"[bold]{name}[/]", "")
        for key in keys:
            value = summary[key]
            label = (not full and _COMPACT_LABELS.get(key)) or _LABELS.get(key) \
                or key.replace("_per_s", "").replace("_", " ")
            if isinstance(value, dict):
                unit = key[key.rfind("_"):]
                for part, v in value.items():
                    table.add_row(f"{indent}{label}: {part.replace('_', ' ')}",
                                  escape(format_value(unit, v)))
            else:
                table.add_row(f"{indent}{escape(label)}", escape(format_value(key, value)))
    return table
