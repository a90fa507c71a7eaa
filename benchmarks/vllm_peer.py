"""vLLM as the benchmark peer, in a process of its own (its own site-packages: it pins other
versions of FlashInfer and friends than pagedgen's).

The parent writes the model's ``config.json`` (dummy weights, as pagedgen's presets) and a spec;
the worker regenerates the workload's token ids with ``workloads.py`` (the same ids pagedgen
runs), builds ``vllm.LLM`` once (start-up timed apart), then times ``LLM.generate`` over every
request in one call, ``repeats`` times, resetting its prefix cache before each run.

vLLM's dummy weights are uniform in +-1e-3 (norms included), pagedgen's normal with a standard
deviation of 0.02 (norms 1, biases 0): a MoE's router then spreads tokens over experts
differently in each, and a decode step reads a different share of the expert weights.
``weights=["dummy", "normal"]`` also runs every job after drawing vLLM's weights again in
pagedgen's distribution (``normal_weights``, in place in its worker: FP8 weights with one scale
per tensor), each run saying which weights it had. The worker runs in a process group of its
own (``run_in_group``: killed whole at a time limit) and writes its results after every run.

``engine`` may carry ``quantization="fp8"`` (``peers.py --quantization fp8``): vLLM then
quantizes the dummy weights at load, as ``pagedgen --quantization fp8`` does. ``requests``
(``structured.py``) gives the prompts, output lengths and each one's JSON schema (or None)
instead of a named workload, with a tokenizer directory: vLLM then constrains those requests
with its default structured-output backend (xgrammar), whitespace off as pagedgen's default.

Where vLLM lives: the current environment if it imports there, else ``$PAGEDGEN_VLLM_SITE``
(default ``/tmp/site-vllm``, where ``../shared/gpu/stage-wheels.sh vllm`` installs it).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pagedgen.cli.bench.peer import (
    NOT_INSTALLED,
    failure,
    kernel_lines,
    kv_capacity,
    peer_checkpoint,
    run_in_group,
    vllm_env,
    vllm_site,
)

HERE = Path(__file__).resolve().parent
# vLLM's tensor parallelism without the multicast-dependent paths: its custom all-reduce
# (which picks FlashInfer's mnnvl all-reduce there) and its all-reduce + RMSNorm fusion; at
# its defaults it crashed while capturing CUDA graphs on the 2 x H200 host (issue 62)
TP_SAFE = {"disable_custom_all_reduce": True,
           "compilation_config": {"pass_config": {"fuse_allreduce_rms": False}}}


def same_limits(engine_config: Any) -> dict[str, Any]:
    """vLLM engine arguments with pagedgen's batching limits (``EngineConfig``) and its
    ``max_model_len`` where set, prefix caching on (as both run by default); the
    ``max_num_seqs`` this device gives when the config leaves it to it
    (``EngineConfig.with_step_limits``)."""
    cfg = engine_config.with_step_limits()
    return dict(max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                enable_prefix_caching=True,
                **({"max_model_len": cfg.max_model_len} if cfg.max_model_len else {}))


def run_vllm(workload: str | dict[str, Any] | list, num_prompts: int | None, hf_config: Any,
             engine: dict[str, Any], repeats: int = 3, timeout: float = 590.0,
             requests: dict[str, Any] | None = None, tokenizer_dir: Path | None = None,
             sampling: dict[str, Any] | list[dict[str, Any]] | None = None,
             profile_dir: Path | None = None, weights: tuple[str, ...] = ("dummy",),
             checkpoint: Path | None = None) -> dict[str, Any]:
    """Run the workload on vLLM; ``{"skipped": reason}`` when vLLM is not installed.
    ``workload``: a name in workloads.py, or a Workload's fields (``num_prompts``,
    ``input_len``, ``output_len``), or a list of them run on one engine (each run says its
    ``workload``); ``sampling``: more SamplingParams fields for every request (``stop``,
    ``detokenize``), or a list of such sets, each run in turn (each run says its index).
    With ``tensor_parallel_size`` > 1 in ``engine`` vLLM's own worker processes start, with
    NVLink multicast off in each (``NO_MULTICAST``). With ``profile_dir``, the last run runs
    under vLLM's torch profiler, its workers' traces written there (``*.pt.trace.json.gz``).
    ``weights``: "dummy" (vLLM's) and/or "normal" (pagedgen's distribution), in that order.
    ``checkpoint``: a checkpoint folder (config, tokenizer, processor; no weights) taken whole
    instead of ``hf_config``'s; ``workload`` then names an image workload
    (``image_workloads.py``: each request an image, as ``multi_modal_data``)."""
    if list(weights) not in (["dummy"], ["normal"], ["dummy", "normal"]):
        raise ValueError(f"vLLM's weight sets run as dummy, normal or dummy,normal, not "
                         f"{','.join(weights)} (its dummy weights are gone once drawn again)")
    site = vllm_site()
    if site is None:
        return {"skipped": NOT_INSTALLED}
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        if checkpoint is not None:
            shutil.copytree(checkpoint, model)
            cfg = json.loads((model / "config.json").read_text())
        else:
            cfg, more = peer_checkpoint(model, hf_config)
            engine = {**engine, **more}
        vocab = cfg.get("text_config", cfg)["vocab_size"]
        if tokenizer_dir is not None:
            for f in Path(tokenizer_dir).iterdir():
                if f.name != "config.json" and f.is_file():
                    (model / f.name).write_bytes(f.read_bytes())
        spec = {"model": str(model), "workload": workload, "num_prompts": num_prompts,
                "vocab": vocab, "engine": engine, "repeats": repeats,
                "requests": requests,
                "tokenizer": tokenizer_dir is not None or checkpoint is not None,
                "images": checkpoint is not None,
                "sampling": sampling or {},
                "profile_dir": str(Path(profile_dir).resolve()) if profile_dir else None,
                "weights": list(weights)}
        (Path(tmp) / "spec.json").write_text(json.dumps(spec))
        # apply_model sends normal_weights to vLLM's engine process pickled
        env = vllm_env(site, VLLM_ALLOW_INSECURE_SERIALIZATION="1")
        out = Path(tmp) / "out.json"
        code, stdout, stderr = run_in_group(
            [sys.executable, "-m", "benchmarks.vllm_peer", str(Path(tmp) / "spec.json"),
             str(out)], timeout, env=env, cwd=HERE.parent)  # the repository: its package
        got = json.loads(out.read_text()) if out.exists() else {"runs": []}
        said = {"kernel_lines": kernel_lines(stdout + stderr), **kv_capacity(stdout + stderr)}
        if code == 0:
            return {**got, **said}
        if code is None and got["runs"]:  # the runs it measured before the limit
            return {**got, **said, "outran": f"vLLM outran {timeout:.0f} s after "
                                             f"{len(got['runs'])} runs"}
        if code is None:
            return {"skipped": f"vLLM outran {timeout:.0f} s before its first run",
                    "log": (stdout + stderr)[-4000:]}
        return failure(stdout, stderr)


def normal_weights(model: Any, std: float = 0.02, fp8_max: float = 448.0) -> int:
    """Draw a loaded vLLM model's weights again, in place, as pagedgen's dummy weights are
    drawn: normal(0, ``std``), norms 1, biases 0; an FP8 tensor gets such values quantized with
    one scale (its ``*_scale`` tensors filled with it). Quantization scales and integer
    (packed) tensors are left. Runs in vLLM's worker (``LLM.apply_model``); returns the count
    of tensors drawn."""
    import torch

    fp8 = {torch.float8_e4m3fn, torch.float8_e4m3fnuz}
    scale = 5 * std / fp8_max  # five standard deviations at the format's largest value
    gens: dict[torch.device, torch.Generator] = {}
    drawn = 0
    with torch.no_grad():
        for mod_name, module in model.named_modules():
            for name, p in list(module._parameters.items()):
                if p is None or not p.is_floating_point() or "scale" in name:
                    continue
                gen = gens.setdefault(p.device, torch.Generator(p.device).manual_seed(0))
                if p.dtype in fp8:
                    scales = [t for t in (getattr(module, f"{name}_scale", None),
                                          getattr(module, f"{name}_scale_inv", None))
                              if isinstance(t, torch.Tensor)]
                    if not scales:
                        continue
                    for part in (p if p.dim() > 1 else [p]):  # a slice at a time: little memory
                        part.copy_((torch.randn(part.shape, generator=gen, device=p.device)
                                    * (std / scale)).clamp_(-fp8_max, fp8_max).to(p.dtype))
                    for t in scales:
                        t.fill_(scale)
                elif "norm" in f"{mod_name}.{name}":
                    p.fill_(1.0)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    p.normal_(0.0, std, generator=gen)
                drawn += 1
    return drawn


def _worker(spec_path: str, out_path: str) -> None:
    t0 = time.perf_counter()
    import vllm

    from benchmarks.workloads import Workload, workload  # vLLM's process: no pagedgen imports

    spec = json.loads(Path(spec_path).read_text())
    given = spec.get("requests")
    # (workload label, prompts, output lengths, variants, temperature, n, each request's
    # multi_modal_data or None)
    jobs = []
    if given:  # each variant: every request's schema or None
        jobs.append(("", given["prompts"], given["outs"], given["variants"], 0.0, 1,
                     [None] * len(given["prompts"])))
    elif spec.get("images"):  # an image workload: the same ids and pixels as pagedgen's
        from benchmarks.image_workloads import image_workload
        iw = image_workload(spec["workload"], spec["num_prompts"])
        prompts, outs, numbers = iw.requests(spec["vocab"])
        pixels = {k: iw.image(k) for k in sorted(set(numbers))}
        jobs.append((spec["workload"], prompts, outs, {"": [None] * len(prompts)}, 0.0, 1,
                     [{"image": pixels[k]} for k in numbers]))
    else:
        names = spec["workload"] if isinstance(spec["workload"], list) else [spec["workload"]]
        for name in names:
            wl = workload(name, spec["num_prompts"]) if isinstance(name, str) else Workload(
                "custom", **{k: tuple(v) if isinstance(v, list) else v for k, v in name.items()})
            prompts, outs = wl.requests(spec["vocab"])
            jobs.append((name if isinstance(name, str) else f"{wl.num_prompts} prompts",
                         prompts, outs, {"": [None] * len(prompts)}, wl.temperature, wl.n,
                         [None] * len(prompts)))
    # SamplingParams fields for every request: one set, or a list of sets run one after another
    samplings = spec.get("sampling") or {}
    samplings = samplings if isinstance(samplings, list) else [samplings]
    extra = {}
    if given:  # JSON without free whitespace, as pagedgen's default (else vLLM pads forever)
        from vllm.config import StructuredOutputsConfig
        extra["structured_outputs_config"] = StructuredOutputsConfig(
            backend="xgrammar", disable_any_whitespace=True)
    if spec.get("profile_dir"):  # kernels only: no Python stacks, no front end
        extra["profiler_config"] = {"profiler": "torch", "ignore_frontend": True,
                                    "torch_profiler_dir": spec["profile_dir"],
                                    "torch_profiler_with_stack": False}
    llm = vllm.LLM(model=spec["model"], load_format="dummy",
                   skip_tokenizer_init=not spec.get("tokenizer"), dtype="bfloat16",
                   gpu_memory_utilization=0.9, seed=0, **spec["engine"], **extra)
    startup = time.perf_counter() - t0

    def structured(schema):
        if schema is None:
            return {}
        from vllm.sampling_params import StructuredOutputsParams
        return {"structured_outputs": StructuredOutputsParams(json=schema,
                                                              disable_any_whitespace=True)}

    runs: list[dict[str, Any]] = []

    def record(run: dict[str, Any]) -> None:  # the file after each run: a time limit keeps
        runs.append(run)                         # what was measured
        print(json.dumps({k: v for k, v in run.items() if k != "texts"}), file=sys.stderr,
              flush=True)
        Path(out_path).write_text(json.dumps({"vllm": vllm.__version__, "startup_s": startup,
                                              "engine": spec["engine"], "runs": runs}))

    sets = spec.get("weights") or ["dummy"]
    for k, weights in enumerate(sets):
        if weights == "normal":
            print(f"weights drawn again: {llm.apply_model(normal_weights)}", file=sys.stderr,
                  flush=True)
        _timed_runs(llm, spec, jobs, samplings, given, structured, weights, record,
                    profile_last=bool(spec.get("profile_dir")) and k == len(sets) - 1)


def _timed_runs(llm: Any, spec: dict[str, Any], jobs: list, samplings: list[dict[str, Any]],
                given: Any, structured: Any, weights: str,
                record: Callable[[dict[str, Any]], None], profile_last: bool) -> None:
    """Every job ``spec["repeats"]`` times, each run to ``record``; the last repeat under the
    profiler if asked."""
    import vllm
    from vllm.inputs import TokensPrompt

    from benchmarks.workloads import output_spread
    for repeat in range(spec["repeats"]):
        profiled = profile_last and repeat == spec["repeats"] - 1
        if profiled:
            llm.start_profile()
        for label, prompts, outs, variants, temperature, n, media in jobs:
            inputs = [TokensPrompt(prompt_token_ids=p, **({"multi_modal_data": m} if m else {}))
                      for p, m in zip(prompts, media)]
            images = sum(m is not None for m in media)
            for variant, schemas in variants.items():
                for k_opts, sampling in enumerate(samplings):
                    opts = {"detokenize": bool(given), **sampling}
                    params = [vllm.SamplingParams(max_tokens=k, ignore_eos=not given,
                                                  temperature=temperature, n=n,
                                                  seed=i if temperature else None,
                                                  **opts, **structured(s))
                              for i, (k, s) in enumerate(zip(outs, schemas))]
                    llm.reset_prefix_cache()  # every run starts cold, as the first
                    if images:  # its processed images too
                        llm.reset_mm_cache()
                    t = time.perf_counter()
                    results = llm.generate(inputs, params, use_tqdm=False)
                    wall = time.perf_counter() - t
                    tokens = sum(len(o.token_ids) for r in results for o in r.outputs)
                    record({"wall_time_s": wall, "output_tokens": tokens,
                            "output_tokens_per_s": tokens / wall, "variant": variant,
                            **({"images": images, "images_per_s": images / wall}
                               if images else {}),
                            "workload": label, "sampling": k_opts, "weights": weights,
                            **output_spread([list(o.token_ids) for r in results
                                             for o in r.outputs]),
                            **({"texts": [r.outputs[0].text for r in results[:64]]}
                               if given else {})})
        if profiled:
            llm.stop_profile()


if __name__ == "__main__":
    _worker(*sys.argv[1:3])
