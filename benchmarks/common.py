"""Shared helpers for the benchmark scripts: workloads, engine runs, bandwidth, tables."""

from __future__ import annotations

import gc
import time
from dataclasses import replace
from typing import Any

import torch

from pagedgen.runtime.config import EngineConfig, SamplingParams, configs_from_profile, load_profile
from pagedgen.runtime.engine import Engine


def random_prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for length in lens]


def profile_configs(profile: str, **engine_overrides) -> tuple[EngineConfig, SamplingParams]:
    engine, sampling = configs_from_profile(load_profile(profile))
    return replace(engine, **engine_overrides), sampling


def run_engine(cfg: EngineConfig, prompts: list[list[int]], params: SamplingParams
               ) -> dict[str, Any]:
    """Build an engine, generate, and report throughput; frees the GPU afterwards."""
    t0 = time.perf_counter()
    engine = Engine(cfg)
    load_s = time.perf_counter() - t0
    seqs = [engine.add_request(p, params) for p in prompts]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    engine.run()
    wall = time.perf_counter() - start
    st, r = engine.stats, engine.runner
    out_tokens = sum(s.num_output_tokens for s in seqs)
    in_tokens = sum(s.num_prompt_tokens for s in seqs)
    res = {
        "backend": r.backend.name, "cuda_graphs": r.graphs is not None,
        "advance_on_device": cfg.advance_decode_on_device,
        "requests": len(seqs), "prompt_tokens": in_tokens, "output_tokens": out_tokens,
        "wall_s": wall, "output_tok_s": out_tokens / wall, "total_tok_s": (in_tokens + out_tokens) / wall,
        "prefill_tok_s": st.prefill_tokens / st.prefill_time if st.prefill_time else 0.0,
        "decode_tok_s": st.decode_tokens / st.decode_time if st.decode_time else 0.0,
        "decode_host_ms": r.host_ms_per_step("decode"),
        "steps": st.num_steps, "preemptions": st.num_preemptions,
        "kv_blocks": r.num_blocks, "load_s": load_s,
        "graph_capture_s": r.graphs.capture_time_s if r.graphs else 0.0,
        "graph_memory_gib": r.graphs.memory_bytes / 2**30 if r.graphs else 0.0,
        "peak_memory_gib": engine.peak_memory_bytes() / 2**30,
    }
    del engine, seqs, r
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return res


def print_table(title: str, rows: list[dict[str, Any]], cols: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for c in cols:
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(*[f"{r[c]:,.2f}" if isinstance(r[c], float) else str(r[c]) for c in cols])
    Console(width=200).print(t)
