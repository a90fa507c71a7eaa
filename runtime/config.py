"""Run settings: engine and sampling parameters, YAML run profiles, and model presets.

A run profile (profiles/NAME.yaml) has up to four sections::

    model:    {name: tiny, tokenizer: byte, config: {model_type: llama, ...}}   # or name: /ckpt/dir
    engine:   {dtype: bfloat16, block_size: 16, load_format: dummy, ...}        # EngineConfig fields
    sampling: {max_tokens: 64, temperature: 0.0, ...}                           # SamplingParams fields
    workload: {...}                                                             # used by `profile`

Command-line options override profile fields, which override the defaults below.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from pagedgen import PROFILES_DIR
from pagedgen.errors import PagedgenError

DEFAULT_MODEL = "tiny"
MAX_SAMPLES = 128  # the largest `n` (parallel samples of one request)
MAX_LOGPROBS = 20  # the most top alternatives per token (`logprobs`, `prompt_logprobs`)


@dataclass
class SamplingParams:
    """Per-request sampling settings (JSONL fields override the run defaults)."""

    max_tokens: int = 64
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None  # None: derived from the run seed and the request index
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1  # samples of the request (parallel sampling: they share the prompt's K/V)
    # log-probabilities with this many top alternatives (None: none), of each output token and
    # of each prompt token after the first
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def validate(self) -> None:
        if self.max_tokens < 0 or (self.max_tokens == 0 and self.prompt_logprobs is None):
            raise ValueError("max_tokens must be >= 1 (0 only with prompt_logprobs: scoring)")
        if not 1 <= self.n <= MAX_SAMPLES:
            raise ValueError(f"n must be in 1..{MAX_SAMPLES}")
        if self.n > 1 and self.max_tokens == 0:
            raise ValueError("n > 1 needs max_tokens >= 1")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in 0..{MAX_LOGPROBS}")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")


@dataclass
class EngineConfig:
    """How the engine runs: model, backend, device, KV cache and batching limits."""

    model: str = DEFAULT_MODEL  # checkpoint directory or preset name (profiles/ with a model config)
    load_format: str = "auto"  # auto | safetensors | dummy
    backend: str = "auto"
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | float32 | float16 | bfloat16
    kv_cache_dtype: str = "auto"  # auto (= dtype) | fp8 (e4m3)
    block_size: int | None = None  # tokens per KV page; None: the backend's default
    num_blocks: int | None = None
    kv_cache_memory: str | int | None = None  # e.g. "4GiB"; default: fill GPU / 1 GiB on CPU
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    seed: int = 0
    enforce_eager: bool = False  # no CUDA graphs
    advance_decode_on_device: bool = True  # reuse the last decode step's metadata (advance_step)
    async_scheduling: bool = True  # launch a decode step before the last one's tokens are read
    fused_kernels: bool = True  # norms, rotary, SwiGLU as Triton kernels on CUDA (else torch ops)
    prefix_caching: bool = True  # reuse the KV blocks of prompt prefixes seen before
    cascade_attention: bool = True  # decodes attend the pages they all share once per step
    tensor_parallel_size: int = 1  # GPUs (ranks) one model is sharded over

    def context_limit(self, hf_config: Any) -> int:
        """``max_model_len``, or the model's own; the engine may lower it to what its KV
        cache holds."""
        return self.max_model_len or int(getattr(hf_config, "max_position_embeddings", 4096))

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dev = torch.device(self.device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise PagedgenError("--device cuda requested but CUDA is not available here")
        return dev

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return parse_dtype(self.dtype)

    def cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        if self.kv_cache_dtype in ("auto", None):
            return model_dtype
        if self.kv_cache_dtype in ("fp8", "fp8_e4m3"):
            return torch.float8_e4m3fn
        return parse_dtype(self.kv_cache_dtype)


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise PagedgenError(f"unknown dtype '{name}'; use one of float32, float16, bfloat16")


def parse_bytes(value: str | int) -> int:
    """'4GiB', '512MB', '1e9' or an int → bytes."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]i?B?|B)?\s*", str(value), re.IGNORECASE)
    if not m:
        raise PagedgenError(f"cannot read a memory size from '{value}' (try 4GiB or 512MB)")
    num, unit = float(m.group(1)), (m.group(2) or "B").upper().rstrip("B")
    scale = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
             "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}[unit]
    return int(num * scale)


# ---- run profiles ----------------------------------------------------------------------------

def list_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))


def load_profile(name_or_file: str) -> dict[str, Any]:
    """A profile by name (profiles/NAME.yaml) or by path; returns its parsed sections."""
    path = Path(name_or_file)
    if not (path.suffix in (".yaml", ".yml") and path.is_file()):
        path = PROFILES_DIR / f"{name_or_file}.yaml"
    if not path.is_file():
        raise PagedgenError(f"profile '{name_or_file}' not found; "
                            f"built-in profiles: {', '.join(list_profiles())}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise PagedgenError(f"{path}: invalid YAML: {str(e).splitlines()[0]}")
    if not isinstance(data, dict):
        raise PagedgenError(f"{path}: a profile must be a mapping of sections")
    unknown = set(data) - {"description", "model", "engine", "sampling", "workload"}
    if unknown:
        raise PagedgenError(f"{path}: unknown section(s) {sorted(unknown)}")
    data["_path"] = str(path)
    return data


def apply_fields(obj: Any, values: dict[str, Any], where: str) -> Any:
    """Return a copy of dataclass ``obj`` with ``values`` set, rejecting unknown field names."""
    names = {f.name for f in dataclasses.fields(obj)}
    unknown = set(values) - names
    if unknown:
        raise PagedgenError(f"{where}: unknown field(s) {sorted(unknown)}; known: {sorted(names)}")
    return dataclasses.replace(obj, **values)


def configs_from_profile(profile: dict[str, Any] | None) -> tuple[EngineConfig, SamplingParams]:
    """EngineConfig and SamplingParams with a profile's fields applied over the defaults."""
    engine, sampling = EngineConfig(), SamplingParams()
    if not profile:
        return engine, sampling
    where = profile.get("_path", "profile")
    engine = apply_fields(engine, profile.get("engine") or {}, f"{where} [engine]")
    sampling = apply_fields(sampling, profile.get("sampling") or {}, f"{where} [sampling]")
    model = profile.get("model")
    if isinstance(model, dict) and model.get("name"):
        engine.model = model["name"] if "config" not in model else where
    elif isinstance(model, str):
        engine.model = model
    return engine, sampling
