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
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from pagedgen import PROFILES_DIR
from pagedgen.errors import PagedgenError

DEFAULT_MODEL = "tiny"
LOAD_FORMATS = ("auto", "safetensors", "dummy")
MAX_SAMPLES = 128  # the largest `n` (parallel samples of one request)
MAX_LOGPROBS = 20  # the most top alternatives per token (`logprobs`, `prompt_logprobs`)
MAX_INT32 = 2**31 - 1


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
        """Raise ValueError naming the first field out of range (NaN and infinities
        included; integers bounded before they reach torch)."""
        check_types(self)
        if self.max_tokens < 0 or (self.max_tokens == 0 and self.prompt_logprobs is None):
            raise ValueError("max_tokens must be >= 1 (0 only with prompt_logprobs: scoring)")
        if self.max_tokens > MAX_INT32:
            raise ValueError(f"max_tokens must be at most {MAX_INT32:,}")
        if not 1 <= self.n <= MAX_SAMPLES:
            raise ValueError(f"n must be in 1..{MAX_SAMPLES}")
        if self.n > 1 and self.max_tokens == 0:
            raise ValueError("n > 1 needs max_tokens >= 1")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in 0..{MAX_LOGPROBS}")
        if not (0 <= self.temperature < math.inf):
            raise ValueError("temperature must be a finite number >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if not 0 <= self.top_k <= MAX_INT32:
            raise ValueError(f"top_k must be in 0..{MAX_INT32:,} (0: off)")
        if self.seed is not None and not -2**63 <= self.seed < 2**63:
            raise ValueError("seed must fit in 64 bits")
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must not be empty (an empty string matches at once)")


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

    def validate(self) -> None:
        """Raise PagedgenError naming the first option out of range (before anything loads)."""
        try:
            check_types(self)
        except ValueError as e:
            raise PagedgenError(f"options: {e}")
        if self.load_format not in LOAD_FORMATS:
            raise PagedgenError(f"unknown load format '{self.load_format}'; use "
                                f"{', '.join(LOAD_FORMATS)}")
        if self.dtype != "auto":
            parse_dtype(self.dtype)
        self.cache_dtype(torch.float32)  # names the choices when unknown
        self.torch_device()
        for name, lo in (("block_size", 1), ("num_blocks", 2), ("max_num_seqs", 1),
                         ("max_num_batched_tokens", 1), ("max_model_len", 2),
                         ("tensor_parallel_size", 1)):
            value = getattr(self, name)
            if value is not None and not lo <= value <= MAX_INT32:
                raise PagedgenError(f"--{name.replace('_', '-')} must be in {lo}.."
                                    f"{MAX_INT32:,}, not {value}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise PagedgenError("--max-num-batched-tokens must be >= --max-num-seqs")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise PagedgenError("gpu_memory_utilization must be in (0, 1]")
        if self.kv_cache_memory is not None and parse_bytes(self.kv_cache_memory) < 1:
            raise PagedgenError(f"--kv-cache-memory must be positive, not "
                                f"{self.kv_cache_memory!r}")
        if not -2**63 <= self.seed < 2**63:
            raise PagedgenError("--seed must fit in 64 bits")

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
        if self.kv_cache_dtype in _DTYPES:
            return _DTYPES[self.kv_cache_dtype]
        raise PagedgenError(f"unknown KV-cache dtype '{self.kv_cache_dtype}'; use auto, fp8, "
                            "float32, float16 or bfloat16")


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
    try:
        num, unit = float(m.group(1)), (m.group(2) or "B").upper().rstrip("B")
    except ValueError:
        num, unit = math.nan, ""
    if not math.isfinite(num):
        raise PagedgenError(f"cannot read a memory size from '{value}' (try 4GiB or 512MB)")
    scale = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
             "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}[unit]
    return int(num * scale)


# ---- run profiles ----------------------------------------------------------------------------

def list_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))


def load_profile(name_or_file: str) -> dict[str, Any]:
    """A profile by name (profiles/NAME.yaml) or by path; returns its parsed sections, with
    ``_path`` (the file) and ``_lines`` (``{"section.field": line}``, for errors)."""
    path = Path(name_or_file)
    if not (path.suffix in (".yaml", ".yml") and path.is_file()):
        path = PROFILES_DIR / f"{name_or_file}.yaml"
    if not path.is_file():
        raise PagedgenError(f"profile '{name_or_file}' not found; "
                            f"built-in profiles: {', '.join(list_profiles())}")
    try:
        loader = yaml.SafeLoader(path.read_text(encoding="utf-8"))
        try:
            node = loader.get_single_node()
            data = loader.construct_document(node) if node is not None else {}
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        at = f":{mark.line + 1}" if mark is not None else ""
        raise PagedgenError(f"{path}{at}: invalid YAML: {e.problem or e.context}")
    except (yaml.YAMLError, OSError, UnicodeDecodeError, RecursionError) as e:
        raise PagedgenError(f"{path}: invalid YAML: {str(e).splitlines()[0] if str(e) else e}")
    if not isinstance(data, dict):
        raise PagedgenError(f"{path}: a profile must be a mapping of sections")
    unknown = set(data) - {"description", "model", "engine", "sampling", "workload"}
    if unknown:
        raise PagedgenError(f"{path}: unknown section(s) {sorted(unknown)}")
    for section in ("engine", "sampling", "workload"):
        if data.get(section) is not None and not isinstance(data[section], dict):
            raise PagedgenError(f"{path}{_line_of(node, section)}: '{section}' must be a "
                                "mapping of fields")
    data["_path"] = str(path)
    data["_lines"] = _field_lines(node)
    return data


def _field_lines(node: yaml.Node) -> dict[str, int]:
    """``{"section": line, "section.field": line}`` of a profile's keys (1-based)."""
    lines: dict[str, int] = {}
    for key, value in node.value if isinstance(node, yaml.MappingNode) else ():
        lines[str(key.value)] = key.start_mark.line + 1
        if isinstance(value, yaml.MappingNode):
            for k, _ in value.value:
                lines[f"{key.value}.{k.value}"] = k.start_mark.line + 1
    return lines


def _line_of(node: yaml.Node, key: str) -> str:
    line = _field_lines(node).get(key)
    return f":{line}" if line else ""


def apply_fields(obj: Any, values: dict[str, Any], where: str,
                 lines: dict[str, int] | None = None) -> Any:
    """Return a copy of dataclass ``obj`` with ``values`` set, rejecting unknown field names
    and values of the wrong type (``where``: the file, or "options"; ``lines``: the line of
    each field, ``where`` then ending in ``:LINE``)."""
    names = {f.name for f in dataclasses.fields(obj)}
    for name, value in values.items():
        at = f"{where}:{lines[name]}" if lines and name in lines else where
        if name not in names:
            raise PagedgenError(f"{at}: unknown field '{name}'; known: {', '.join(sorted(names))}")
        why = type_error(obj, name, value)
        if why:
            raise PagedgenError(f"{at}: {name} {why}")
    return dataclasses.replace(obj, **values)


_TYPE_WORDS = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false",
               "None": "null", "list[str]": "a list of strings", "list[int]": "a list of integers"}


def type_error(obj: Any, name: str, value: Any) -> str | None:
    """Why ``value`` cannot be dataclass field ``name`` of ``obj`` (by its annotation: int,
    float, str, bool, None, list[str], list[int] and unions of them), or None. Floats must be
    finite; bool is not an integer; an integer is a number."""
    kinds = [k.strip() for k in str(_field_types(type(obj))[name]).split("|")]
    if any(_is(k, value) for k in kinds):
        return None
    if isinstance(value, float) and not math.isfinite(value) and "float" in kinds:
        return f"must be a finite number, not {value}"
    return f"must be {' or '.join(_TYPE_WORDS.get(k, k) for k in kinds)}, not {value!r}"


def _is(kind: str, value: Any) -> bool:
    if kind == "None":
        return value is None
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "float":
        return (isinstance(value, (int, float)) and not isinstance(value, bool)
                and math.isfinite(value))
    if kind == "str":
        return isinstance(value, str)
    if kind.startswith("list["):
        return isinstance(value, list) and all(_is(kind[5:-1], v) for v in value)
    return True  # a type this check does not know: left to the field's own checks


def _field_types(cls: type) -> dict[str, Any]:
    return {f.name: f.type for f in dataclasses.fields(cls)}


def check_types(obj: Any) -> None:
    """ValueError for the first field of dataclass ``obj`` whose value has the wrong type."""
    for f in dataclasses.fields(obj):
        why = type_error(obj, f.name, getattr(obj, f.name))
        if why:
            raise ValueError(f"{f.name} {why}")


def configs_from_profile(profile: dict[str, Any] | None) -> tuple[EngineConfig, SamplingParams]:
    """EngineConfig and SamplingParams with a profile's fields applied over the defaults."""
    engine, sampling = EngineConfig(), SamplingParams()
    if not profile:
        return engine, sampling
    where = profile.get("_path", "profile")
    lines = profile.get("_lines") or {}
    engine = apply_fields(engine, profile.get("engine") or {}, where,
                          _section_lines(lines, "engine"))
    sampling = apply_fields(sampling, profile.get("sampling") or {}, where,
                            _section_lines(lines, "sampling"))
    try:
        sampling.validate()
    except ValueError as e:
        field = str(e).split(" ", 1)[0]
        line = lines.get(f"sampling.{field}")
        raise PagedgenError(f"{where}{f':{line}' if line else ''}: sampling: {e}")
    model = profile.get("model")
    if isinstance(model, dict) and model.get("name"):
        engine.model = model["name"] if "config" not in model else where
    elif isinstance(model, str):
        engine.model = model
    return engine, sampling


def _section_lines(lines: dict[str, int], section: str) -> dict[str, int]:
    return {k[len(section) + 1:]: v for k, v in lines.items() if k.startswith(section + ".")}
