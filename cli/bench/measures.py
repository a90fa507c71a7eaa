"""What `pagedgen bench` measures, through the Python API (``pagedgen.LLM``) and the engine's
summary, so that it measures what ``generate`` runs.

* ``throughput``: offline throughput on synthetic prompts (random token ids of ``--input-len``
  tokens, ``--range-ratio`` around it) or a JSONL file's lines, each to ``--output-len`` tokens
  with EOS ignored, as ``vllm bench throughput`` measures it (its random dataset, temperature 1,
  top_p 1): requests, total and output tokens per second over the generate call, start-up
  apart (``measure``);
* ``latency``: one batch generated again and again, as ``vllm bench latency`` times it;
  with ``--peer vllm`` the same token ids through vLLM afterwards (``peer.py``), this
  engine's memory given back first;
* ``kernels``: throughput's requests once more under torch.profiler, after a few of them
  unprofiled (compiles out of the way): a whole run's GPU time by kernel group
  (``runtime/kernel_stats.py``: the groups ``profile`` and ``benchmarks/run_kernels.py`` use)
  and the heaviest kernels; on a CPU, the operators' self time, grouped alike.
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path
from typing import Any

from pagedgen.cli.formats.reader import parse_json
from pagedgen.errors import PagedgenError


def synthetic_prompts(vocab_size: int, num_prompts: int, input_len: int, range_ratio: float,
                      seed: int) -> list[list[int]]:
    """``num_prompts`` lists of random token ids, each of a length drawn uniformly from
    ``input_len`` x [1 - range_ratio, 1 + range_ratio] (at least one token)."""
    rng = random.Random(seed)
    lo = max(1, round(input_len * (1 - range_ratio)))
    hi = max(lo, round(input_len * (1 + range_ratio)))
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(lo, hi))]
            for _ in range(num_prompts)]


def dataset_prompts(path: Path, num_prompts: int | None) -> list[dict[str, Any]]:
    """The first ``num_prompts`` (None: all) lines of a JSONL file of pagedgen's own lines
    (``prompt``, ``messages`` or ``prompt_token_ids``, with their fields), as request dicts."""
    lines = []
    try:
        with open(path, encoding="utf-8") as f:
            for number, text in enumerate(f, 1):
                if not text.strip():
                    continue
                line = parse_json(text, f"{path}:{number}")
                if not isinstance(line, dict):
                    raise PagedgenError(f"{path}:{number}: a line must be a JSON object")
                lines.append(line)
                if num_prompts is not None and len(lines) == num_prompts:
                    break
    except OSError as e:
        raise PagedgenError(f"{path}: cannot read it ({e.strerror or e})")
    if not lines:
        raise PagedgenError(f"{path}: no lines")
    return lines


def vllm_bench_sampling(output_len: int) -> Any:
    """vLLM's benchmarks' sampling: each request to ``output_len`` tokens, EOS ignored,
    temperature 1, top_p 1."""
    from pagedgen.runtime.inputs.sampling_params import SamplingParams

    return SamplingParams(max_tokens=output_len, temperature=1.0, top_p=1.0, ignore_eos=True)


def measure(llm: Any, prompts: list, output_len: int, started: float) -> dict[str, Any]:
    """Run ``prompts`` through ``llm`` (each to ``output_len`` tokens unless a line sets its
    own ``max_tokens``); the engine's summary with requests per second and the start-up from
    ``started`` (a ``time.perf_counter()``) to the first request. Each request samples from
    its own seed (the run's seed and its index), as ``generate`` does."""
    params = vllm_bench_sampling(output_len)
    engine = llm.engine
    engine.reset_stats()
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=True)
    wall = time.perf_counter() - t0
    summary = engine.summary(wall, t0)
    summary["requests_per_s"] = summary["requests"] / wall if wall else 0.0
    summary["startup_s"] = t0 - started
    return summary


def throughput_line(s: dict[str, Any]) -> str:
    """The figures as ``vllm bench throughput`` prints them."""
    return (f"Throughput: {s['requests_per_s']:.2f} requests/s, "
            f"{s['total_tokens_per_s']:.2f} total tokens/s, "
            f"{s['output_tokens_per_s']:.2f} output tokens/s")


def latency(llm: Any, batch_size: int, input_len: int, output_len: int, warmup: int,
            iters: int, seed: int) -> dict[str, Any]:
    """``vllm bench latency``'s measurement: one batch of ``batch_size`` random prompts of
    ``input_len`` tokens, each to ``output_len`` tokens (EOS ignored), generated ``warmup``
    times unmeasured, then ``iters`` times; each generate call's wall time, their mean and
    percentiles, and the measured calls' mean time to first token and per output token. Each
    measured batch starts on an empty prefix cache (it would hit the last one's prompts)."""
    vocab = llm.engine.src.hf_config.vocab_size
    prompts = synthetic_prompts(vocab, batch_size, input_len, 0.0, seed)
    params = vllm_bench_sampling(output_len)
    for _ in range(warmup):
        llm.generate(prompts, params, use_tqdm=False)
    walls, ttft, tpot, hits = [], [], [], 0
    for _ in range(iters):
        llm.engine.reset_stats()
        llm.engine.reset_prefix_cache()  # the same prompts again: no hit on the last batch's
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        walls.append(time.perf_counter() - t0)
        s = llm.engine.summary(walls[-1], t0)
        ttft.append(s["mean_ttft_s"])
        tpot.append(s["mean_tpot_s"])
        hits += s["prefix_cache_hit_tokens"]
    ordered = sorted(walls)
    return {"backend": s["backend"], "batch_size": batch_size, "input_len": input_len,
            "output_len": output_len,
            "iterations": iters, "avg_latency_s": sum(walls) / iters,
            **{f"p{q}_latency_s": ordered[min(iters - 1, round(q / 100 * (iters - 1)))]
               for q in (10, 25, 50, 75, 90, 99)},
            "mean_ttft_s": sum(ttft) / iters, "mean_tpot_s": sum(tpot) / iters,
            "prefix_cache_hit_tokens": hits, "latencies_s": walls}


def kernels(llm: Any, prompts: list, output_len: int, top: int) -> dict[str, Any]:
    """Where a run of ``prompts`` spends its device time: seconds by kernel group, launches
    and the ``top`` kernels (on a CPU: operators' self time), over the profiled run's wall
    time; a few of the prompts run first, unprofiled."""
    import torch

    from pagedgen.runtime.kernel_stats import kernel_table, load_kernels, named

    params = vllm_bench_sampling(output_len)
    llm.generate(prompts[:8], params, use_tqdm=False)
    engine = llm.engine
    engine.reset_stats()
    cuda = engine.device.type == "cuda"
    kinds = torch.profiler.ProfilerActivity
    activity = kinds.CUDA if cuda else kinds.CPU
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=[activity]) as prof:
        llm.generate(prompts, params, use_tqdm=True)
    wall = time.perf_counter() - t0
    if cuda:
        with tempfile.TemporaryDirectory() as d:
            trace = Path(d) / "trace.json"
            prof.export_chrome_trace(str(trace))
            table = kernel_table(named(load_kernels(trace)), top)
        measured = "GPU kernels"
    else:
        ops = prof.key_averages()
        table = kernel_table(((e.key, e.self_cpu_time_total) for e in ops), top)
        table["launches"] = sum(e.count for e in ops)
        measured = "CPU operators' self time"
    summary = engine.summary(wall, t0)
    return {"model": engine.src.name, "backend": summary["backend"],
            "device": summary["device"], "requests": summary["requests"],
            "output_tokens": summary["output_tokens"], "wall_time_s": wall,
            "measured": measured, "busy_fraction": table["gpu_s"] / wall if wall else 0.0,
            **{("device_s" if k == "gpu_s" else k): v for k, v in table.items()}}


def vllm_peer(src: Any, dtype: Any, prompts: list, output_len: int,
              max_model_len: int | None, quantization: str | None,
              kv_cache_dtype: str | None) -> dict[str, Any]:
    """``prompts`` (token ids) through vLLM (``peer.vllm_throughput``) on ``src``'s model
    (a ``ModelSource``: a checkpoint directory's weights, else a preset's shapes on dummy
    weights), the engine that ran them gone first (call with no reference to it left); vLLM at
    its defaults but for what the user set on both (``dtype``, ``max_model_len``,
    ``quantization``, an FP8 KV cache)."""
    import gc

    import torch

    from pagedgen.cli.bench.peer import vllm_throughput

    gc.collect()  # the engine's memory back to the GPU before vLLM takes its share
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    checkpoint = src.checkpoint if src.checkpoint is not None and src.checkpoint.is_dir() \
        else None
    args = {"dtype": str(dtype).removeprefix("torch."),
            **({"max_model_len": max_model_len} if max_model_len else {}),
            **({"quantization": quantization} if quantization else {}),
            **({"kv_cache_dtype": "fp8"} if kv_cache_dtype == "fp8" else {})}
    return vllm_throughput(src.hf_config, checkpoint, prompts, output_len, args)
