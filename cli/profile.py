"""`pagedgen profile`: where the time goes, per kernel group and phase, against the hardware.

For each backend and batch size of the workload: batched prefill, then ``warmup_steps`` decode
steps, then ``measured_steps`` timed decode steps. The largest batch size runs under
torch.profiler; its kernels are attributed to phases and groups (runtime/kernel_stats.py),
including kernels replayed from CUDA graphs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from pagedgen.attention.registry import backend_status, get_backend
from pagedgen.cli.common import cli_errors, engine_and_sampling, out_console
from pagedgen.errors import PagedgenError
from pagedgen.runtime import kernel_stats, profiling


@dataclass
class Workload:
    batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 16])
    prompt_len: int = 64
    shared_prefix_len: int = 0  # leading tokens every prompt of a batch shares (prefix caching)
    output_len: int = 16  # caps the decode steps per batch size
    prompts: str | None = None  # a JSONL prompt file instead of random prompts
    warmup_steps: int = 2
    measured_steps: int = 8
    cuda_graphs: bool = True


def _percentile(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else 0.0


def _prompts(engine, wl: Workload, batch: int, seed: int) -> list[list[int]]:
    if wl.prompts:
        from pagedgen.cli.prompts import read_requests, tokenize_requests
        rf = read_requests(Path(wl.prompts))
        tokenize_requests(rf, engine.tokenizer)
        ids = [list(r.prompt_token_ids) for r in rf.requests]
        return [ids[i % len(ids)] for i in range(batch)]
    g = torch.Generator().manual_seed(seed)
    vocab = min(256, engine.src.hf_config.vocab_size)
    shared = torch.randint(0, vocab, (min(wl.shared_prefix_len, wl.prompt_len),), generator=g)
    return [shared.tolist() + torch.randint(0, vocab, (wl.prompt_len - len(shared),),
                                            generator=g).tolist() for _ in range(batch)]


def _step(engine, phase: str) -> float:
    """One engine step inside a ``pagedgen.<phase>`` range; seconds (synchronized)."""
    sync = torch.cuda.synchronize if engine.runner.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with torch.profiler.record_function(f"pagedgen.{phase}"):
        engine.step()
    sync()
    return time.perf_counter() - t0


def run_backend(cfg, wl: Workload, out_dir: Path, seed: int, limits: dict[str, float]
                ) -> dict[str, Any]:
    from pagedgen.runtime.config import SamplingParams
    from pagedgen.runtime.engine import Engine

    # synchronous steps: each step's latency and kernels are its own
    engine = Engine(dataclasses.replace(cfg, max_num_seqs=max(wl.batch_sizes), async_scheduling=False,
                                        enforce_eager=cfg.enforce_eager or not wl.cuda_graphs))
    r = engine.runner
    name = r.backend.name
    kernel_batch = max(wl.batch_sizes)
    decode_steps = max(1, min(wl.measured_steps, wl.output_len - wl.warmup_steps - 2))
    per_batch = []
    prof = None
    for batch in wl.batch_sizes:
        prompts = _prompts(engine, wl, batch, seed)
        # sequences admitted early also decode during the later prefill chunks: leave room
        chunks = -(-sum(map(len, prompts)) // cfg.max_num_batched_tokens) + 1
        params = SamplingParams(max_tokens=chunks + wl.warmup_steps + decode_steps + 2,
                                temperature=0.0, ignore_eos=True)
        engine.reset_prefix_cache()  # each batch size starts cold (its prompts repeat)
        hits_before = engine.stats.prefix_hit_tokens
        seqs = [engine.add_request(p, params) for p in prompts]
        if batch == kernel_batch:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if r.device.type == "cuda":
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
               "step_ms_p99": 1000 * _percentile(times, 99), "mean_context": ctx}
        if "copy_bw" in limits:
            weights = r.model.step_weight_bytes()
            kv = batch * ctx * r.block_bytes() / r.block_size
            row["decode_roofline_ms"] = 1000 * (weights + kv) / limits["copy_bw"]
            row["decode_roofline_fraction"] = row["decode_roofline_ms"] / row["step_ms_p50"]
        per_batch.append(row)
    result: dict[str, Any] = {"backend": name, "cuda_graphs": r.graphs is not None,
                              "fused_kernels": r.fused_kernels,
                              "device": str(r.device), "model": engine.src.name,
                              "dtype": str(r.dtype).removeprefix("torch."),
                              "tensor_parallel_size": r.tp.size,
                              "kv_cache_dtype": str(r.kv_dtype).removeprefix("torch."),
                              "batches": per_batch, "kernel_batch": kernel_batch,
                              "decode_steps": decode_steps}
    rank = f"-rank{r.tp.rank}" if r.tp.size > 1 else ""  # every rank writes its own
    trace = out_dir / f"trace-{name}{rank}.json"
    prof.export_chrome_trace(str(trace))
    result["trace"] = str(trace)
    if r.device.type == "cuda":
        kernels = kernel_stats.load_kernels(trace)
        ref = [k for k in kernels if k.phase == "reference" and k.in_forward]
        result["graph_replays_matched"] = kernel_stats.attribute_graph_kernels(kernels, ref)
        result["phases"] = kernel_stats.summarize(kernels)
        result["roofline"] = _roofline(engine, result, per_batch[-1], limits)
    else:
        result["phases"] = _cpu_summary(prof)
        result["not_measured"] = ("no GPU here: the kernel table shows CPU operator self-times "
                                  "by group; GPU kernel times and rooflines need a GPU")
    del engine, r, prof
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def _measure(engine, seqs, wl: Workload, decode_steps: int, profiled: bool) -> dict[str, Any]:
    """Prefill the batch, warm up, then time ``decode_steps`` decode steps."""
    r = engine.runner
    with profiling.enabled() if profiled else contextlib.nullcontext():
        prefill_s, prefill_tokens = 0.0, 0
        while engine.scheduler.waiting or any(s.num_uncomputed > 1 for s in seqs):
            before = engine.stats.prefill_tokens
            prefill_s += _step(engine, "prefill")
            prefill_tokens += engine.stats.prefill_tokens - before
        for _ in range(wl.warmup_steps):
            _step(engine, "warmup")
        ctx0 = statistics.fmean(s.num_tokens for s in seqs)
        times = [_step(engine, "decode") for _ in range(decode_steps)]
        mean_context = (ctx0 + statistics.fmean(s.num_tokens for s in seqs)) / 2
        if profiled and r.graphs is not None:  # one eager forward as the attribution reference
            graphs, r.graphs = r.graphs, None
            try:
                _step(engine, "reference")
            finally:
                r.graphs = graphs
    return dict(prefill_s=prefill_s, prefill_tokens=prefill_tokens, times=times,
                mean_context=mean_context)


def _roofline(engine, result: dict, row: dict, limits: dict[str, float]) -> dict[str, Any]:
    """Decode attention bandwidth, prefill attention and GEMM FLOP/s, against measured limits."""
    r, cfg = engine.runner, engine.config
    hf = engine.src.hf_config
    spec = r.specs[0]
    layers = len(r.specs)
    out: dict[str, Any] = {"copy_bw_tb_s": limits["copy_bw"] / 1e12,
                           "matmul_tflop_s": limits["matmul"] / 1e12}
    dec, pre = result["phases"]["decode"], result["phases"]["prefill"]
    steps, batch = result["decode_steps"], row["batch"]
    kv_bytes = batch * row["mean_context"] * r.block_bytes() / r.block_size
    attn_s = dec["groups_us"]["attention"] / 1e6 / steps
    if attn_s:
        out["decode_attention_tb_s"] = kv_bytes / attn_s / 1e12
        out["decode_attention_bw_fraction"] = kv_bytes / attn_s / limits["copy_bw"]
    linear = sum(m.weight.numel() for n, m in r.model.named_modules()
                 if isinstance(m, torch.nn.Linear) and "lm_head" not in n)
    lm_head = hf.vocab_size * hf.hidden_size / r.tp.size  # this rank's slice of the vocabulary
    gemm_dec_s = dec["groups_us"]["GEMM"] / 1e6 / steps
    if gemm_dec_s:
        out["decode_gemm_tflop_s"] = 2 * batch * (linear + lm_head) / gemm_dec_s / 1e12
    n_tok = row["prefill_tokens"]
    n_seq_len = n_tok / batch
    attn_flops = 4 * spec.num_heads * spec.head_size * layers * batch * n_seq_len * (
        n_seq_len + 1) / 2
    if pre["groups_us"]["attention"]:
        t = pre["groups_us"]["attention"] / 1e6
        out["prefill_attention_tflop_s"] = attn_flops / t / 1e12
        out["prefill_attention_peak_fraction"] = attn_flops / t / limits["matmul"]
    if pre["groups_us"]["GEMM"]:
        t = pre["groups_us"]["GEMM"] / 1e6
        flops = 2 * n_tok * linear + 2 * batch * lm_head
        out["prefill_gemm_tflop_s"] = flops / t / 1e12
        out["prefill_gemm_peak_fraction"] = flops / t / limits["matmul"]
    out["decode_step_roofline_fraction"] = row.get("decode_roofline_fraction")
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


# ---- rendering --------------------------------------------------------------------------------

def render(results: list[dict[str, Any]], console: Console) -> None:
    for res in results:
        b = res["backend"] + (" + CUDA graphs" if res["cuda_graphs"] else "")
        t = Table(title=f"{b}: {res['model']} {res['dtype']} on {res['device']}",
                  title_justify="left")
        cols = ["batch", "prefill tok/s", "decode tok/s", "step p50 ms", "p90 ms", "p99 ms"]
        cached = any(row.get("prefix_hit_tokens") for row in res["batches"])
        if cached:
            cols.insert(2, "prompt tok cached")
        if "decode_roofline_fraction" in res["batches"][0]:
            cols += ["roofline ms", "of roofline"]
        for c in cols:
            t.add_column(c, justify="right")
        for row in res["batches"]:
            vals = [str(row["batch"]), f"{row['prefill_tok_s']:,.0f}",
                    f"{row['decode_tok_s']:,.0f}", f"{row['step_ms_p50']:.3f}",
                    f"{row['step_ms_p90']:.3f}", f"{row['step_ms_p99']:.3f}"]
            if cached:
                vals.insert(2, f"{row['prefix_hit_tokens']:,}")
            if "decode_roofline_fraction" in row:
                vals += [f"{row['decode_roofline_ms']:.3f}",
                         f"{100 * row['decode_roofline_fraction']:.0f}%"]
            t.add_row(*vals)
        console.print(t)
        unit = "GPU" if "gpu_time_us" in res["phases"]["decode"] else "CPU"
        g = Table(title=f"{unit} time by group at batch {res['kernel_batch']} "
                        f"({res['decode_steps']} decode steps)", title_justify="left")
        for c in ("group", "prefill ms", "prefill %", "decode ms", "decode %"):
            g.add_column(c, justify="right" if c != "group" else "left")
        pre, dec = res["phases"]["prefill"], res["phases"]["decode"]
        tot_p = sum(pre["groups_us"].values()) or 1
        tot_d = sum(dec["groups_us"].values()) or 1
        for grp in kernel_stats.GROUPS:
            a, d = pre["groups_us"][grp], dec["groups_us"][grp]
            if a or d:
                g.add_row(grp, f"{a / 1000:.2f}", f"{100 * a / tot_p:.1f}", f"{d / 1000:.2f}",
                          f"{100 * d / tot_d:.1f}")
        console.print(g)
        k = Table(title="top kernels" if unit == "GPU" else "top operators", title_justify="left")
        for c in ("phase", "name", "group", "calls", "total ms", "mean µs", "share"):
            k.add_column(c, justify="left" if c in ("phase", "name", "group") else "right")
        for phase in ("prefill", "decode"):
            for row in res["phases"][phase]["top_kernels"][:10]:
                k.add_row(phase, escape(row["name"]), row["group"], str(row["calls"]),
                          f"{row['total_us'] / 1000:.2f}", f"{row['mean_us']:.1f}",
                          f"{100 * row['share']:.1f}%")
        console.print(k)
        if "roofline" in res:
            rf = res["roofline"]
            parts = [f"copy bandwidth {rf['copy_bw_tb_s']:.2f} TB/s, matmul peak "
                     f"{rf['matmul_tflop_s']:.0f} TFLOP/s (measured)"]
            if "decode_attention_tb_s" in rf:
                parts.append(f"decode attention {rf['decode_attention_tb_s']:.2f} TB/s = "
                             f"{100 * rf['decode_attention_bw_fraction']:.0f}% of copy bandwidth")
            if "prefill_attention_tflop_s" in rf:
                parts.append(f"prefill attention {rf['prefill_attention_tflop_s']:.0f} TFLOP/s "
                             f"= {100 * rf['prefill_attention_peak_fraction']:.0f}% of peak")
            if "prefill_gemm_tflop_s" in rf:
                parts.append(f"prefill GEMMs {rf['prefill_gemm_tflop_s']:.0f} TFLOP/s = "
                             f"{100 * rf['prefill_gemm_peak_fraction']:.0f}% of peak")
            if rf.get("decode_step_roofline_fraction"):
                parts.append(f"whole decode step at batch {res['kernel_batch']}: "
                             f"{100 * rf['decode_step_roofline_fraction']:.0f}% of the memory "
                             f"roofline")
            console.print("roofline: " + "; ".join(parts))
        if "not_measured" in res:
            console.print(f"[yellow]note:[/] {res['not_measured']}")
    if len(results) > 1:
        _render_side_by_side(results, console)


def _render_side_by_side(results: list[dict[str, Any]], console: Console) -> None:
    t = Table(title="backends side by side", title_justify="left")
    t.add_column("metric")
    for res in results:
        t.add_column(res["backend"] + (" +graphs" if res["cuda_graphs"] else ""), justify="right")
    for i, row in enumerate(results[0]["batches"]):
        b = row["batch"]
        t.add_row(f"prefill tok/s @ batch {b}",
                  *[f"{r['batches'][i]['prefill_tok_s']:,.0f}" for r in results])
        t.add_row(f"decode step p50 ms @ batch {b}",
                  *[f"{r['batches'][i]['step_ms_p50']:.3f}" for r in results])
    for grp in ("attention", "GEMM"):
        t.add_row(f"decode {grp} share", *[
            f"{100 * r['phases']['decode']['groups_us'][grp] / (sum(r['phases']['decode']['groups_us'].values()) or 1):.0f}%"
            for r in results])
    console.print(t)


def charts(results: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """PNG charts: time by group per backend and phase; decode step time vs batch size."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    paths = []
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [r["backend"] + (" +graphs" if r["cuda_graphs"] else "") for r in results]
    for ax, phase in zip(axes, ("prefill", "decode")):
        bottom = [0.0] * len(results)
        for grp in kernel_stats.GROUPS:
            vals = [r["phases"][phase]["groups_us"][grp] / 1000 for r in results]
            if any(vals):
                ax.bar(names, vals, bottom=bottom, label=grp)
                bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_title(f"{phase}: time by kernel group (batch {results[0]['kernel_batch']})")
        ax.set_ylabel("ms per step (kernel groups stacked: the bar is their sum)")
        ax.set_ylim(bottom=0)
    axes[1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    paths.append(out_dir / "kernel_groups.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, r in zip(names, results):
        ax.plot([b["batch"] for b in r["batches"]], [b["step_ms_p50"] for b in r["batches"]],
                marker="o", label=name)
        if "decode_roofline_ms" in r["batches"][0]:
            ax.plot([b["batch"] for b in r["batches"]],
                    [b["decode_roofline_ms"] for b in r["batches"]], ls="--", color="gray",
                    label=f"{name} memory roofline")
    ax.set_xlabel("batch size (sequences decoding)")
    ax.set_ylabel("decode step p50 (ms, whole step: every kernel)")
    ax.set_ylim(bottom=0)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(f"decode step time vs batch size ({results[0]['model']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / "decode_step_vs_batch.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


# ---- the command ------------------------------------------------------------------------------

@cli_errors
def profile(
    profile_name: Optional[str] = typer.Option(None, "--profile",
                                               help="Run profile: name or YAML [default: tiny]."),
    backend: Optional[str] = typer.Option(None, help="Backend name, auto, or all (every "
                                                     "available backend but eager) "
                                                     "[default: auto]."),
    model: Optional[str] = typer.Option(
        None, help="Checkpoint directory or preset [default: the profile's]."),
    device: Optional[str] = typer.Option(None, help="auto, cpu, cuda or cuda:N [default: auto]."),
    dtype: Optional[str] = typer.Option(
        None, help="auto, float32, float16 or bfloat16 [default: auto: bfloat16 on a GPU]."),
    kv_cache_dtype: Optional[str] = typer.Option(None, help="auto or fp8 [default: auto]."),
    block_size: Optional[int] = typer.Option(
        None, help="Tokens per KV page [default: the backend's]."),
    batch_sizes: Optional[str] = typer.Option(
        None, help="Comma-separated, e.g. 1,8,64 [default: the profile's workload, else 1,4,16]."),
    prompt_len: Optional[int] = typer.Option(
        None, help="Prompt tokens [default: the profile's workload, else 64]."),
    shared_prefix_len: Optional[int] = typer.Option(
        None, help="Leading tokens every prompt of a batch shares (shows prefix caching) "
                   "[default: 0]."),
    output_len: Optional[int] = typer.Option(
        None, help="Decode steps per batch size at most [default: the profile's workload, "
                   "else 16]."),
    prompts: Optional[str] = typer.Option(
        None, help="JSONL prompt file instead of random prompts [default: random]."),
    warmup_steps: Optional[int] = typer.Option(None, help="[default: 2]"),
    measured_steps: Optional[int] = typer.Option(None, help="[default: 8]"),
    cuda_graphs: Optional[bool] = typer.Option(None, "--cuda-graphs/--no-cuda-graphs",
                                               help="[default: on]"),
    fused_kernels: Optional[bool] = typer.Option(
        None, "--fused-kernels/--no-fused-kernels",
        help="Norms, rotary and SwiGLU as fused Triton kernels on CUDA [default: on]."),
    prefix_caching: Optional[bool] = typer.Option(None, "--prefix-caching/--no-prefix-caching",
                                                  help="[default: on]"),
    cascade_attention: Optional[bool] = typer.Option(
        None, "--cascade-attention/--no-cascade-attention",
        help="Decode batches sharing prefix pages attend them once [default: on]."),
    tensor_parallel_size: Optional[int] = typer.Option(
        None, "--tensor-parallel-size", "-tp",
        help="Shard the model over this many GPUs (rank 0's kernels are reported) "
             "[default: 1]."),
    output_dir: Path = typer.Option(Path("pagedgen-profile"), help="Trace, JSON and charts."),
    seed: int = typer.Option(0),
) -> None:
    """Run a workload under torch.profiler; report kernel groups, phases and rooflines."""
    engine_cfg, _, prof = engine_and_sampling(
        profile_name, model, dict(device=device, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                                  block_size=block_size, seed=seed,
                                  fused_kernels=fused_kernels, prefix_caching=prefix_caching,
                                  cascade_attention=cascade_attention,
                                  tensor_parallel_size=tensor_parallel_size), {})
    wl = _workload(prof, dict(batch_sizes=batch_sizes, prompt_len=prompt_len,
                              shared_prefix_len=shared_prefix_len,
                              output_len=output_len, prompts=prompts,
                              warmup_steps=warmup_steps, measured_steps=measured_steps,
                              cuda_graphs=cuda_graphs))
    dev = engine_cfg.torch_device()
    if backend == "all":  # every fast path; eager is the reference, not a contender
        names = [s.name for s in backend_status(dev) if s.available and s.name != "eager"]
    else:
        names = [get_backend(backend or engine_cfg.backend, dev).name]
    output_dir.mkdir(parents=True, exist_ok=True)
    limits: dict[str, float] = {}
    console = out_console()
    if dev.type == "cuda":
        from pagedgen.runtime import hardware
        limits = {"copy_bw": hardware.copy_bandwidth(), "matmul": hardware.matmul_flops()}
    results = []
    for name in names:
        console.print(f"[bold]profiling {name}[/] ...")
        cfg = dataclasses.replace(engine_cfg, backend=name)
        if cfg.tensor_parallel_size > 1:
            results.append(_run_sharded(cfg, wl, output_dir, seed, limits))
        else:
            results.append(run_backend(cfg, wl, output_dir, seed, limits))
    render(results, console)
    pngs = charts(results, output_dir)
    summary = output_dir / "profile.json"
    summary.write_text(json.dumps({"workload": dataclasses.asdict(wl), "limits": limits,
                                   "results": results}, indent=2))
    console.print(f"wrote {summary}, {', '.join(str(p) for p in pngs)} and "
                  f"{', '.join(r['trace'] for r in results)} (open in Perfetto)")


def _run_sharded(cfg, wl: Workload, out_dir: Path, seed: int, limits: dict[str, float]
                 ) -> dict[str, Any]:
    """``run_backend`` on every rank of a tensor-parallel group (worker processes on GPUs
    0..N-1, or gloo on the CPU); rank 0's result."""
    from pagedgen.cli import data_parallel

    return data_parallel.run_on_ranks(_profile_worker, (cfg, wl, out_dir, seed, limits), cfg)


def _profile_worker(cfg, wl: Workload, out_dir: Path, seed: int, limits: dict[str, float],
                    inbox):
    yield run_backend(cfg, wl, out_dir, seed, limits)


def _workload(profile: dict | None, overrides: dict[str, Any]) -> Workload:
    from pagedgen.runtime.config import apply_fields

    profile = profile or {}
    lines = {k[len("workload."):]: v for k, v in (profile.get("_lines") or {}).items()
             if k.startswith("workload.")}
    wl = apply_fields(Workload(), profile.get("workload") or {},
                      profile.get("_path", "profile"), lines)
    given = {k: v for k, v in overrides.items() if v is not None}
    if isinstance(given.get("batch_sizes"), str):
        try:
            given["batch_sizes"] = [int(x) for x in given["batch_sizes"].split(",") if x]
        except ValueError:
            raise PagedgenError("--batch-sizes takes integers separated by commas, e.g. 1,8,64")
    wl = apply_fields(wl, given, "options")
    if not wl.batch_sizes or min(wl.batch_sizes) < 1:
        raise PagedgenError("batch sizes must be positive integers")
    wl.batch_sizes = sorted(set(wl.batch_sizes))
    if wl.measured_steps < 1 or wl.warmup_steps < 0 or wl.output_len < 3:
        raise PagedgenError("need measured_steps >= 1, warmup_steps >= 0 and output_len >= 3")
    return wl
