"""Shared helpers for the benchmark scripts: workloads, engine runs, bandwidth, tables."""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import replace
from typing import Any

import torch

from benchmarks.workloads import output_spread
from pagedgen.attention.flash_attn.fa4 import ENV_DECODE_TILE
from pagedgen.cli.summary import format_value
from pagedgen.runtime.config import EngineConfig, SamplingParams
from pagedgen.runtime.engine.engine import Engine
from pagedgen.runtime.profiles import configs_from_profile, load_profile


def random_prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for length in lens]


def profile_configs(profile: str, **engine_overrides) -> tuple[EngineConfig, SamplingParams]:
    engine, sampling = configs_from_profile(load_profile(profile))
    return replace(engine, **engine_overrides), sampling


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` engine config overrides (``--set``): VALUE as an int, float, bool or text."""
    out: dict[str, Any] = {}
    for kv in pairs:
        key, _, text = kv.partition("=")
        val: Any = {"true": True, "false": False}.get(text.lower(), text)
        for cast in (int, float):
            try:
                val = cast(text)
                break
            except ValueError:
                pass
        out[key] = val
    return out


def run_engine(cfg: EngineConfig, prompts: list[list[int]],
               params: SamplingParams | list[SamplingParams], copy_bw: float | None = None,
               repeats: int = 1) -> list[dict[str, Any]]:
    """Build one engine and generate the workload ``repeats`` times on it (``timed_runs``).
    Frees the GPU afterwards."""
    engine, load_s = build_engine(cfg)
    runs = timed_runs(engine, prompts, params, copy_bw, repeats, load_s)
    del engine
    free_gpu()
    return runs


def decode_tile_env(tile: str | None) -> AbstractContextManager[None]:
    """``$PAGEDGEN_FA4_DECODE_TILE`` = ``tile`` inside (unchanged when None)."""
    return env_set(ENV_DECODE_TILE, tile)


@contextmanager
def env_set(name: str, value: str | None) -> Iterator[None]:
    """Environment variable ``name`` = ``value`` inside (unchanged when either is empty)."""
    before = os.environ.get(name) if name else None
    if name and value:
        os.environ[name] = value
    try:
        yield
    finally:
        if name and value:
            if before is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = before


def build_engine(cfg: EngineConfig) -> tuple[Engine, float]:
    """An engine and its start-up seconds (weights, memory profiling, warm-up, graph capture)."""
    t0 = time.perf_counter()
    return Engine(cfg), time.perf_counter() - t0


# each run's phases beside its throughput: where a first run loses to the second (the
# mixed-step graphs' figures are the engine's totals so far, start-up's warm-up included)
RUN_DETAIL_KEYS = ("wall_time_s", "prefill_tokens_per_s", "decode_step_ms", "steps",
                   "decode_steps", "mixed_graph_steps", "mixed_graph_capture_s",
                   "graphs_captured_in_run", "graph_capture_in_run_s")


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median output tokens/s, with every run's figure (and the Triton
    kernels each made inside it, where counted)."""
    key = "output_tokens_per_s"
    mid = sorted(runs, key=lambda r: r[key])[len(runs) // 2]
    made = {"runs_kernels_compiled": [r["kernels_compiled_in_run"] for r in runs],
            "runs_kernel_compile_s": [r.get("kernel_compile_in_run_s", 0.0) for r in runs],
            "first_run_slowest_compiles": runs[0].get("slowest_compiles_in_run", ""),
            "first_run_compiles_s": runs[0].get("compiles_in_run_s", {})} \
        if all("kernels_compiled_in_run" in r for r in runs) else {}
    return {**mid, "runs_output_tokens_per_s": [r[key] for r in runs], **made,
            "runs_detail": [{k: r[k] for k in RUN_DETAIL_KEYS if k in r} for r in runs]}


def timed_runs(engine: Engine, prompts: list[list[int]],
               params: SamplingParams | list[SamplingParams], copy_bw: float | None = None,
               repeats: int = 1, load_s: float = 0.0, prefix_caching: bool | None = None
               ) -> list[dict[str, Any]]:
    """Generate the workload ``repeats`` times on ``engine``, each run from a cold prefix
    cache (``prefix_caching`` turns it on or off); for each run, the summary ``pagedgen
    generate`` prints, and with ``copy_bw`` (bytes/s) the decode steps' fraction of the memory
    roofline."""
    per_request = params if isinstance(params, list) else [params] * len(prompts)
    kv_per_token = engine.measurement().kv_bytes_per_token()
    runs = []
    for _ in range(repeats):
        engine.reset_prefix_cache(prefix_caching)  # each repeat starts cold, as the first did
        engine.reset_stats()
        # queued as `pagedgen generate` queues a file's lines (admitted lazily, requests that
        # share a prefix together when ``prefix_grouping`` is on); request i seeded by i
        engine.add_requests((p, sp, i, i) for i, (p, sp) in enumerate(zip(prompts, per_request)))
        done: dict[int, Any] = {}
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        engine.run(on_finish=lambda s: done.setdefault(s.request, s))
        wall = time.perf_counter() - start
        seqs = [done[i] for i in sorted(done)]
        res = engine.summary(wall, start, {
            "load_time_s": load_s, "advance_on_device": engine.config.advance_decode_on_device})
        st = engine.stats
        res["decode_steps"] = st.decode_steps
        # equal digests: the same tokens (e.g. prefix caching on and off, greedy)
        outputs = [list(x.output_token_ids) for s in seqs for x in (s.samples or [s])]
        res["outputs_digest"] = hash(tuple(map(tuple, outputs)))
        res.update(output_spread(outputs))
        if copy_bw and st.decode_steps:
            # weights at the mean decode batch (a MoE step reads the experts its tokens chose)
            batch = max(1, round(st.decode_tokens / st.decode_steps))
            weight_bytes = engine.measurement().decode_bytes(batch, 0)["weights"]
            bound = (st.decode_steps * weight_bytes + st.decode_kv_tokens * kv_per_token) / copy_bw
            res["decode_step_ms"] = 1000 * st.decode_time / st.decode_steps
            res["decode_roofline_fraction"] = bound / st.decode_time
        runs.append(res)
    return runs


def event_ms(fn, calls: int = 5) -> float:
    """Mean ms of ``fn`` over ``calls`` eager calls on the GPU, after one (CUDA events)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def free_gpu() -> None:
    """Give the memory of dropped engines and models back (before the next system runs)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def print_table(title: str, rows: list[dict[str, Any]], cols: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for c in cols:
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(*[format_value(c, r[c]) if c in r else "" for c in cols])
    Console(width=200).print(t)
