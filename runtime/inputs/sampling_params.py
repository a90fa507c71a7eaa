"""vLLM's ``SamplingParams`` for the Python API: its fields, with vLLM's defaults (``max_tokens``
16, ``temperature`` 1.0), so that a vLLM offline script runs with its import line changed.

An object states a request's whole sampling, as in vLLM: every field counts, its defaults too
(the preset's or profile's sampling defaults do not fill in, as they do for a dict of fields).
vLLM fields pagedgen does not run are refused in one line when set to anything but their
default; ``detokenize=False`` is taken (texts are still made: they cost little here).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from pagedgen.errors import PagedgenError

# vLLM's fields that pagedgen does not run, with their defaults (set otherwise: refused)
_NOT_RUN = {"best_of": None, "allowed_token_ids": None, "logits_processors": None,
            "truncate_prompt_tokens": None, "output_kind": None, "extra_args": None,
            "flat_logprobs": False}


@dataclass
class SamplingParams:
    """vLLM's sampling settings, by its names and defaults (``vllm.SamplingParams``)."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to the model's context
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    structured_outputs: Any = None  # a dict of vLLM's keys (json, regex, choice, grammar)
    best_of: int | None = None
    allowed_token_ids: list[int] | None = None
    logits_processors: Any = None
    truncate_prompt_tokens: int | None = None
    output_kind: Any = None
    extra_args: dict | None = None
    flat_logprobs: bool = False

    def request_fields(self, max_model_len: int) -> dict[str, Any]:
        """The request's sampling fields as a pagedgen line names them (every one: an object
        is the request's whole sampling). ``max_tokens`` None: the model's context."""
        for name, default in _NOT_RUN.items():
            if getattr(self, name) != default and not (name == "best_of"
                                                       and self.best_of == self.n):
                raise PagedgenError(f"SamplingParams.{name} is not run by pagedgen; leave it "
                                    "unset")
        out = {f.name: getattr(self, f.name) for f in fields(self)
               if f.name not in _NOT_RUN and f.name != "detokenize"}
        out["top_k"] = max(0, self.top_k)  # vLLM's -1: off, as 0
        out["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        out["stop_token_ids"] = list(self.stop_token_ids or [])
        out["bad_words"] = list(self.bad_words or [])
        if self.max_tokens is None:  # the run stops each sample at the context's end
            out["max_tokens"] = max_model_len
        structured = out.pop("structured_outputs")
        if structured is not None:
            out["structured_outputs"] = structured if isinstance(structured, dict) \
                else {k: v for k, v in vars(structured).items() if v is not None}
        return {k: v for k, v in out.items() if v is not None}

    @classmethod
    def from_fields(cls, values: dict[str, Any]) -> SamplingParams:
        """An object of the fields a pagedgen run's defaults set (the rest vLLM's)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})
