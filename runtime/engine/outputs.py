"""What the engine hands out for a finished request: one ``RequestOutput`` (vLLM's shape) that
every output format, the Python API and the benchmarks read, with nothing left to ask of the
engine: the texts are final (stop strings cut), the prompt's text is there, and each
log-probability entry carries its token's bytes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TokenLogprob:
    """One token's log-probability and its ``top`` alternatives ``[[id, logprob], ...]``, with
    the bytes each stands for (``token_bytes``, ``top_bytes``)."""

    token_id: int
    logprob: float
    top: list[list]
    token_bytes: bytes = b""
    top_bytes: list[bytes] = field(default_factory=list)

    @property
    def token(self) -> str:
        """The token's text: its bytes as UTF-8, U+FFFD for part of a character."""
        return self.token_bytes.decode("utf-8", errors="replace")

    @property
    def top_tokens(self) -> list[str]:
        return [b.decode("utf-8", errors="replace") for b in self.top_bytes]


@dataclass
class CompletionOutput:
    """One sample of a request."""

    index: int
    text: str  # a reasoning model's: the answer
    token_ids: list[int]
    # one of sequence.FINISH_REASONS, or for a sample that ended while still reasoning (no
    # answer began) one of sequence.REASONING_FINISH_REASONS
    finish_reason: str
    logprobs: list[TokenLogprob] | None = None
    reasoning_content: str | None = None  # a reasoning model's reasoning (its parser's split)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class RequestOutput:
    """A finished request: its prompt and its ``n`` samples (``outputs``); ``.text``,
    ``.token_ids``, ``.finish_reason`` and ``.logprobs`` are its first sample's."""

    request: Any  # the caller's handle (a line of the input, an API request)
    prompt: str  # the request's text, or its token ids decoded
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[TokenLogprob] | None = None  # of every prompt token after the first
    n: int = 1  # samples asked for (a line with n > 1 lists its choices)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return sum(o.num_output_tokens for o in self.outputs)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return self.outputs[0].logprobs


def request_output(samples: list, tokenizer, texts_of) -> RequestOutput:
    """The ``RequestOutput`` of a request's finished samples (``Sequence``s, in sample order);
    ``texts_of(seq)`` is a sample's final (text, reasoning or None)."""
    first = samples[0]
    req = first.request
    prompt = getattr(req, "prompt", None)
    if not isinstance(prompt, str):
        prompt = tokenizer.decode(first.prompt_token_ids)
    outputs = []
    for s in samples:
        text, reasoning = texts_of(s)
        outputs.append(CompletionOutput(
            s.sample_index, text, list(s.output_token_ids), _finish_reason(s),
            _logprobs(tokenizer, s.output_token_ids, s.logprobs), reasoning))
    prompt_lp = None
    if first.prompt_logprobs is not None:
        prompt_lp = _logprobs(tokenizer, first.prompt_token_ids[1:], first.prompt_logprobs)
    return RequestOutput(req, prompt, list(first.prompt_token_ids), outputs, prompt_lp,
                         first.params.n)


def _finish_reason(seq) -> str:
    """A sample's finish reason; ``..._in_reasoning`` where it ended before its answer."""
    r = seq.reasoning
    if r is not None and r.ended_in_reasoning(len(seq.output_token_ids)) \
            and seq.finish_reason in ("stop", "length"):
        return f"{seq.finish_reason}_in_reasoning"
    return seq.finish_reason


def _logprobs(tokenizer, token_ids, entries) -> list[TokenLogprob] | None:
    if entries is None:
        return None
    return [TokenLogprob(t, lp, top, tokenizer.token_bytes(t),
                         [tokenizer.token_bytes(i) for i, _ in top])
            for t, (lp, top) in zip(token_ids, entries)]
