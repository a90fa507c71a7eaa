"""Run settings: engine and sampling parameters, each checked (types, ranges, names) before
anything loads. Profiles (``profiles.py``) and command-line options set them; command-line
options override profile fields, which override the defaults below.

Types are pydantic's decision (strict, by each field's annotation: ``type_error``), shared by
profiles, options, API keywords and request lines. Ranges and the rules between fields stay
here as code: their messages name the setting as the user gave it (``--max-num-seqs``, a
profile's line, a request line's field) and say what to do, which pydantic's generic errors
would have to be translated back into field by field.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedgen.errors import PagedgenError

if TYPE_CHECKING:  # torch is imported where a value needs it: `pagedgen --help` stays quick
    import torch

DEFAULT_MODEL = "tiny"
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
MAX_SAMPLES = 128  # the largest `n` (parallel samples of one request)
MAX_LOGPROBS = 20  # the most top alternatives per token (`logprobs`, `prompt_logprobs`)
MAX_INT32 = 2**31 - 1
MAX_BLOCK_SIZE = 1024  # tokens per KV page (vLLM's largest is 256; FA2 needs 256)
MAX_SEATS = 65536  # sequences in a step
MAX_BATCHED_TOKENS = 1 << 20  # tokens in a step
# reasoning parsers (runtime/output/reasoning.py: auto from the tokenizer's vocabulary)
REASONING_PARSERS = ("auto", "none", "think", "qwen3", "deepseek_r1", "harmony", "gpt_oss",
                     "gemma4")
# structured output: the kinds of constraint a line can give (runtime/sampling/structured.py)
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """One line's output constraint, in a canonical, hashable form (equal constraints compile
    once). ``spec``: the JSON schema as compact JSON ("json"), "" ("json_object"), the regex,
    the choices as a JSON list ("choice"), or the EBNF grammar; ``any_whitespace``: whether JSON
    may put any whitespace between its tokens (default: one space after ``:`` and ``,``)."""

    kind: str
    spec: str
    any_whitespace: bool = False

    def validate(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}")


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
    # sampling controls, with vLLM's meanings (runtime/sampling/controls.py)
    presence_penalty: float = 0.0  # minus this from each token already in the output
    frequency_penalty: float = 0.0  # minus this times the token's count in the output
    repetition_penalty: float = 1.0  # tokens of the prompt or output: logit / r if > 0, else * r
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    min_tokens: int = 0  # no EOS, stop token or stop string before this many output tokens
    stop_token_ids: list[int] = field(default_factory=list)  # finish at any of these
    bad_words: list[str] = field(default_factory=list)  # never generated (as vLLM tokenizes)
    include_stop_str_in_output: bool = False  # keep the stop string (or stop token) in the text
    skip_special_tokens: bool = True  # the text leaves special tokens out
    spaces_between_special_tokens: bool = True  # with them in: a space around each
    structured: StructuredOutput | None = None  # the output's grammar (per line)
    # whether the run's reasoning parser (if any) splits the output: off for OpenAI
    # /v1/completions bodies unless the run names a parser (runtime/output/reasoning.py)
    reasoning: bool = True

    def has_controls(self) -> bool:
        """Whether any sampling control is set (``runtime/sampling/controls.py``, min_p)."""
        return bool(self.min_p or self.min_tokens or self.logit_bias or self.stop_token_ids
                    or self.needs_token_history())

    def needs_token_history(self) -> bool:
        """Whether sampling reads the tokens so far (penalties, multi-token bad words): such a
        sequence's step reads the last step's tokens before it samples (it still launches
        ahead)."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.bad_words)

    def validate(self) -> None:
        """Raise ValueError naming the first field out of range (NaN and infinities
        included; integers bounded before they reach torch). Types are checked where values
        come in (``apply_fields`` for profiles and options, the request readers for lines):
        this runs once per request."""
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
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2]")
        if not 0 < self.repetition_penalty <= 100:
            raise ValueError("repetition_penalty must be in (0, 100]")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if not 0 <= self.min_tokens <= MAX_INT32:
            raise ValueError(f"min_tokens must be in 0..{MAX_INT32:,}")
        if self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must be <= max_tokens")
        for token, bias in (self.logit_bias or {}).items():
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= MAX_INT32:
                raise ValueError(f"logit_bias keys must be token ids, not {token!r}")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) \
                    or not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], not "
                                 f"{bias!r}")
        if any(not 0 <= t <= MAX_INT32 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be token ids")
        if any(w == "" for w in self.bad_words):
            raise ValueError("bad_words must not be empty strings")
        if self.structured is not None:
            self.structured.validate()
            if self.ignore_eos or self.min_tokens:
                raise ValueError("structured output ends where its structure ends: it does not "
                                 "combine with ignore_eos or min_tokens")


@dataclass
class EngineConfig:
    """How the engine runs: model, backend, device, KV cache and batching limits."""

    model: str = DEFAULT_MODEL  # checkpoint directory or preset (a profile with a model config)
    load_format: str = "auto"  # auto | safetensors | gguf | dummy
    backend: str = "auto"
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | float32 | float16 | bfloat16
    kv_cache_dtype: str = "auto"  # auto (= dtype) | fp8 (e4m3)
    quantization: str | None = None  # None: the checkpoint's own (if any) | fp8 (at load)
    block_size: int | None = None  # tokens per KV page; None: the backend's default
    # KV-cache blocks: the memory of this many blocks of every layer (a model whose window
    # layers hold only their window's pages gets more of its smaller pages: kv_groups.py)
    num_blocks: int | None = None
    kv_cache_memory: str | int | None = None  # e.g. "4GiB"; default: fill GPU / 1 GiB on CPU
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int | None = None  # None: by the device (hardware.default_max_num_seqs)
    max_num_batched_tokens: int | None = None  # None: by the device (default_batched_tokens)
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    seed: int = 0
    enforce_eager: bool = False  # no CUDA graphs
    # steps with prefills of up to 1,024 tokens replay piecewise CUDA graphs (attention eager):
    # None (default) where decode steps have graphs and not under -tp; True: the same, and the
    # summary says why where they cannot run; False: those steps run eagerly
    mixed_step_graphs: bool | None = None
    advance_decode_on_device: bool = True  # reuse the last decode step's metadata (advance_step)
    async_scheduling: bool = True  # launch a decode step before the last one's tokens are read
    mixed_steps_ahead: bool = True  # steps with prefills launch ahead too (async scheduling)
    # while a step's sampling waits for the grammar worker's masks, schedule the next step
    schedule_during_mask_fill: bool = True
    fused_kernels: bool = True  # norms, rotary, SwiGLU as Triton kernels on CUDA (else torch ops)
    prefix_caching: bool = True  # reuse the KV blocks of prompt prefixes seen before
    # a model mixing sliding-window and full-attention layers: window layers hold only their
    # window's pages (KV groups by layer kind: runtime/engine/kv_groups.py); False: every
    # layer holds a page for every token
    kv_cache_groups: bool = True
    # admit queued requests that share a prompt prefix together (runtime/engine/ordering.py)
    prefix_grouping: bool = True
    # every request's tokens and log-probabilities bitwise those it gets alone, whatever the
    # batch (issue 97; dense models on the triton backend: runtime/worker/batch_invariant.py)
    batch_invariant: bool = False
    cascade_attention: bool = True  # decodes attend the pages they all share once per step
    # ... also the decodes of steps with prefills (flash-attn and triton; flashinfer: not yet)
    cascade_mixed_steps: bool = True
    tensor_parallel_size: int = 1  # GPUs (ranks) one model is sharded over
    # MoE under -tp: each rank holds whole experts, a share of them, instead of a share of
    # every expert's width (the ranks' outputs are summed as before)
    expert_parallel: bool = False
    threads: int | None = None  # torch's CPU threads; None: the cores other processes leave
    # how a reasoning model's thinking is split from its answer (runtime/output/reasoning.py):
    # auto (from the tokenizer's vocabulary) | none | think (qwen3, deepseek_r1) | harmony
    # (gpt_oss)
    reasoning_parser: str = "auto"
    # a few short requests through the engine's own steps at start-up, so that the kernels a
    # run's first steps would make are made before it (runtime/worker/warmup.py); None: on
    # CUDA
    startup_warmup: bool | None = None
    # where each setting was given, for messages: an option (``--num-blocks``), a profile's
    # line (``prof.yaml:3: engine.num_blocks``), an API keyword (``keyword num_blocks``); a
    # field it lacks has its default. Not a setting itself (profiles and options cannot set it).
    origin: dict[str, str] = field(default_factory=dict, compare=False, repr=False,
                                   metadata={"setting": False})

    def named(self, name: str) -> str:
        """Setting ``name`` as the user gave it (its origin), else as its option names it."""
        return self.origin.get(name) or f"--{name.replace('_', '-')}"

    def validate(self, origin: dict[str, str] | None = None) -> None:
        """Raise PagedgenError naming the first setting out of range (before anything loads),
        as the user set it: ``origin`` (default: ``self.origin``) maps a field to where it
        came from; a field it lacks was left at its default."""
        origin = self.origin if origin is None else origin

        def named(name: str) -> str:
            return origin.get(name) or f"--{name.replace('_', '-')}"

        def source(name: str) -> str:
            return origin.get(name, "the default")

        try:
            check_types(self)
        except ValueError as e:
            field = str(e).split(" ", 1)[0]
            raise PagedgenError(f"{named(field)}: {str(e).split(' ', 1)[1]}"
                                if field in origin else f"options: {e}")
        if self.load_format not in LOAD_FORMATS:
            raise PagedgenError(f"{named('load_format')}: unknown load format "
                                f"'{self.load_format}'; use {', '.join(LOAD_FORMATS)}")
        if self.quantization not in (None, "fp8"):
            raise PagedgenError(f"{named('quantization')}: unknown quantization "
                                f"'{self.quantization}'; use fp8 (or none: the checkpoint's own)")
        if self.dtype != "auto":
            parse_dtype(self.dtype)
        self.cache_dtype("float32")  # names the choices when unknown
        self.torch_device()
        for name, lo, hi in (("block_size", 1, MAX_BLOCK_SIZE), ("num_blocks", 2, MAX_INT32),
                             ("max_num_seqs", 1, MAX_SEATS),
                             ("max_num_batched_tokens", 1, MAX_BATCHED_TOKENS),
                             ("max_model_len", 2, MAX_INT32),
                             ("tensor_parallel_size", 1, 64), ("threads", 1, 4096)):
            value = getattr(self, name)
            if value is not None and not lo <= value <= hi:
                raise PagedgenError(f"{named(name)} must be in {lo}..{hi:,}, not {value:,}")
        if self.max_num_seqs is not None and self.max_num_batched_tokens is not None \
                and self.max_num_batched_tokens < self.max_num_seqs:
            raise PagedgenError(
                f"{named('max_num_seqs')} {self.max_num_seqs:,} is more than "
                f"max_num_batched_tokens ({self.max_num_batched_tokens:,}: "
                f"{source('max_num_batched_tokens')}): a step gives each sequence at least one "
                f"token; lower it or raise {named('max_num_batched_tokens')}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise PagedgenError(f"{named('gpu_memory_utilization')} must be in (0, 1]")
        if self.kv_cache_memory is not None and parse_bytes(self.kv_cache_memory) < 1:
            raise PagedgenError(f"{named('kv_cache_memory')} must be positive, not "
                                f"{self.kv_cache_memory!r}")
        if self.kv_cache_memory is not None and self.num_blocks is not None:
            raise PagedgenError(f"{named('kv_cache_memory')} and {named('num_blocks')} both "
                                "size the KV cache: give one")
        if self.expert_parallel and self.tensor_parallel_size < 2:
            raise PagedgenError(f"{named('expert_parallel')} splits a MoE model's experts over "
                                "the tensor-parallel ranks: give -tp 2 or more")
        if not -2**63 <= self.seed < 2**63:
            raise PagedgenError(f"{named('seed')} must fit in 64 bits")
        if self.reasoning_parser not in REASONING_PARSERS:
            raise PagedgenError(f"{named('reasoning_parser')}: unknown parser "
                                f"'{self.reasoning_parser}' ({', '.join(REASONING_PARSERS)})")

    def with_step_limits(self) -> EngineConfig:
        """This config with the limits a device decides set: ``max_num_batched_tokens``
        (``hardware.default_batched_tokens``) and ``max_num_seqs`` (``default_max_num_seqs``, at
        most the tokens), each where no profile or option set it."""
        cfg = self
        if self.max_num_seqs is None or self.max_num_batched_tokens is None:
            from pagedgen.runtime.hardware import default_batched_tokens, default_max_num_seqs

            device = self.torch_device()
            tokens = self.max_num_batched_tokens or default_batched_tokens(device)
            num_seqs = self.max_num_seqs or min(default_max_num_seqs(device), tokens)
            cfg = dataclasses.replace(self, max_num_seqs=num_seqs, max_num_batched_tokens=tokens)
        if cfg.max_num_batched_tokens < cfg.max_num_seqs:
            raise PagedgenError(f"{cfg.named('max_num_batched_tokens')} must be >= "
                                f"{cfg.named('max_num_seqs')}")
        if (cfg.block_size is not None and cfg.block_size < 1) or cfg.max_num_seqs < 1:
            raise PagedgenError(f"{cfg.named('block_size')} and {cfg.named('max_num_seqs')} "
                                "must be positive")
        return cfg

    def context_limit(self, hf_config: Any) -> int:
        """``max_model_len``, or the model's own; the engine may lower it to what its KV
        cache holds."""
        return self.max_model_len or int(getattr(hf_config, "max_position_embeddings", 4096))

    def torch_device(self) -> torch.device:
        return parse_device(self.device, self.named("device"))

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return parse_dtype("bfloat16" if device.type == "cuda" else "float32")
        return parse_dtype(self.dtype)

    def cache_dtype(self, model_dtype: torch.dtype | str) -> torch.dtype:
        """The KV cache's dtype for a model computing in ``model_dtype`` (a name, or a dtype)."""
        if self.kv_cache_dtype in ("auto", None):
            return parse_dtype(model_dtype) if isinstance(model_dtype, str) else model_dtype
        if self.kv_cache_dtype in ("fp8", "fp8_e4m3"):
            import torch

            return torch.float8_e4m3fn
        if self.kv_cache_dtype in _DTYPES:
            return parse_dtype(self.kv_cache_dtype)
        raise PagedgenError(f"unknown KV-cache dtype '{self.kv_cache_dtype}'; use auto, fp8, "
                            "float32, float16 or bfloat16")


def parse_device(name: str, named: str = "--device") -> torch.device:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N`` as a torch device that exists here; any other
    name, or a GPU this machine lacks, is a one-line error (``named``: where it was given)."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    m = re.fullmatch(r"(cpu|cuda)(?::(\d{1,4}))?", str(name))
    if m is None or (m.group(1) == "cpu" and m.group(2) not in (None, "0")):
        raise PagedgenError(f"unknown device '{name}'; use auto, cpu, cuda or cuda:N")
    if m.group(1) == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise PagedgenError(f"{named} {name}: CUDA is not available here (use cpu)")
    index = int(m.group(2) or 0)
    if index >= torch.cuda.device_count():
        raise PagedgenError(f"{named} {name}: this machine has {torch.cuda.device_count()} "
                            f"GPU(s), cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return torch.device("cuda", index) if m.group(2) is not None else torch.device("cuda")


_DTYPES = {"float32": "float32", "fp32": "float32", "float": "float32",
           "float16": "float16", "fp16": "float16", "half": "float16",
           "bfloat16": "bfloat16", "bf16": "bfloat16"}  # each name: torch's


def parse_dtype(name: str) -> torch.dtype:
    try:
        torch_name = _DTYPES[name]
    except KeyError:
        raise PagedgenError(f"unknown dtype '{name}'; use one of float32, float16, bfloat16")
    import torch

    return getattr(torch, torch_name)


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


# ---- field types (profiles, options, request lines) -------------------------------------
# pydantic decides (strict: no coercion, bool is no integer, floats finite); the message names
# the field's type in words, as each source (an option, a profile's line, a request line) says it

_TYPE_WORDS = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false",
               "None": "null", "list[str]": "a list of strings", "list[int]": "a list of integers",
               "dict[int, float]": "an object of token id: bias",
               "StructuredOutput": "given per line (response_format or structured_outputs)"}


def type_error(cls: type, name: str, value: Any) -> str | None:
    """Why ``value`` cannot be field ``name`` of dataclass ``cls`` (by its annotation), or
    None."""
    from pydantic import ValidationError

    try:
        _validator(cls, name).validate_python(value)
        return None
    except ValidationError as e:
        if isinstance(value, float) and any(err["type"] == "finite_number"
                                            for err in e.errors()):
            return f"must be a finite number, not {value}"
    kinds = [k.strip() for k in str(_annotations(cls)[name]).split("|")]
    return f"must be {' or '.join(_TYPE_WORDS.get(k, k) for k in kinds)}, not {value!r}"


@functools.cache
def _annotations(cls: type) -> dict[str, Any]:
    return {f.name: f.type for f in dataclasses.fields(cls)}


@functools.cache
def _validator(cls: type, name: str) -> Any:
    """pydantic's strict validator of field ``name`` (built once, on first use: importing
    pydantic is left to a run that checks a value, not ``--help``)."""
    import typing

    from pydantic import ConfigDict, TypeAdapter

    hint = typing.get_type_hints(cls)[name]
    return TypeAdapter(hint, config=ConfigDict(strict=True, allow_inf_nan=False))


def check_types(obj: Any) -> None:
    """ValueError for the first setting of dataclass ``obj`` whose value has the wrong type."""
    for f in dataclasses.fields(obj):
        if f.metadata.get("setting", True):
            why = type_error(type(obj), f.name, getattr(obj, f.name))
            if why:
                raise ValueError(f"{f.name} {why}")
