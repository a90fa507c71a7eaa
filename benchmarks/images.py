"""Images in batch, pagedgen against vLLM (issue 96): a Qwen3.5 multimodal checkpoint at a
preset's language-model shapes with the published vision tower, dummy weights in both systems
(vLLM's drawn again in pagedgen's distribution), the requests of an image workload
(``image_workloads.py``: the same token ids and pixels in both), each system at its defaults.

The checkpoint folder holds no weights: ``config.json`` (the preset's text config under
``text_config``, transformers' Qwen3.5 vision config with its output as wide as the text
model, the image tokens at Qwen's ids), a word-level tokenizer of the text model's vocabulary
holding the image tokens, and Qwen's processor (image processor at Qwen3.5's published pixel
bounds; a video processor, which vLLM's processor takes). Both systems get PIL images, a token
prompt with one image placeholder, EOS ignored, greedy; each run starts cold (prefix caches and
pagedgen's image-embedding cache forgotten).

    python -m benchmarks.images --preset qwen3.5-9b --workload i --num-prompts 500 \\
        --profiled --json $OUT/images.json

``--profiled``: one more run of each system under torch.profiler: pagedgen's GPU idle time
between kernels and its share of the run (the issue's "GPU idle under 5%"), and both systems'
GPU seconds by kernel group side by side (``run_kernels.side_by_side``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import free_gpu, parse_overrides
from benchmarks.image_workloads import SPECIAL, ImageWorkload, image_workload

# Qwen3.5's image processor (the published preprocessor_config.json): patches of 16 merged
# 2 x 2, pixels between these bounds
PIXELS = {"shortest_edge": 65536, "longest_edge": 16777216}


def write_checkpoint(folder: Path, preset: str, vision: dict[str, Any] | None = None
                     ) -> dict[str, Any]:
    """The multimodal checkpoint folder of ``preset`` (a Qwen3.5 text preset, or a text
    checkpoint folder) at ``folder`` (made); ``vision``: fields of the vision config other
    than the published ones (the tests' small tower). Returns its config."""
    import transformers as tf
    from tokenizers import Tokenizer, models

    from pagedgen.cli.bench.peer import peer_config
    from pagedgen.runtime.models.loader import resolve_model

    hf = resolve_model(preset).hf_config
    cfg, _ = peer_config(hf)  # the text config as vLLM's multimodal outer config holds it
    text = cfg["text_config"]
    cfg.update(vision_config=tf.Qwen3_5VisionConfig(
                   **{**(vision or {}), "out_hidden_size": text["hidden_size"]}).to_dict(),
               image_token_id=SPECIAL["<|image_pad|>"],
               video_token_id=SPECIAL["<|video_pad|>"],
               vision_start_token_id=SPECIAL["<|vision_start|>"],
               vision_end_token_id=SPECIAL["<|vision_end|>"])
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    names = {i: name for name, i in SPECIAL.items()}
    ends = {text.get("bos_token_id"): "<s>", text.get("eos_token_id"): "</s>"}
    vocab = {names.get(i) or ends.get(i) or f"w{i}": i for i in range(text["vocab_size"])}
    tok = tf.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="w0")),
        bos_token="<s>", eos_token="</s>", unk_token="w0", pad_token="w0",
        additional_special_tokens=list(SPECIAL))
    tok.save_pretrained(folder)
    tf.Qwen2VLImageProcessor(patch_size=16, merge_size=2, temporal_patch_size=2, size=PIXELS,
                             image_mean=[0.5] * 3, image_std=[0.5] * 3).save_pretrained(folder)
    # written, not made: transformers' video processor needs torchvision to be built (vLLM's
    # site has it; pagedgen's need not)
    (folder / "video_preprocessor_config.json").write_text(json.dumps(
        {"video_processor_type": "Qwen3VLVideoProcessor", "processor_class": "Qwen3VLProcessor",
         "patch_size": 16, "merge_size": 2, "temporal_patch_size": 2,
         "image_mean": [0.5] * 3, "image_std": [0.5] * 3}))
    (folder / "processor_config.json").write_text(json.dumps(
        {"processor_class": "Qwen3VLProcessor"}))
    return cfg


def pagedgen_runs(folder: Path, wl: ImageWorkload, repeats: int,
                  engine_options: dict[str, Any] | None = None,
                  profiled: bool = False) -> dict[str, Any]:
    """The workload through ``pagedgen.LLM`` on dummy weights, ``repeats`` times, each from
    cold caches: each run's summary (images, the vision tower's share, throughput);
    ``profiled``: then one more under torch.profiler, for where the GPU waited (its idle
    time between kernels: ``run_kernels.idle_table``) and its kernel groups (both empty on a
    CPU)."""
    from pagedgen.runtime.api import LLM

    t0 = time.perf_counter()
    llm = LLM(model=str(folder), load_format="dummy", **(engine_options or {}))
    startup = time.perf_counter() - t0
    engine = llm.engine
    prompts, outs, numbers = wl.requests(engine.src.hf_config.vocab_size)
    pixels = {n: wl.image(n) for n in sorted(set(numbers))}
    requests = [{"prompt_token_ids": p, "multi_modal_data": {"image": pixels[n]},
                 "max_tokens": k, "ignore_eos": True, "temperature": 0.0}
                for p, k, n in zip(prompts, outs, numbers)]

    def run() -> dict[str, Any]:
        engine.reset_prefix_cache()
        engine.reset_stats()
        start = time.perf_counter()
        got = llm.generate(requests, use_tqdm=False)
        wall = time.perf_counter() - start
        res = engine.summary(wall, start)
        res["output_tokens"] = sum(len(r.outputs[0].token_ids) for r in got)
        res["images"] = len(requests)
        res["images_per_s"] = len(requests) / wall
        return res

    out = {"system": "pagedgen", "startup_s": startup, "runs": [run() for _ in range(repeats)]}
    return {**out, **(profiled_run(run) if profiled else {})}


def profiled_run(run) -> dict[str, Any]:
    """``run()`` (a summary with its ``wall_time_s``) under torch.profiler: the GPU's idle time
    between kernels and its share of the run's wall time (``idle``), and its kernels' table
    (``run_kernels``'s: seconds by group, the heaviest); {} without CUDA."""
    import torch

    from benchmarks.run_kernels import idle_table, under_profiler
    from pagedgen.runtime.kernel_stats import kernel_table, named

    if not torch.cuda.is_available():
        return {}
    res, kernels = under_profiler(run)
    idle = idle_table(kernels, res["wall_time_s"])
    return {"idle": {**idle, "wall_time_s": res["wall_time_s"],
                     "idle_share": idle.get("idle_s", 0.0) / res["wall_time_s"]},
            **kernel_table(named(kernels))}


def vllm_runs(folder: Path, workload: str, num_prompts: int, repeats: int,
              timeout: float, profiled: bool = False) -> dict[str, Any]:
    """The same requests through vLLM in its own process (``vllm_peer``'s image jobs);
    ``profiled``: one more run under its torch profiler, its kernels' table."""
    from benchmarks.run_kernels import trace_kernels
    from benchmarks.vllm_peer import run_vllm
    from pagedgen.runtime.kernel_stats import kernel_table

    with tempfile.TemporaryDirectory() as d:
        res = run_vllm(workload, num_prompts, None, {}, repeats=repeats + profiled,
                       timeout=timeout, weights=("normal",), checkpoint=folder,
                       profile_dir=Path(d) if profiled else None)
        traces = sorted(Path(d).rglob("*.pt.trace.json*"))
        if profiled and len(res.get("runs", [])) > repeats and traces:
            res = {**res, "runs": res["runs"][:repeats],
                   "profiled_wall_s": res["runs"][-1]["wall_time_s"],
                   **kernel_table(trace_kernels(traces))}
    return res


FIELDS = ("output_tokens_per_s", "images_per_s", "wall_time_s", "prefill_tokens_per_s",
          "vision_encoder_s", "vision_encoder_share", "image_pixel_wait_s", "images_encoded",
          "image_cache_hits", "preemptions")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3.5-9b")
    ap.add_argument("--workload", default="i", help="i, or ir (a quarter of images repeat)")
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--systems", default="pagedgen,vllm")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="pagedgen's engine options (e.g. device=cpu, dtype=float32)")
    ap.add_argument("--vllm-timeout", type=float, default=560.0)
    ap.add_argument("--folder", type=Path, default=None,
                    help="where the checkpoint folder goes (default: a temporary one)")
    ap.add_argument("--profiled", action="store_true",
                    help="one more run of each under torch.profiler: pagedgen's GPU idle time, "
                         "both systems' kernel groups")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    wl = image_workload(args.workload, args.num_prompts)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.folder or Path(tmp) / "model"
        write_checkpoint(folder, args.preset)
        for system in args.systems.split(","):
            if system == "pagedgen":
                rows.append(pagedgen_runs(folder, wl, args.repeats, parse_overrides(args.set),
                                          args.profiled))
            elif system == "vllm":
                rows.append({"system": "vllm", **vllm_runs(
                    folder, args.workload, wl.num_prompts, args.repeats, args.vllm_timeout,
                    args.profiled)})
            if args.json:  # after each system: a time limit keeps what was measured
                args.json.write_text(json.dumps({"preset": args.preset,
                                                 "workload": args.workload,
                                                 "num_prompts": wl.num_prompts,
                                                 "rows": rows}, indent=2, default=str))
            free_gpu()
    if any("groups_s" in r for r in rows):
        from benchmarks.run_kernels import side_by_side

        print("\n".join(side_by_side([r for r in rows if "groups_s" in r])), file=sys.stderr)
    for row in rows:
        print(f"{row['system']}: start-up {row.get('startup_s', 0):.1f} s"
              + (f"; {row['skipped']}" if "skipped" in row else ""), file=sys.stderr)
        if row.get("idle"):
            idle = row["idle"]
            print(f"  GPU idle {idle['idle_s']:.3f} s of a profiled run's "
                  f"{idle['wall_time_s']:.3f} s ({idle['idle_share']:.1%}; "
                  f"{idle['gaps_over_1ms']} gaps over 1 ms)", file=sys.stderr)
        for run in row.get("runs", []):
            print("  " + ", ".join(f"{k} {run[k]:,.3f}" if isinstance(run[k], float)
                                   else f"{k} {run[k]}" for k in FIELDS if k in run),
                  file=sys.stderr)


if __name__ == "__main__":
    main()
