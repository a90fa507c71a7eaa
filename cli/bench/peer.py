"""vLLM as a peer of ``pagedgen bench throughput --peer vllm``: the same random token ids
through ``vllm.LLM`` in a process of its own (vLLM pins other versions of FlashInfer and friends
than pagedgen's, so it may live in a site of its own: the current environment if it imports
there, else ``$PAGEDGEN_VLLM_SITE``, default ``/tmp/site-vllm``), each system at its defaults,
vLLM's start-up timed apart. A preset runs on dummy weights in both (vLLM's own draw); a
checkpoint directory on its weights. The launch, the config vLLM loads for a preset and what
its log says (its kernel choices, its KV capacity) are shared with ``benchmarks/vllm_peer.py``,
the benchmarks' peer (workloads, weights drawn as pagedgen's, constrained output).

    python -m pagedgen.cli.bench.peer SPEC OUT      (the worker, in vLLM's environment)
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from pagedgen import envs

# NVLink multicast off in vLLM's processes too (pagedgen's: runtime/collectives/parallel.py):
# its NVLS all-reduce paths fail on the lent multi-GPU hosts
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
                 "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                 "phi3": "Phi3ForCausalLM", "qwen3_next": "Qwen3NextForCausalLM",
                 "gpt_oss": "GptOssForCausalLM", "gemma4_text": "Gemma4ForCausalLM"}
# text-only families vLLM registers only as their multimodal checkpoints: the text config
# goes under ``text_config`` and vLLM runs with ``language_model_only`` (no vision tower)
MULTIMODAL = {"qwen3_5_text": ("qwen3_5", "Qwen3_5ForConditionalGeneration"),
              "qwen3_5_moe_text": ("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration")}


def vllm_site() -> str | None:
    """'' when vLLM imports here, a site directory holding it, or None when there is none."""
    if importlib.util.find_spec("vllm") is not None:
        return ""
    site = envs.VLLM_SITE.get() or "/tmp/site-vllm"
    return site if (Path(site) / "vllm").is_dir() else None


def site_path(site: str) -> str:
    """The PYTHONPATH of a vLLM installed into ``site`` with ``pip --target``: the site, and
    the CuTe DSL's packages there (``nvidia-cutlass-dsl``, which vLLM pins, finds them through
    a .pth file such an install does not run)."""
    dsl = Path(site) / "nvidia_cutlass_dsl" / "dsl_packages"
    return f"{site}:{dsl}" if dsl.is_dir() else site


def peer_config(hf_config: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``config.json`` vLLM loads for ``hf_config`` (a preset's: dummy weights), and what
    its engine needs besides: a multimodal family's text config under ``text_config`` with
    ``language_model_only``; Gemma
    4's global layers' head size and KV heads as vLLM reads them (``getattr(config,
    "global_head_dim")``), set by ``hf_overrides`` on the config transformers made, since
    transformers 5.x turns the published keys into ``per_layer_config`` (leaving
    ``global_head_dim`` None) and raises where vLLM reads ``head_dim`` of a config whose
    layers differ unless ``allow_global_per_layer_attribute_access`` is set."""
    cfg, more = hf_config.to_transformers().to_dict(), {}
    wide = {key: getattr(hf_config, key) for key in ("global_head_dim",
                                                    "num_global_key_value_heads")
            if getattr(hf_config, key, None) is not None}
    if wide:
        cfg.update(wide)
        cfg["allow_global_per_layer_attribute_access"] = True
        more["hf_overrides"] = {**wide, "allow_global_per_layer_attribute_access": True}
    if cfg["model_type"] in MULTIMODAL:
        outer, arch = MULTIMODAL[cfg["model_type"]]
        rope = cfg["rope_parameters"]  # the published configs' multimodal rope; text
        half = int(cfg["head_dim"] * rope.get("partial_rotary_factor", 1.0)) // 2
        third = -(-half // 3)  # positions equal in all three sections for text
        rope.setdefault("mrope_section", [third, third, half - 2 * third])
        rope.setdefault("mrope_interleaved", True)
        cfg = {"model_type": outer, "architectures": [arch], "text_config": cfg,
               "tie_word_embeddings": cfg.get("tie_word_embeddings", False)}
        more["language_model_only"] = True
    else:
        cfg["architectures"] = [ARCHITECTURES[cfg["model_type"]]]
    return cfg, more


# what vLLM's logger puts before a line: the engine process, then level, time and source
LOG_PREFIX = re.compile(r"^(\(EngineCore[^)]*\) )?(((?P<warning>WARNING)|DEBUG|INFO|ERROR"
                        r"|CRITICAL) \d\d-\d\d \S+ \[[^\]]*\] )?")


def failure(stdout: str, stderr: str) -> dict[str, str]:
    """A failed vLLM run's report: the first traceback's error (EngineCore's, logged to
    stdout, where the cause is: the client's own ``EngineDeadError`` in stderr only points to
    it) and the last error line, and a log from that traceback on, then the end. A traceback
    vLLM logs as a warning (a kernel warm-up it survived) is passed over for a fatal one."""
    log = stdout + stderr
    lines = log.strip().splitlines()
    errors = [x for x in lines if "Error" in x or "Exception" in x] or lines[-1:]
    starts = [m.start() for m in re.finditer(r"(?m)^.*Traceback \(most recent call last\)", log)]
    fatal = [i for i in starts if not LOG_PREFIX.match(log[i:]).group("warning")]
    first = (fatal or starts or [0])[0]
    after = [LOG_PREFIX.sub("", x) for x in log[first:].splitlines()[1:]]
    cause = next((x for x in after if x.strip() and not x.startswith((" ", "Traceback"))),
                 errors[-1])
    said = [cause] + [e for e in errors[-1:] if e != cause]
    return {"skipped": f"vLLM failed: {said}",
            "log": log[first:first + 4000] + "\n...\n" + log[-1500:]}


def run_in_group(cmd: list[str], timeout: float, **popen: Any) -> tuple[int | None, str, str]:
    """Run ``cmd`` in a process group of its own, its output captured: (exit code, or None
    when it outran ``timeout`` seconds; stdout; stderr). The whole group is killed at the
    limit, when it ends, and when this process is terminated (a time limit's SIGTERM): vLLM's
    engine processes would otherwise live on and keep the GPU's memory."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **popen)
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _exit_on_signal) if main else None
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        return proc.returncode, stdout, stderr
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)  # before reading the rest: the engine holds the pipes open
        stdout, stderr = proc.communicate()
        return None, stdout, stderr
    finally:
        _kill_group(proc.pid)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _exit_on_signal(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# what vLLM's log says it chose (its attention backend, MoE and quantization kernels, tuned
# configs or their absence): the figures' peer is then known, not guessed
KERNEL_WORDS = ("backend", "Backend", "MoE", "moe", "kernel", "Kernel", "quantiz", "Marlin",
                "CUTLASS", "DeepGEMM", "config file")


def kernel_lines(log: str, limit: int = 30) -> list[str]:
    """The distinct lines of vLLM's log naming a kernel choice, their timestamps dropped."""
    out: list[str] = []
    for line in log.splitlines():
        text = line.split("] ", 1)[-1].strip()[:300]  # "INFO 11-27 06:50:01 [f.py:12] text"
        if any(w in text for w in KERNEL_WORDS) and text not in out:
            out.append(text)
    return out[:limit]


def kv_capacity(log: str) -> dict[str, Any]:
    """The KV cache vLLM reports at start-up: its size in tokens, and the requests of its
    longest length it holds at once (beside pagedgen's ``kv_cache_token_slots``)."""
    out: dict[str, Any] = {}
    if m := re.search(r"GPU KV cache size: ([\d,]+) tokens", log):
        out["vllm_kv_cache_tokens"] = int(m.group(1).replace(",", ""))
    if m := re.search(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x", log):
        out["vllm_max_concurrency"] = f"{m.group(2)}x at {m.group(1)} tokens"
    return out


NOT_INSTALLED = "vLLM is not installed here (nor under $PAGEDGEN_VLLM_SITE)"


def peer_checkpoint(folder: Path, hf_config: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """A checkpoint folder vLLM loads on dummy weights for ``hf_config`` (its
    ``config.json``, ``peer_config``'s), made at ``folder``; the config and the engine
    arguments it needs besides."""
    cfg, more = peer_config(hf_config)
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    return cfg, more


def vllm_env(site: str, **more: str) -> dict[str, str]:
    """The environment of vLLM's process: no usage reports, the Hub offline, NVLink
    multicast off, ``more``, and its site on the path where it lives apart (``vllm_site``)."""
    env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           "HF_HUB_OFFLINE": "1", **NO_MULTICAST, **more}
    if site:
        env["PYTHONPATH"] = site_path(site)
    return env


def vllm_throughput(hf_config: Any, checkpoint: Path | None, prompts: list[list[int]],
                    output_len: int, engine: dict[str, Any], timeout: float = 3600.0
                    ) -> dict[str, Any]:
    """``prompts`` (token ids) through vLLM, each to ``output_len`` tokens as ``vllm bench
    throughput`` samples them (temperature 1, top_p 1, EOS ignored): its figures, or
    ``{"skipped": reason}`` (not installed, failed, outran ``timeout`` seconds). The model:
    ``checkpoint`` (a directory), else ``hf_config``'s shapes on vLLM's dummy weights;
    ``engine``: more ``vllm.LLM`` arguments (``max_model_len``, ``quantization``, ...)."""
    site = vllm_site()
    if site is None:
        return {"skipped": NOT_INSTALLED}
    with tempfile.TemporaryDirectory() as tmp:
        model, load_format = (str(checkpoint), "auto") if checkpoint else (tmp + "/model", "dummy")
        if checkpoint is None:
            engine = {**engine, **peer_checkpoint(Path(model), hf_config)[1]}
        spec = Path(tmp) / "spec.json"
        spec.write_text(json.dumps({"model": model, "load_format": load_format,
                                    "engine": engine, "prompts": prompts,
                                    "output_len": output_len}))
        out = Path(tmp) / "out.json"
        code, stdout, stderr = run_in_group([sys.executable, "-m", __name__, str(spec),
                                             str(out)], timeout, env=vllm_env(site))
        if code is None:
            return {"skipped": f"vLLM outran {timeout:.0f} s"}
        if code != 0 or not out.exists():
            return failure(stdout, stderr)
        got = json.loads(out.read_text())
    said = stdout + stderr
    return {**got, "kernel_lines": kernel_lines(said), **kv_capacity(said)}


def _worker(spec_path: str, out_path: str) -> None:
    """In vLLM's environment: build ``vllm.LLM`` once, generate every prompt once, write the
    figures."""
    t0 = time.perf_counter()
    import vllm
    from vllm.inputs import TokensPrompt

    spec = json.loads(Path(spec_path).read_text())
    llm = vllm.LLM(model=spec["model"], load_format=spec["load_format"],
                   skip_tokenizer_init=True, seed=0, **spec["engine"])
    startup = time.perf_counter() - t0
    params = vllm.SamplingParams(max_tokens=spec["output_len"], temperature=1.0, top_p=1.0,
                                 ignore_eos=True, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    t = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t
    out_tokens = sum(len(o.token_ids) for r in results for o in r.outputs)
    in_tokens = sum(map(len, spec["prompts"]))
    Path(out_path).write_text(json.dumps({
        "system": f"vLLM {vllm.__version__}", "startup_s": startup, "wall_time_s": wall,
        "requests": len(results), "output_tokens": out_tokens,
        "requests_per_s": len(results) / wall, "output_tokens_per_s": out_tokens / wall,
        "total_tokens_per_s": (in_tokens + out_tokens) / wall}))


if __name__ == "__main__":
    _worker(*sys.argv[1:3])
