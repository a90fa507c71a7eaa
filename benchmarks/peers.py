"""pagedgen against what a user would run instead, on the same GPU and model in one run (issue 8).

Systems: pagedgen with each available GPU backend (CUDA graphs on); vLLM (``vllm_peer.py``: a
process of its own, the same token ids, pagedgen's ``max_num_seqs`` and
``max_num_batched_tokens``, prefix caching on in both, start-up reported apart; skipped with the
reason where it is not installed; a row on its own dummy weights and one on them drawn again in
pagedgen's distribution, from one engine: ``--vllm-weights``); and Hugging Face transformers
with the same dummy-weight model: ``model.generate`` over padded static batches, and its
continuous-batching paged path (``generate_batch``'s manager, ``paged|sdpa``) where the
installed version has it. Same prompts (token ids), same output lengths (EOS ignored), greedy.

Dummy weights are not neutral for a MoE: on vLLM's (uniform in +-1e-3, norms included) its
router spreads a decode step's tokens over fewer experts than on pagedgen's (normal, 0.02), so
the step reads fewer expert weights, and gpt-oss's greedy sequences all write the same few
tokens; the row on pagedgen's distribution compares like with like.

Workloads (``--workloads a,b,c``; workloads.py):
  a: Llama-3-8B-shaped, bf16, 256 prompts x random 128-1024 input, 256 output tokens
  b: Llama-3-8B-shaped, bf16, 64 prompts x 2048 input, 128 output tokens
  c: Qwen3-0.6B-shaped, bf16, 256 prompts x random 100-1024 input and output (nano-vllm's setup)
  d: Llama-3-8B-shaped, 512 prompts x (1,536 shared + 128 unique) input, 128 output
  p: Llama-3-8B-shaped, 128 prompts x 1,024 input, n = 8 samples x 256 output, temperature 1
  s: Llama-3-8B-shaped, 1,000 requests behind 4 system prompts (400-800 tokens), 20-600 own
     tokens, 16-512 output
  q: Llama-3-8B-shaped, 4 questions about each of 256 documents of 1,024 tokens, listed
     question by question, 32 output, both systems in a KV cache of 196,608 tokens
  (and the families' own: workloads.py's table, e.g. u and w: Gemma-4-31B on a's shape and on
  16 prompts of 8k-30k tokens)

Each figure is the median of ``--repeats`` runs (``--peer-repeats`` for transformers, whose runs
are long). Beside the measured time it prints a roofline estimate (``roofline.py``: prefill
FLOPs / measured matmul FLOP/s + for each decode step of an ideal schedule, max(bytes / measured
copy bandwidth, FLOPs / matmul FLOP/s), each layer by its kind); a shared prefix (d) is
prefilled once and its K/V read once per decode step, as prefix caching and cascade decode do.

    python -m benchmarks.peers --json benchmarks/results/h100-peers.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    decode_tile_env,
    free_gpu,
    median_run,
    parse_overrides,
    print_table,
    profile_configs,
    run_engine,
)
from benchmarks.roofline import kv_bytes_per_token, roofline_s
from benchmarks.vllm_peer import run_vllm, same_limits
from benchmarks.workloads import SPREAD_KEYS, WORKLOADS, Workload
from pagedgen.attention.registry import backend_status
from pagedgen.runtime.hardware import copy_bandwidth, matmul_flops
from pagedgen.runtime.models.loader import resolve_model

# ---- Hugging Face transformers ------------------------------------------------------------------

def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def hf_model(hf_config, device: str = "cuda"):
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config.to_transformers(), dtype=torch.bfloat16,
                                                 attn_implementation="sdpa")
    return model.eval()


def hf_padded(model, prompts: list[list[int]], outs: list[int], batch_size: int) -> float:
    """``model.generate`` over static batches in input order, left-padded; each batch runs to
    its longest requested output. Returns seconds."""
    from transformers import GenerationConfig

    sync()
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        chunk, n_new = prompts[i:i + batch_size], max(outs[i:i + batch_size])
        width = max(map(len, chunk))
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for row, p in enumerate(chunk):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        gen = GenerationConfig(max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                               pad_token_id=0, eos_token_id=None)
        with torch.inference_mode():
            model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                           generation_config=gen)
    sync()
    return time.perf_counter() - t0


def hf_continuous(model, prompts: list[list[int]], outs: list[int],
                  cache_blocks: int | None = None) -> float:
    """transformers' continuous batching (paged KV cache), each request with its own output
    length. Its warm-up (CUDA-graph capture) is excluded, as pagedgen's is. Returns seconds.
    ``cache_blocks``: its KV cache's size in pages (default: sized from free memory, which on
    a CPU is the host's RAM: gigabytes)."""
    from transformers import GenerationConfig

    gen = GenerationConfig(max_new_tokens=max(outs), do_sample=False, eos_token_id=-1)
    kw: dict[str, Any] = {}
    if cache_blocks is not None:
        from transformers import ContinuousBatchingConfig

        kw["continuous_batching_config"] = ContinuousBatchingConfig(
            num_blocks=cache_blocks, max_batch_tokens=256)
    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints
        kw["workload_hints"] = WorkloadHints(max(map(len, prompts)), max(outs), len(prompts))
    except ImportError:
        pass
    with model.continuous_batching_context_manager(generation_config=gen, block=True,
                                                   timeout=30, **kw) as manager:
        sync()
        t0 = time.perf_counter()
        ids = {manager.add_request(p, max_new_tokens=n): n for p, n in zip(prompts, outs)}
        done = 0
        while done < len(ids):
            r = manager.get_result(timeout=1)
            if r is not None and r.is_finished():
                assert len(r.generated_tokens) == ids[r.request_id], "output length differs"
                done += 1
            elif r is None and not manager.is_running():
                raise RuntimeError("transformers' continuous-batching loop stopped")
        wall = time.perf_counter() - t0
    return wall


# ---- one workload -------------------------------------------------------------------------------

# a pagedgen setting measured against the default: (label suffix, EngineConfig overrides)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "cascade-off": (", cascade decode off", {"cascade_attention": False}),
    "mixed-cascade-off": (", no cascade in steps with prefills", {"cascade_mixed_steps": False}),
    "mixed-ahead-off": (", mixed steps not ahead", {"mixed_steps_ahead": False}),
    "mixed-eager": (", mixed steps eager", {"mixed_step_graphs": False}),
    "prefix-grouping-off": (", prefix grouping off", {"prefix_grouping": False}),
    "batch-invariant": (", --batch-invariant", {"batch_invariant": True}),
}


def same_kv_cache(cfg: Any, wl: Workload, hf_config: Any) -> Any:
    """``cfg`` (an ``EngineConfig``) with the workload's KV-cache size in tokens, where it sets
    one: both systems then hold the same."""
    if not wl.kv_cache_tokens:
        return cfg
    return replace(cfg, kv_cache_memory=wl.kv_cache_tokens * kv_bytes_per_token(hf_config))


def vllm_engine(wl: Workload, quantization: str | None = None,
                overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """vLLM's engine arguments for ``wl``: pagedgen's batching limits (its profile's config
    with ``overrides``), FP8 where asked, the workload's KV-cache size in tokens."""
    cfg, _ = profile_configs(wl.profile)
    cfg = replace(cfg, **(overrides or {}))
    engine = {**same_limits(cfg), **({"quantization": quantization} if quantization else {}),
              **({"kv_cache_dtype": "fp8"} if str(cfg.kv_cache_dtype).startswith("fp8") else {})}
    if wl.kv_cache_tokens:
        engine.update(block_size=16, num_gpu_blocks_override=wl.kv_cache_tokens // 16)
    return engine


def run_workload(name: str, wl: Workload, backends: list[str], peers: list[str], repeats: int,
                 peer_repeats: int, hf_batch: int, flops: float, bw: float,
                 rows: list[dict], save: Callable[[], None], fa4_tiles: list[str],
                 quantization: str | None = None, variants: list[str] = (),
                 overrides: dict[str, Any] | None = None,
                 vllm_weights: tuple[str, ...] = ("dummy",)) -> None:
    """Measure every system on workload ``name``, appending a row (and saving) after each;
    flash-attn once per FA4 decode tile in ``fa4_tiles`` (none: as configured); with
    ``quantization`` (fp8), pagedgen and vLLM both quantize the weights at load; each backend
    once more per name in ``variants`` (``VARIANTS``: a setting against the default);
    ``overrides`` (``--set``) change the profile's engine config for every pagedgen run, and
    vLLM takes its batching limits from the changed config. Workloads with ``n`` > 1 sample at
    their temperature (request ``i`` seeded ``i``, in both systems). vLLM gives a row per
    weight set of ``vllm_weights`` ("normal": its weights drawn again in pagedgen's
    distribution, ``vllm_peer.normal_weights``), one engine for all."""
    overrides = overrides or {}
    src = resolve_model(wl.profile)
    prompts, outs = wl.requests(src.hf_config.vocab_size)
    in_tok, out_tok = sum(map(len, prompts)), wl.output_tokens(outs)
    fp8_flops = None
    if quantization:
        from pagedgen.runtime.hardware import fp8_matmul_flops
        fp8_flops = fp8_matmul_flops()
    # n samples counted as n requests (their prompt's prefill too: an upper estimate there)
    bound = roofline_s(src.hf_config, [p for p in prompts for _ in range(wl.n)],
                       [o for o in outs for _ in range(wl.n)], flops, bw, wl.shared_prefix_len,
                       fp8_flops)
    print(f"workload {name}: {wl}; {in_tok:,} prompt + {out_tok:,} output tokens; roofline "
          f"estimate {bound:.2f} s", flush=True)
    first = len(rows)

    def add_ratios() -> None:  # each row's output tokens/s over each peer's, same workload
        for r in rows[first:]:
            for p in rows[first:]:
                if p["system"].startswith(("HF", "vLLM")):
                    r[f"vs {p['system']}"] = r["output_tokens_per_s"] / p["output_tokens_per_s"]

    def row(system: str, wall: float, extra: dict[str, Any]) -> None:
        r = {"workload": name, "system": system, "wall_time_s": wall,
             "output_tokens_per_s": out_tok / wall, "total_tokens_per_s": (in_tok + out_tok) / wall,
             "roofline_s": bound, "x_roofline": wall / bound, **extra}
        print(json.dumps(r), flush=True)
        rows.append(r)
        add_ratios()
        save()

    runs_of = [(b, t, v) for b in backends
               for t in (fa4_tiles if b == "flash-attn" else []) or [None]
               for v in [None, *variants]]
    for b, tile, variant in runs_of:
        cfg, sampling = profile_configs(wl.profile, backend=b, quantization=quantization)
        suffix, changes = VARIANTS[variant] if variant else ("", {})
        cfg = same_kv_cache(replace(cfg, **{**overrides, **changes}), wl, src.hf_config)
        params = wl.sampling_params(sampling, outs)
        with decode_tile_env(tile):
            runs = run_engine(cfg, prompts, params, copy_bw=bw, repeats=repeats)
        assert all(r["output_tokens"] == out_tok for r in runs), "pagedgen output length differs"
        free_gpu()
        res = median_run(runs)
        label = f"pagedgen {b}" + (f" {quantization}" if quantization else "") + suffix
        row(label + (f" (FA4 decode tile {tile})" if tile else ""), res["wall_time_s"], {
            k: res[k] for k in ("backend", "kernel_plans", "runs_output_tokens_per_s",
                                "decode_roofline_fraction",
                                "decode_step_ms", "peak_memory_bytes", "block_size",
                                "decode_host_ms_per_step", "attention_warmup_s",
                                "graph_capture_s", "load_time_s", "startup_breakdown_s",
                                "max_num_seqs", "graphs_captured_in_run",
                                "graph_capture_in_run_s", "graph_warmups_in_run",
                                "prefill_tokens_per_s", "decode_tokens_per_s", "steps",
                                "decode_steps", "steps_launched_ahead", "cascade_decode_steps",
                                "cascade_steps_with_prefills",
                                "cascade_groups_per_step", "cascade_levels_per_step",
                                "decode_kv_read_gb_per_step", "decode_kv_plain_gb_per_step",
                                "mixed_graph_steps", "mixed_graph_buckets",
                                "mixed_graph_capture_s", "mixed_graph_failed",
                                "kernels_compiled_at_startup", "kernel_compile_at_startup_s",
                                "runs_kernels_compiled", "runs_kernel_compile_s",
                                "first_run_slowest_compiles", "first_run_compiles_s",
                                "runs_detail", "preemptions", "kv_cache_bytes",
                                "kv_cache_token_slots", "kv_peak_tokens_held", *SPREAD_KEYS)
            if k in res})
    if "vllm" in peers:
        engine = vllm_engine(wl, quantization, overrides)
        res = run_vllm(name, None, src.hf_config, engine, repeats=repeats, weights=vllm_weights)
        if "skipped" in res:
            print(f"vLLM: {res['skipped']}", flush=True)
            print(res.get("log", ""), file=sys.stderr, flush=True)
        assert all(r["output_tokens"] == out_tok for r in res.get("runs", [])), \
            "vLLM output length differs"
        if "outran" in res:
            print(f"vLLM: {res['outran']}", flush=True)
        for weights in vllm_weights if "runs" in res else ():
            measured = [r for r in res["runs"] if r.get("weights", "dummy") == weights]
            if not measured:
                continue
            mid = median_run(measured)
            row(f"vLLM {res['vllm']}" + (f" {quantization}" if quantization else "")
                + (" VLLM_BATCH_INVARIANT=1" if os.environ.get("VLLM_BATCH_INVARIANT") == "1"
                   else "")
                + (" (pagedgen's weight distribution)" if weights == "normal" else ""),
                mid["wall_time_s"], {
                "runs_output_tokens_per_s": mid["runs_output_tokens_per_s"],
                "startup_s": res["startup_s"], "max_num_seqs": engine["max_num_seqs"],
                **{k: mid[k] for k in SPREAD_KEYS if k in mid},
                **{k: res[k] for k in ("vllm_kv_cache_tokens", "vllm_max_concurrency")
                   if k in res},
                "kernel_lines": res.get("kernel_lines", [])})
    hf_peers = [p for p in peers if p != "vllm"]
    if hf_peers:
        model = hf_model(src.hf_config)
        for peer in hf_peers:
            if peer == "hf-continuous" and not hasattr(model,
                                                       "continuous_batching_context_manager"):
                print("transformers has no continuous batching here; skipped", flush=True)
                continue

            def once() -> dict[str, Any]:
                torch.cuda.reset_peak_memory_stats()
                wall = (hf_padded(model, prompts, outs, hf_batch) if peer == "hf-generate"
                        else hf_continuous(model, prompts, outs))
                free_gpu()
                return {"output_tokens_per_s": out_tok / wall, "wall_time_s": wall,
                        "peak_memory_bytes": torch.cuda.max_memory_allocated()}

            res = median_run([once() for _ in range(peer_repeats)])
            label = f"HF generate (padded, batch {hf_batch})" if peer == "hf-generate" \
                else "HF generate_batch (paged|sdpa)"
            row(label, res["wall_time_s"], {
                k: res[k] for k in ("runs_output_tokens_per_s", "peak_memory_bytes")})
        del model
        free_gpu()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="a,b,c")
    ap.add_argument("--backends", default="auto",
                    help="comma list (empty: peers only; default: the one pagedgen picks "
                         "for the model), or auto: every available GPU backend but "
                         "sdpa/eager")
    ap.add_argument("--peers", default="vllm,hf-generate,hf-continuous",
                    help="comma list of vllm, hf-generate, hf-continuous; empty for none")
    ap.add_argument("--fa4-decode-tiles", default="",
                    help="flash-attn once per FA4 decode tile, e.g. fa4,64x128 "
                         "($PAGEDGEN_FA4_DECODE_TILE)")
    ap.add_argument("--quantization", choices=["fp8"], default=None,
                    help="pagedgen --quantization fp8 against vLLM quantization='fp8'")
    ap.add_argument("--cascade-off", action="store_true",
                    help="each backend once more with cascade decode off")
    ap.add_argument("--mixed-cascade-off", action="store_true",
                    help="each backend once more with the decodes of steps that carry "
                         "prefills attending their shared pages each (no cascade there)")
    ap.add_argument("--mixed-ahead-off", action="store_true",
                    help="each backend once more with steps that carry prefills launched "
                         "after the last step's tokens are on the host")
    ap.add_argument("--mixed-eager", action="store_true",
                    help="each backend once more with steps that carry prefills run eagerly "
                         "(not in piecewise CUDA graphs)")
    ap.add_argument("--prefix-grouping-off", action="store_true",
                    help="each backend once more admitting requests in input order")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="each backend once more in --batch-invariant mode (issue 97; vLLM's "
                         "own mode: VLLM_BATCH_INVARIANT=1 in the environment)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="an engine config override for every pagedgen run (repeatable); "
                         "vLLM takes max_num_seqs and max_num_batched_tokens from it")
    ap.add_argument("--vllm-weights", default="dummy,normal",
                    help="comma list: dummy (vLLM's own), normal (its weights drawn again in "
                         "pagedgen's distribution: a MoE routes as in pagedgen); a row each")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--peer-repeats", type=int, default=1)
    ap.add_argument("--hf-batch", type=int, default=64)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("peers.py needs a CUDA GPU")
    backends = [b for b in args.backends.split(",") if b] if args.backends != "auto" else [
        s.name for s in backend_status(torch.device("cuda"))
        if s.available and s.name not in ("sdpa", "eager")]
    backends = ["auto" if b == "default" else b for b in backends]  # what pagedgen picks
    peers = [p for p in args.peers.split(",") if p]
    bw, flops = copy_bandwidth(), matmul_flops()
    import transformers
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "transformers": transformers.__version__, "copy_bw_tb_s": bw / 1e12,
            "matmul_tflop_s": flops / 1e12, "date": time.strftime("%Y-%m-%d"),
            "command": " ".join(sys.argv), "overrides": parse_overrides(args.set)}
    print(json.dumps(meta), flush=True)
    rows: list[dict] = []

    def save() -> None:  # after every row, so a crash or a time limit keeps what was measured
        if args.json:
            args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))

    for name in args.workloads.split(","):
        run_workload(name, WORKLOADS[name], backends, peers, args.repeats, args.peer_repeats,
                     args.hf_batch, flops, bw, rows, save,
                     [t for t in args.fa4_decode_tiles.split(",") if t], args.quantization,
                     [v for v in VARIANTS if getattr(args, v.replace("-", "_"))],
                     parse_overrides(args.set), tuple(args.vllm_weights.split(",")))
    ratio_cols = sorted({k for r in rows for k in r if k.startswith("vs ")})
    print_table(f"pagedgen vs peers on {meta['gpu']}", rows,
                ["workload", "system", "output_tokens_per_s", "total_tokens_per_s",
                 *ratio_cols, "wall_time_s", "roofline_s", "x_roofline",
                 "decode_roofline_fraction", "peak_memory_bytes"])


if __name__ == "__main__":
    main()
